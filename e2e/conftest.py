"""Fixtures of the end-to-end suite: a real Kubernetes control plane, the Helm chart installed on
it, and the real operator process authenticated as the chart's ServiceAccount.

Which cluster (`cluster` fixture, once per session):
- DILOCO_E2E_KUBECONFIG=PATH, or KUBECONFIG with DILOCO_E2E_USE_KUBECONFIG=1: that existing cluster
  (kind, a real one); nothing is started or stopped. Fake TPU nodes must exist there (e2e/kind/
  creates them); tests that need them are skipped otherwise.
- else: a LocalCluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok with
  fake GKE TPU node pools) started once and stopped at the end, also on failure, Ctrl-C or SIGTERM.

Which operator (`operator` fixture): DILOCO_E2E_OPERATOR=local (default) runs `diloco-operator`
from the venv as a local process with a kubeconfig holding a token of the chart's ServiceAccount
(so the chart's RBAC is exactly what it gets); `incluster` uses the chart's Deployment (kind, with
the image loaded), and "killing" it deletes its pod.

Run: `pytest e2e` (or `make e2e`) from the repository root.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from e2e.cluster import harness  # noqa: E402

CHART = REPO / "charts" / "diloco-operator"
RELEASE = "diloco"
SYSTEM_NS = "diloco-system"
CRD_NAME = "dilocoruns.diloco.dev"
VENV_BIN = Path(sys.executable).parent
T = TypeVar("T")
# the real-pod tests' fixtures (the node's facts, the chart's operator in-cluster), and the
# two-cluster tests' (a second cluster, the link, the run on both sides)
pytest_plugins = ["real_pods", "two_clusters"]


def say(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 60, every: float = 0.25) -> T:
    """Poll fn until it returns something truthy; AssertionError naming `what` (and the last
    value seen) when `timeout` seconds pass."""
    end = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > end:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}"
            )
        time.sleep(every)


# ------------------------------------------------------------------------------------------------
# cluster


def _sigterm(signum: int, _frame: Any) -> None:
    # SIGTERM (CI cancelling a job) ends the session like Ctrl-C: pytest still tears the
    # fixtures down, so the cluster and the operator are stopped.
    raise KeyboardInterrupt(f"signal {signum}")


def _existing_kubeconfig() -> str | None:
    explicit = os.environ.get("DILOCO_E2E_KUBECONFIG")
    if explicit:
        return explicit
    if os.environ.get("DILOCO_E2E_USE_KUBECONFIG", "") not in ("", "0", "false"):
        kc = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        return kc or str(Path.home() / ".kube" / "config")
    return None


def _required() -> bool:
    return os.environ.get("DILOCO_E2E_REQUIRE", "") not in ("", "0", "false")


@contextlib.contextmanager
def _locked_state_dir() -> Iterator[Path]:
    """A state dir nobody else's pytest session is using (several people may run the suite on
    one machine): the first of state-pytest-0..7 whose lock file we can take."""
    root = (
        Path(os.environ.get("DILOCO_E2E_STATE_DIR", ""))
        if os.environ.get("DILOCO_E2E_STATE_DIR")
        else None
    )
    candidates = [root] if root else [harness.cache_root() / f"state-pytest-{i}" for i in range(8)]
    for d in candidates:
        d.parent.mkdir(parents=True, exist_ok=True)
        lock: IO[str] = open(f"{d}.lock", "w")  # noqa: SIM115 - held for the whole session
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            yield d
        finally:
            lock.close()
        return
    raise harness.ClusterError(f"every e2e state dir is in use: {candidates}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[harness._ClusterBase]:
    kc = _existing_kubeconfig()
    if kc:
        say(f"using the existing cluster of {kc}")
        yield harness.ExistingCluster(kc)
        return
    missing = [p for p in harness.expected_binaries().all_paths() if not os.access(p, os.X_OK)]
    if missing and not shutil.which("go") and not _required():
        pytest.skip(
            f"control-plane binaries not built and no Go to build them: {missing[0]} "
            "(make e2e-deps; DILOCO_E2E_REQUIRE=1 makes this an error)"
        )
    previous = signal.signal(signal.SIGTERM, _sigterm)
    with _locked_state_dir() as state_dir:
        c = harness.LocalCluster(state_dir)
        try:
            c.start(timeout=300)
            say(f"local cluster up in {c.timings.get('total_start_s')}s ({state_dir})")
            yield c
        finally:
            if keep():
                say(f"keeping the cluster: e2e/cluster/down.sh --state-dir {state_dir}")
            else:
                c.stop()
            signal.signal(signal.SIGTERM, previous)


def kubectl(c: harness._ClusterBase, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return c.kubectl(*args, **kw)


def get_json(c: harness._ClusterBase, *args: str) -> Any:
    return c.kubectl_json(*args)


@pytest.fixture(scope="session")
def tpu_nodes(cluster: harness._ClusterBase) -> dict[str, list[dict[str, Any]]]:
    """Fake TPU nodes by accelerator label; skips the test where the cluster has none."""
    nodes = get_json(cluster, "get", "nodes", "-l", "cloud.google.com/gke-tpu-accelerator")
    pools: dict[str, list[dict[str, Any]]] = {}
    for n in nodes["items"]:
        pools.setdefault(
            n["metadata"]["labels"]["cloud.google.com/gke-tpu-accelerator"], []
        ).append(n)
    if len(pools.get("tpu-v6e-slice", [])) < 8 or len(pools.get("tpu-v5p-slice", [])) < 2:
        pytest.skip("the cluster lacks fake TPU node pools (e2e/kind/run.sh creates them)")
    return pools


# ------------------------------------------------------------------------------------------------
# chart


def helm_env(c: harness._ClusterBase) -> tuple[str, dict[str, str]]:
    """The pinned helm (or one on PATH) and an environment that keeps its caches and repository
    config out of the user's HOME."""
    helm = str(harness.expected_binaries().helm)
    if not os.access(helm, os.X_OK):
        helm = "helm"
    env = c.env()
    scratch = tempfile.mkdtemp(prefix="diloco-e2e-helm-")
    env.update(HELM_CACHE_HOME=scratch, HELM_CONFIG_HOME=scratch, HELM_DATA_HOME=scratch)
    return helm, env


