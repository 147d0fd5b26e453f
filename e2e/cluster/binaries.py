"""The pinned versions (versions.env), the cache (~/.cache/diloco-e2e) and the binaries build.sh
puts there."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import real_node
from procs import ClusterError, log

HERE = Path(__file__).resolve().parent


def cache_root() -> Path:
    env = os.environ.get("DILOCO_E2E_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "diloco-e2e"


def default_state_dir() -> Path:
    env = os.environ.get("DILOCO_E2E_STATE_DIR")
    return Path(env).expanduser() if env else cache_root() / "state"


def read_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


@dataclasses.dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    kwok_stages: Path
    node: real_node.NodeBinaries

    def all_paths(self) -> list[Path]:
        return [
            self.etcd,
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kubectl,
            self.kwok,
            self.helm,
            *dataclasses.astuple(self.node),
        ]


def binaries(build: bool = True) -> Binaries:
    """Paths of the cached binaries; runs build.sh first when some are missing and build=True."""
    b = expected_binaries()
    missing = [p for p in b.all_paths() if not os.access(p, os.X_OK)]
    if not (b.kwok_stages / ".complete").exists():
        missing.append(b.kwok_stages)
    if missing:
        if not build:
            raise ClusterError(
                f"missing binaries {[str(m) for m in missing]}: run {HERE / 'build.sh'}"
            )
        log(
            f"binaries missing ({', '.join(p.name for p in missing)}): running build.sh "
            "(a cold build takes long, see e2e/cluster/README.md)"
        )
        r = subprocess.run(["bash", str(HERE / "build.sh")], stdout=sys.stderr)
        if r.returncode != 0:
            raise ClusterError(f"build.sh failed with exit code {r.returncode}")
        return binaries(build=False)
    return b


def expected_binaries() -> Binaries:
    """Where build.sh puts the binaries of the pinned versions (whether built or not)."""
    v = read_versions()
    root = cache_root()
    k8s = root / f"k8s-{v['K8S_VERSION']}" / "bin"
    kwok_dir = root / f"kwok-{v['KWOK_VERSION']}"
    b = Binaries(
        etcd=root / f"etcd-{v['ETCD_VERSION']}" / "bin" / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        kwok=kwok_dir / "bin" / "kwok",
        helm=root / f"helm-{v['HELM_VERSION']}" / "bin" / "helm",
        kwok_stages=kwok_dir / "stages",
        node=real_node.NodeBinaries(
            kubelet=k8s / "kubelet",
            kube_proxy=k8s / "kube-proxy",
            coredns=root / f"coredns-{v['COREDNS_VERSION']}" / "bin" / "coredns",
            pause=Path(_build_sh_dir("pause")) / "pause",
        ),
    )
    return b


def _build_sh_dir(component: str) -> str:
    """A bin dir whose name build.sh derives from content (the pause program's hash)."""
    out = subprocess.run(
        ["bash", str(HERE / "build.sh"), "--print-bin-dirs"], capture_output=True, text=True
    ).stdout.split()
    return next(d for d in out if f"/{component}-" in d)
