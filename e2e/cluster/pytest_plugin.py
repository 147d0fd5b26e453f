"""pytest fixtures for the real control plane. Enable in e2e/conftest.py with

    pytest_plugins = ["e2e.cluster.pytest_plugin"]

Fixtures:
  k8s_cluster  (session) harness.LocalCluster or harness.ExistingCluster, chosen by
               DILOCO_E2E_CLUSTER / DILOCO_E2E_KUBECONFIG / KUBECONFIG (see harness.cluster);
               has .kubeconfig, .kubectl(...), .kubectl_json(...), .env(), .local
  kubeconfig   (session) path of its kubeconfig, as a str

When the binaries are not built and cannot be (no Go), the fixture skips the tests instead of
failing, unless DILOCO_E2E_REQUIRE=1 (CI sets it where e2e must run).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import harness
import pytest


def _must_run() -> bool:
    return os.environ.get("DILOCO_E2E_REQUIRE", "") not in ("", "0", "false")


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[harness._ClusterBase]:
    if (
        not _must_run()
        and os.environ.get("DILOCO_E2E_CLUSTER", "auto") != "existing"
        and not (os.environ.get("DILOCO_E2E_KUBECONFIG") or os.environ.get("KUBECONFIG"))
    ):
        missing = [p for p in harness.expected_binaries().all_paths() if not p.exists()]
        if missing and not shutil.which("go"):
            pytest.skip(
                f"control-plane binaries not built and no Go to build them "
                f"(run e2e/cluster/build.sh); missing {missing[0]}"
            )
    with harness.cluster() as c:
        yield c


@pytest.fixture(scope="session")
def kubeconfig(k8s_cluster: harness._ClusterBase) -> str:
    return str(k8s_cluster.kubeconfig)
