"""The real node of the e2e cluster: real containers on a real kubelet, beside the KWOK fakes.

Pieces (docs/e2e.md, "The real node"): Debian's containerd (its CRI plugin) and runc, kubelet and
kube-proxy of the pinned Kubernetes version, Debian's CNI plugins on a bridge of our own, CoreDNS
on the host behind a selector-less `kube-dns` Service, a pause image built here, and local
PersistentVolumes (one a freshly formatted ext4 loop device, as a cloud disk would be).

Every address a pod or Service uses is on this machine: the bridge's subnet, and Service IPs that
kube-proxy rewrites to it. A guard chain rejects anything else leaving the bridge and any Service
IP that was not rewritten, so nothing a test does can send a packet off the machine.

Its addresses and the configuration files of its programs are in real_node_config.py.

Needs root (CI runs as root). The node is named after this machine's hostname, tainted so that only
pods that tolerate it (the real-workload tests) land there, and torn down completely on stop:
pods, containers, mounts, the loop device, the bridge and the guard chain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from real_node_config import (
    EXT4_VOLUME,
    HOME,
    NODE_LABEL,
    PAUSE_IMAGE,
    SERVICE_CIDR,
    TAINT,
    Site,
    cni_config,
    containerd_config,
    corefile,
    dns_objects,
    kube_proxy_config,
    kubelet_config,
    single_file_image,
    storage_objects,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

TOLERATION = {"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}

CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")


def node_components(site: Site) -> tuple[str, ...]:
    return ("containerd", "kubelet") + (("kube-proxy", "coredns") if site.services else ())


NODE_COMPONENTS = node_components(HOME)


class NodeError(RuntimeError):
    pass


def enabled() -> bool:
    """The real node runs unless DILOCO_E2E_REAL_NODE=0 (it needs root and Linux)."""
    return os.environ.get("DILOCO_E2E_REAL_NODE", "1") not in ("0", "false") and os.geteuid() == 0


def run(argv: list[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r


def ensure_packages() -> None:
    """Debian's containerd, runc, CNI plugins, iptables and e2fsprogs (CI is a fresh machine)."""
    wanted = {
        "containerd": "containerd",
        "runc": "runc",
        "containernetworking-plugins": "/usr/lib/cni/bridge",
        "iptables": "iptables",
        "e2fsprogs": "mkfs.ext4",
        "iproute2": "ip",
        "conntrack": "conntrack",  # kube-proxy clears stale UDP entries (DNS) with it
    }
    missing = [
        pkg for pkg, probe in wanted.items() if not (Path(probe).exists() or shutil.which(probe))
    ]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


def cni_bin_dir() -> str:
    for d in CNI_BIN_DIRS:
        if (Path(d) / "bridge").exists():
            return d
    raise NodeError(
        f"no CNI plugins in {CNI_BIN_DIRS} (apt-get install containernetworking-plugins)"
    )


# ----------------------------------------------------------------------------------------------
# network: the bridge and the guard


def bridge_up(site: Site) -> None:
    """The bridge exists before the apiserver starts: it advertises the gateway address."""
    bridge, gateway = site.bridge, site.gateway
    if run(["ip", "link", "show", bridge], check=False).returncode != 0:
        run(["ip", "link", "add", bridge, "type", "bridge"])
    addrs = run(["ip", "-4", "-o", "addr", "show", "dev", bridge]).stdout
    if f" {gateway}/" not in addrs:
        run(["ip", "addr", "add", f"{gateway}/{site.pod_subnet.split('/')[1]}", "dev", bridge])
    run(["ip", "link", "set", bridge, "up"])
    for key, value in (
        ("net/ipv4/ip_forward", "1"),
        ("net/bridge/bridge-nf-call-iptables", "1"),
    ):
        p = Path("/proc/sys") / key
        if p.exists() and p.read_text().strip() != value:
            p.write_text(value)
    guard_up(site)