def extra_helm_args() -> list[str]:
    """What DILOCO_E2E_HELM_ARGS adds to every install of the chart (docs/e2e.md)."""
    return os.environ.get("DILOCO_E2E_HELM_ARGS", "").split()


@contextlib.contextmanager
def installed_chart(c: harness._ClusterBase, incluster: bool) -> Iterator[dict[str, str]]:
    """`helm install` of the chart into diloco-system, cluster-wide; yields the release's names
    (its Deployment, scaled to 0 unless the operator runs in-cluster, and ServiceAccount).
    Uninstalled at the end (the CRD stays, as Helm does with crds/)."""
    helm, env = helm_env(c)
    args = [
        helm,
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM_NS,
        "--create-namespace",
        "--wait=false",
        "--kubeconfig",
        str(c.kubeconfig),
        # The suite makes a namespace per test module: cluster-wide mode (the chart's default is
        # namespaced, to the release namespace only).
        "--set",
        "clusterWide=true",
    ]
    t0 = time.monotonic()
    r = subprocess.run(
        [*args, *extra_helm_args()], env=env, capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, f"helm install failed: {r.stderr}"
    say(f"helm install done in {time.monotonic() - t0:.1f}s")
    deploy = wait_for(
        "the chart's operator Deployment",
        lambda: get_json(
            c, "get", "deploy", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/instance={RELEASE}"
        )["items"],
    )[0]
    names = {
        "deployment": deploy["metadata"]["name"],
        "serviceAccount": deploy["spec"]["template"]["spec"]["serviceAccountName"],
    }
    if not incluster:
        # Its pod would only "run" on a fake node (no container ever starts); the real operator
        # runs as a local process instead, with this Deployment's ServiceAccount.
        kubectl(c, "scale", "deploy", names["deployment"], "-n", SYSTEM_NS, "--replicas=0")
    try:
        yield names
    finally:
        subprocess.run(
            [helm, "uninstall", RELEASE, "-n", SYSTEM_NS, "--kubeconfig", str(c.kubeconfig)],
            env=env,
            capture_output=True,
            timeout=120,
        )


@pytest.fixture(scope="session")
def chart(cluster: harness._ClusterBase) -> Iterator[dict[str, str]]:
    with installed_chart(cluster, operator_mode() == "incluster") as names:
        yield names


@pytest.fixture(scope="session")
def crd(cluster: harness._ClusterBase, chart: dict[str, str]) -> str:
    """The DilocoRun CRD installed by the chart, Established (served) by the API server."""
    wait_for("CRD established", lambda: crd_established(cluster), timeout=60)
    return CRD_NAME


def crd_established(c: harness._ClusterBase) -> bool:
    r = kubectl(c, "get", "crd", CRD_NAME, "-o", "json", check=False)
    if r.returncode != 0:
        return False
    conds = json.loads(r.stdout).get("status", {}).get("conditions") or []
    return any(x["type"] == "Established" and x["status"] == "True" for x in conds)


# ------------------------------------------------------------------------------------------------
# operator


def operator_mode() -> str:
    mode = os.environ.get("DILOCO_E2E_OPERATOR", "local")
    if mode not in ("local", "incluster"):
        raise ValueError(f"DILOCO_E2E_OPERATOR={mode!r}: expected local or incluster")
    return mode


def _pdeathsig() -> None:
    # The operator dies with the test process even when pytest itself is SIGKILLed.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def service_account_kubeconfig(c: harness._ClusterBase, sa: str, path: Path) -> None:
    """A kubeconfig that authenticates with a fresh token of ServiceAccount `sa`: whatever the
    operator does with it is allowed by the chart's RBAC or fails."""
    token = kubectl(c, "create", "token", sa, "-n", SYSTEM_NS, "--duration=2h").stdout.strip()
    raw = json.loads(kubectl(c, "config", "view", "--raw", "--minify", "-o", "json").stdout)
    cl = raw["clusters"][0]["cluster"]
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cl}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": sa}}],
        "current-context": "e2e",
    }
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)


