"""`diloco join-credential RUN --group G`: mint what an away cluster needs to join a run whose
home is this cluster, as one Secret manifest to apply there (docs/multi-cluster.md).

The credential is minted from the run secret (read from the home cluster, or from a file), is
good for one run and one unit group until it expires, and is revoked by adding its id, printed
on stderr, to the home run's `spec.syncer.revokedCredentials`. The run secret itself never
leaves home."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from diloco_trainer.join_credentials import (
    JoinCredential,
    mint_join_credential,
    parse_join_credential,
)

from diloco_operator.api.clusters import CREDENTIAL_KEY
from diloco_operator.api.pod_security import TOKEN_KEY

DURATION = re.compile(r"^([0-9]+)([smhd])$")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(text: str) -> int:
    """`90s`, `30m`, `72h`, `7d` -> seconds; argparse-friendly ValueError otherwise."""
    match = DURATION.match(text)
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 30m, 72h or 7d")
    return int(match.group(1)) * UNIT_SECONDS[match.group(2)]


def credential_secret(name: str, cred: JoinCredential) -> dict[str, Any]:
    """The away cluster's Secret holding the credential under the key its run names."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "labels": {"diloco.dev/run": cred.run, "diloco.dev/group": cred.group},
            "annotations": {
                "diloco.dev/credential-id": cred.id,
                "diloco.dev/credential-expires": time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime(cred.expires)
                ),
            },
        },
        "stringData": {CREDENTIAL_KEY: cred.serialise()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the home DilocoRun's name")
    parser.add_argument("--group", required=True, help="the unit group the away cluster runs")
    parser.add_argument(
        "--expires-in", type=seconds, default=seconds("7d"), help="e.g. 72h (default 7d)"
    )
    parser.add_argument("-n", "--namespace", default="default", help="the home run's namespace")
    parser.add_argument(
        "--run-secret-file",
        type=Path,
        help="read the run secret from this file instead of the home cluster's "
        "<run>-token Secret (kubeconfig of the home cluster otherwise)",
    )
    parser.add_argument(
        "--secret-name", help="name of the Secret to print (default <run>-<group>-join)"
    )


def run_from_args(args: argparse.Namespace) -> int:
    try:
        secret = _run_secret(args)
        cred = parse_join_credential(
            mint_join_credential(secret, args.run, args.group, int(time.time()) + args.expires_in)
        )
    except (OSError, ValueError, LookupError) as exc:
        print(f"diloco join-credential: {exc}", file=sys.stderr)
        return 2
    name = args.secret_name or f"{args.run}-{args.group}-join"
    print(yaml.safe_dump(credential_secret(name, cred), sort_keys=False), end="")
    print(
        f"# credential {cred.id} for run {cred.run}, group {cred.group}, expires "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(cred.expires))}; revoke it by "
        f"adding {cred.id} to spec.syncer.revokedCredentials of the home run",
        file=sys.stderr,
    )
    return 0


def _run_secret(args: argparse.Namespace) -> str:
    if args.run_secret_file is not None:
        text: str = args.run_secret_file.read_text().strip()
        if not text:
            raise ValueError(f"{args.run_secret_file}: empty")
        return text
    from diloco_operator.k8s import kube  # the Kubernetes client only when a cluster is asked

    kube.load_config()
    found = asyncio.run(kube.read_token(args.namespace, f"{args.run}-token", TOKEN_KEY))
    if found is None:
        raise LookupError(
            f"Secret {args.namespace}/{args.run}-token has no {TOKEN_KEY}: is {args.run} a "
            "home run of this cluster?"
        )
    return found