def _guard_rules(site: Site) -> list[list[str]]:
    return [
        # a pod may talk to the bridge (pods, the host's gateway address) and nothing beyond it
        ["-i", site.bridge, "!", "-o", site.bridge, "-j", "REJECT"],
        # a Service IP that kube-proxy did not rewrite has no endpoint: refuse, never route it
        ["-d", SERVICE_CIDR, "-j", "REJECT"],
    ]


def guard_up(site: Site) -> None:
    chain = site.guard_chain
    if run(["iptables", "-w", "-L", chain, "-n"], check=False).returncode != 0:
        run(["iptables", "-w", "-N", chain])
    run(["iptables", "-w", "-F", chain])
    for rule in _guard_rules(site):
        run(["iptables", "-w", "-A", chain, *rule])
    for parent in ("FORWARD", "OUTPUT"):
        if run(["iptables", "-w", "-C", parent, "-j", chain], check=False).returncode != 0:
            run(["iptables", "-w", "-I", parent, "1", "-j", chain])


def network_down(site: Site) -> None:
    chain = site.guard_chain
    for parent in ("FORWARD", "OUTPUT"):
        while run(["iptables", "-w", "-D", parent, "-j", chain], check=False).returncode == 0:
            pass
    run(["iptables", "-w", "-F", chain], check=False)
    run(["iptables", "-w", "-X", chain], check=False)
    run(["ip", "link", "del", site.bridge], check=False)


def cgroup_root_up(site: Site) -> None:
    """The kubelet refuses a cgroup root that does not exist: make it in every v1 hierarchy
    (a new cpuset cgroup starts with no CPUs or memory nodes: give it its parent's)."""
    if site.cgroup_root == "/":
        return
    for hier in Path("/sys/fs/cgroup").iterdir():
        if not (hier / "cgroup.procs").exists() or (hier / "cgroup.controllers").exists():
            continue  # not a v1 hierarchy (a cgroup v2 mount has cgroup.controllers)
        d = hier / site.cgroup_dir
        d.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (d / knob).exists() and not (d / knob).read_text().strip():
                (d / knob).write_text((hier / knob).read_text())


# ----------------------------------------------------------------------------------------------
# the node


@dataclasses.dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    pause: Path