class Operator:
    """The operator under test: start, SIGKILL, restart, log tail."""

    def __init__(self, c: harness._ClusterBase, names: dict[str, str], workdir: Path) -> None:
        self.c = c
        self.names = names
        self.workdir = workdir
        self.mode = operator_mode()
        self.kubeconfig = workdir / "operator-sa.kubeconfig"
        self.log_path = workdir / "operator.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        if self.mode == "incluster":
            kubectl(
                self.c, "scale", "deploy", self.names["deployment"], "-n", SYSTEM_NS, "--replicas=1"
            )
            wait_for("the in-cluster operator pod Ready", self._incluster_ready, timeout=180)
            self.starts += 1
            return
        if not self.kubeconfig.exists():
            service_account_kubeconfig(self.c, self.names["serviceAccount"], self.kubeconfig)
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never mistake this for in-cluster
        self.metrics_port = harness.free_port()
        self.health_port = harness.free_port()
        argv = [
            str(VENV_BIN / "diloco-operator"),
            "--all-namespaces",
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
            f"--metrics-port={self.metrics_port}",
            "--poll-interval=2",
            # The syncers are fake pods here: refuse at once instead of resolving *.svc names.
            "--syncer-url=http://127.0.0.1:9/{namespace}/{name}",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        log.write(f"---- start {self.starts} ----\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=_pdeathsig,
        )
        log.close()
        self.starts += 1
        wait_for("operator liveness", self._healthy, timeout=60)

    def _healthy(self) -> bool:
        import urllib.request

        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/healthz", timeout=2
            ) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def _incluster_ready(self) -> bool:
        pods = get_json(
            self.c, "get", "pods", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/instance={RELEASE}"
        )["items"]
        return any(
            cond["type"] == "Ready" and cond["status"] == "True"
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
            for cond in p.get("status", {}).get("conditions") or []
        )

    def kill(self) -> None:
        """SIGKILL: no cleanup, no finalizers, exactly a crashed pod."""
        if self.mode == "incluster":
            kubectl(
                self.c,
                "delete",
                "pod",
                "-n",
                SYSTEM_NS,
                "-l",
                f"app.kubernetes.io/instance={RELEASE}",
                "--grace-period=0",
                "--force",
            )
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        if self.mode == "incluster":
            r = kubectl(
                self.c,
                "logs",
                "-n",
                SYSTEM_NS,
                f"deploy/{self.names['deployment']}",
                f"--tail={lines}",
                check=False,
            )
            return r.stdout + r.stderr
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no operator log)"


