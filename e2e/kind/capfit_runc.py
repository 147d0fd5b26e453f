#!/usr/bin/env python3
"""runc, with each container's capabilities cut to what this host can grant.

A privileged container (every kind node is one) asks for every capability the kernel knows.
Where the host's own bounding set lacks some (here: CAP_SYS_RESOURCE), runc fails with "unable
to apply caps: operation not permitted", and `--cap-drop` cannot help: `--privileged` adds them
back. This wrapper is registered as the kind engine's default runtime: before `create` and `run`
it drops, from the bundle's config.json, every capability outside the bounding set of the
process that runs it (the engine's), and before `exec` the same from the `--process` file; then
it becomes the real runc with the same arguments. Nothing else is changed.

Env: CAPFIT_RUNC (the real runc; default /usr/sbin/runc, then runc on PATH).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

# Linux capability numbers (include/uapi/linux/capability.h), as runc names them.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
]
SETS = ("bounding", "effective", "inheritable", "permitted", "ambient")


def grantable() -> set[str]:
    """The capabilities in this process's bounding set."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("CapBnd:"))
    mask = int(line.split()[1], 16)
    return {name for bit, name in enumerate(CAPABILITIES) if mask >> bit & 1}


def fit(process: dict[str, object], allowed: set[str]) -> bool:
    """Drop what cannot be granted from an OCI process's capability sets; True if any went."""
    caps = process.get("capabilities")
    if not isinstance(caps, dict):
        return False
    changed = False
    for key in SETS:
        names = caps.get(key)
        if isinstance(names, list):
            kept = [n for n in names if n in allowed or n not in CAPABILITIES]
            changed |= len(kept) != len(names)
            caps[key] = kept
    return changed


def rewrite(path: str, allowed: set[str], inside: str | None) -> None:
    with open(path) as f:
        doc = json.load(f)
    target = doc[inside] if inside else doc
    if fit(target, allowed):
        tmp = f"{path}.capfit"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)


def flag_value(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def main(argv: list[str]) -> None:
    real = os.environ.get("CAPFIT_RUNC") or (
        "/usr/sbin/runc" if os.path.exists("/usr/sbin/runc") else shutil.which("runc")
    )
    if not real:
        sys.exit("capfit-runc: no runc found (set CAPFIT_RUNC)")
    command = next((a for a in argv if a in ("create", "run", "exec")), None)
    if command is not None:
        rest = argv[argv.index(command) + 1 :]
        allowed = grantable()
        if command == "exec":
            process = flag_value(rest, "--process", "-p")
            if process:
                rewrite(process, allowed, None)
        else:
            bundle = flag_value(rest, "--bundle", "-b") or os.getcwd()
            rewrite(os.path.join(bundle, "config.json"), allowed, "process")
    os.execv(real, [real, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