class RealNode:
    """Started by LocalCluster after its control plane; `spawn` and `api_apply` are the cluster's."""

    def __init__(
        self,
        state_dir: Path,
        cache: Path,
        bins: NodeBinaries,
        spawn: Callable[[str, list[str]], None],
        apply: Callable[[list[dict[str, Any]]], object],
        log: Callable[[str], None],
        site: Site = HOME,
    ) -> None:
        self.site = site
        self.st = state_dir / "node"
        self.cache = cache
        self.bins = bins
        self._spawn = spawn
        self._apply = apply
        self._log = log
        self.name = site.node_name
        self.sock = self.st / "containerd.sock"
        self.images: dict[str, str] = {}
        self._lock: IO[str] | None = None

    @property
    def images_root(self) -> Path:
        """Cached across runs, so that images are imported once; one per site (a containerd
        owns its root)."""
        return self.cache / ("node" if self.site == HOME else f"node-{self.site.key}")

    # -- lifecycle
    def lock(self) -> None:
        """One real node per site: it owns the site's bridge, guard chain and cgroup root."""
        lock = Path(f"/run/diloco-e2e-node{'' if self.site == HOME else '-' + self.site.key}.lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock, "w")  # noqa: SIM115 - held until unlock()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            f.close()
            raise NodeError(
                f"another e2e cluster's real node holds {lock}; stop it first "
                "(e2e/cluster/down.sh) or set DILOCO_E2E_REAL_NODE=0"
            ) from e
        self._lock = f

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def prepare(self) -> None:
        """Before the apiserver: packages, the bridge and the guard."""
        ensure_packages()
        bridge_up(self.site)
        cgroup_root_up(self.site)

    def start_runtime(self) -> None:
        """containerd, and the images the node needs (imported once into a cached root)."""
        st = self.st
        for sub in ("containerd-state", "cni/net.d", "cni/ipam", "kubelet", "volumes", "pod-logs"):
            (st / sub).mkdir(parents=True, exist_ok=True)
        root = self.images_root
        (root / "containerd-root").mkdir(parents=True, exist_ok=True)
        (st / f"cni/net.d/10-{self.site.network_name}.conflist").write_text(
            json.dumps(cni_config(self.site, st / "cni/ipam"), indent=2)
        )
        (st / "containerd.toml").write_text(
            containerd_config(
                root / "containerd-root",
                st / "containerd-state",
                self.sock,
                st / "cni/net.d",
                cni_bin_dir(),
                st / "runc",
            )
        )
        self._spawn("containerd", ["/usr/bin/containerd", "--config", str(st / "containerd.toml")])
        deadline = time.monotonic() + 60
        while self.ctr("version", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise NodeError(f"containerd did not answer on {self.sock}")
            time.sleep(0.2)
        self._remove_leftover_containers()

    def ctr(self, *args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        return run(["ctr", "--address", str(self.sock), "-n", "k8s.io", *args], check=check, **kw)

    def import_images(self, tars: dict[str, Path]) -> None:
        """Import each image (name -> docker-save tar) that containerd does not hold yet."""
        have = set(self.ctr("images", "ls", "-q").stdout.split())
        for image, tar in tars.items():
            if _normalized(image) in have:
                continue
            t0 = time.monotonic()
            self.ctr("images", "import", "--no-unpack=false", str(tar))
            self._log(
                f"imported {image} into the node's containerd in {time.monotonic() - t0:.0f}s"
            )

    def pause_tar(self) -> Path:
        """The sandbox image: our pause program alone in a docker-save archive (built here)."""
        out = self.bins.pause.parent / "pause-image.tar"
        if out.exists():
            return out
        work = self.st / "pause-image"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        single_file_image(work, self.bins.pause, PAUSE_IMAGE, out)
        return out

    def start_kubelet(
        self,
        pki: Any,
        server: str,
        free_port: Callable[[], int],
        write_kubeconfig: Callable[[Path, str, Path, Path, Path, str], None],
    ) -> None:
        st = self.st
        kc = _client_kubeconfig(
            st, pki, server, write_kubeconfig, "kubelet", f"system:node:{self.name}"
        )
        resolv = st / "resolv.conf"
        resolv.write_text("# pods use the cluster DNS only\n")
        (st / "kubelet.yaml").write_text(
            json.dumps(
                kubelet_config(
                    self.site,
                    pki.path("ca.crt"),
                    self.sock,
                    resolv,
                    (free_port(), free_port()),
                    st / "pod-logs",
                )
            )
        )
        self._spawn(
            "kubelet",
            [
                str(self.bins.kubelet),
                f"--config={st / 'kubelet.yaml'}",
                f"--kubeconfig={kc}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.site.gateway}",
                f"--node-labels={NODE_LABEL}=true",
                f"--root-dir={st / 'kubelet'}",
                f"--cert-dir={st / 'kubelet' / 'pki'}",
                "--v=1",
            ],
        )
        if self.site.services:
            self._start_services(pki, server, free_port, write_kubeconfig)

    def _start_services(
        self,
        pki: Any,
        server: str,
        free_port: Callable[[], int],
        write_kubeconfig: Callable[[Path, str, Path, Path, Path, str], None],
    ) -> None:
        """kube-proxy for Services and CoreDNS behind kube-dns (the home site only)."""
        st = self.st
        pkc = _client_kubeconfig(
            st, pki, server, write_kubeconfig, "kube-proxy", "system:kube-proxy"
        )
        (st / "kube-proxy.yaml").write_text(
            json.dumps(kube_proxy_config(pkc, self.name, (free_port(), free_port())))
        )
        self._spawn("kube-proxy", [str(self.bins.kube_proxy), f"--config={st / 'kube-proxy.yaml'}"])
        ckc = _client_kubeconfig(st, pki, server, write_kubeconfig, "coredns", "coredns")
        (st / "Corefile").write_text(corefile(ckc))
        self._spawn("coredns", [str(self.bins.coredns), "-conf", str(st / "Corefile")])
        self._apply(dns_objects())

    def make_volumes(self) -> None:
        """Local PVs: a fresh ext4 loop device (lost+found and all) and two plain directories.
        The ext4 one is the smallest, so a claim binds to it first."""
        vols = self.st / "volumes"
        img = vols / f"{EXT4_VOLUME}.img"
        mnt = vols / EXT4_VOLUME
        mnt.mkdir(parents=True, exist_ok=True)
        with open(img, "wb") as f:
            f.truncate(1 << 30)  # sparse
        run(["mkfs.ext4", "-q", "-F", str(img)])
        dev = run(["losetup", "--find", "--show", str(img)]).stdout.strip()
        (self.st / "loopdev").write_text(dev)
        run(["mount", dev, str(mnt)])
        volumes: dict[str, tuple[Path, str]] = {EXT4_VOLUME: (mnt, "1Gi")}
        for i in range(2):
            d = vols / f"dir-{i}"
            d.mkdir(exist_ok=True)
            volumes[f"local-dir-{i}"] = (d, "2Gi")
        self._apply(storage_objects(self.name, volumes))

    def stop(
        self, kubectl: Callable[..., Any] | None, terminate: Callable[[list[str]], None]
    ) -> None:
        """Pods first (the kubelet tears them down properly), then the node's programs, then
        anything left: containers, mounts, the loop device, cgroups, the bridge and the guard."""
        if kubectl is not None:
            with contextlib.suppress(Exception):
                kubectl(
                    "delete",
                    "pods",
                    "--all-namespaces",
                    "--field-selector",
                    f"spec.nodeName={self.name}",
                    "--grace-period=1",
                    "--wait=true",
                    "--timeout=40s",
                )
        terminate(list(node_components(self.site)[1:]))
        if self.sock.exists():
            with contextlib.suppress(Exception):
                self._remove_leftover_containers()
        terminate(["containerd"])
        if self.site.services:
            with contextlib.suppress(Exception):
                run([str(self.bins.kube_proxy), "--cleanup"], check=False, timeout=60)
        self._unmount_all()
        dev_file = self.st / "loopdev"
        if dev_file.exists():
            run(["losetup", "-d", dev_file.read_text().strip()], check=False)
            dev_file.unlink()
        _remove_empty_cgroups(self.site.cgroup_dir)
        network_down(self.site)
        self.unlock()

    # -- internals
    def _remove_leftover_containers(self) -> None:
        tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for t in tasks:
            self.ctr("tasks", "kill", "-s", "SIGKILL", t, check=False)
        deadline = time.monotonic() + 10
        for t in tasks:
            while self.ctr("tasks", "rm", "-f", t, check=False).returncode != 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        for c in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("containers", "rm", c, check=False)

    def _unmount_all(self) -> None:
        roots = (f"{self.st}/", f"{self.images_root}/")
        mounts = []
        with contextlib.suppress(OSError):
            for line in Path("/proc/mounts").read_text().splitlines():
                target = line.split()[1].replace("\\040", " ")
                if target.startswith(roots):
                    mounts.append(target)
        for m in sorted(mounts, key=len, reverse=True):
            run(["umount", "-l", m], check=False)


def _client_kubeconfig(
    st: Path,
    pki: Any,
    server: str,
    write_kubeconfig: Callable[[Path, str, Path, Path, Path, str], None],
    client: str,
    user: str,
) -> Path:
    """<st>/<client>.kubeconfig: the node program `client` with its own certificate (the PKI's
    <client>.crt/.key, made for the identity `user`)."""
    path = st / f"{client}.kubeconfig"
    write_kubeconfig(
        path, server, pki.path("ca.crt"), pki.path(f"{client}.crt"), pki.path(f"{client}.key"), user
    )
    return path


def _normalized(image: str) -> str:
    """How containerd names an image imported from a docker-save archive."""
    name = image if "/" in image else f"library/{image}"
    return name if name.split("/")[0].count(".") else f"docker.io/{name}"


def _remove_empty_cgroups(name: str) -> None:
    for hier in Path("/sys/fs/cgroup").iterdir():
        top = hier / name
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