@pytest.fixture(scope="session")
def operator(
    cluster: harness._ClusterBase,
    chart: dict[str, str],
    crd: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Operator]:
    op = Operator(cluster, chart, tmp_path_factory.mktemp("operator"))
    op.start()
    say(f"operator running ({op.mode})")
    try:
        yield op
    finally:
        op.stop()


# ------------------------------------------------------------------------------------------------
# namespaces and diagnostics


@pytest.fixture(scope="module")
def namespace(cluster: harness._ClusterBase, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test module, deleted afterwards (without waiting)."""
    name = f"e2e-{request.module.__name__.rsplit('.', 1)[-1].removeprefix('test_')}"
    name = name.replace("_", "-")[:50] + f"-{os.getpid() % 10000}"
    kubectl(cluster, "create", "namespace", name)
    try:
        yield name
    finally:
        if not keep():
            kubectl(cluster, "delete", "namespace", name, "--wait=false", check=False)


def keep() -> bool:
    """DILOCO_E2E_KEEP=1: leave the cluster and the test namespaces behind for a look."""
    return os.environ.get("DILOCO_E2E_KEEP", "") not in ("", "0", "false")


def diagnostics(item: pytest.Item) -> str:
    """The operator's log tail and the test namespace's Events and objects."""
    args = getattr(item, "funcargs", {})
    parts: list[str] = []
    op = args.get("operator")
    if isinstance(op, Operator):
        parts.append(f"--- operator log tail ---\n{op.log_tail(60)}")
    c, ns = args.get("cluster"), args.get("namespace")
    if c is not None and ns:
        parts.insert(0, f"--- runs in {ns} ---\n{run_summaries(c, ns)}")
        ev = kubectl(c, "get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)
        parts.append(f"--- kubectl get events -n {ns} ---\n{ev.stdout[-8000:]}{ev.stderr}")
        objs = kubectl(c, "get", "dlr,jobs,pods,deploy,svc", "-n", ns, "-o", "wide", check=False)
        parts.append(f"--- objects in {ns} ---\n{objs.stdout[-8000:]}{objs.stderr}")
        nodes = kubectl(c, "get", "nodes", "-L", "cloud.google.com/gke-nodepool", check=False)
        parts.append(f"--- nodes ---\n{nodes.stdout}")
        parts.append(syncer_log_tails(c, ns))  # last: a CI report keeps the head and the tail
    return "\n".join(parts)


def run_summaries(c: harness._ClusterBase, ns: str) -> str:
    """One line per DilocoRun: what its status says about progress."""
    got = kubectl(c, "get", "dlr", "-n", ns, "-o", "json", check=False)
    if got.returncode != 0:
        return got.stderr
    lines = []
    for item in json.loads(got.stdout).get("items", []):
        st = item.get("status") or {}
        fields = ("phase", "outerStep", "steps", "tokens", "loss", "unitsOnline", "message")
        units = [(u.get("name"), u.get("state"), u.get("attempt")) for u in st.get("units", [])]
        summary = " ".join(f"{k}={st.get(k)}" for k in fields)
        lines.append(f"{item['metadata']['name']}: {summary} units={units}")
    return "\n".join(lines) or "(none)"


def syncer_log_tails(c: harness._ClusterBase, ns: str, lines: int = 12) -> str:
    """The last lines of every container of every syncer pod (real pods log; KWOK's do not)."""
    syncers = "app.kubernetes.io/component=syncer"
    got = kubectl(c, "get", "pods", "-n", ns, "-l", syncers, "-o", "json", check=False)
    if got.returncode != 0:
        return got.stderr
    parts = []
    for pod in json.loads(got.stdout).get("items", []):
        name = pod["metadata"]["name"]
        for container in pod["spec"]["containers"]:
            log = kubectl(
                c, "logs", "-n", ns, name, "-c", container["name"], f"--tail={lines}", check=False
            )
            text = "\n".join(line[:300] for line in log.stdout.splitlines())
            parts.append(f"--- {name}/{container['name']} log tail ---\n{text}{log.stderr[:300]}")
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report: pytest.TestReport = yield
    if report.when == "call" and report.failed:
        try:
            report.sections.append(("e2e diagnostics", diagnostics(item)))
        except Exception as exc:  # diagnostics must never hide the real failure
            report.sections.append(("e2e diagnostics", f"could not collect: {exc!r}"))
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
