"""A host's identity in a multi-host unit, from the environment of its pod: GKE's TPU variables
(TPU_WORKER_ID, TPU_WORKER_HOSTNAMES and friends, injected into TPU slice pods), checked against
the Job completion index they come from; without them, what the operator sets, as before."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_trainer.learner import distributed

HOSTS = "u-0.u,u-1.u,u-2.u,u-3.u"
# What a host of a 4-host GKE TPU slice sees: GKE's variables, the Job controller's index.
GKE = {
    "TPU_WORKER_ID": "2",
    "TPU_WORKER_HOSTNAMES": HOSTS,
    "TPU_SKIP_MDS_QUERY": "true",
    "TPU_TOPOLOGY": "4x4",
    "TPU_ACCELERATOR_TYPE": "v6e-16",
    "JOB_COMPLETION_INDEX": "2",
}
TPU_NAMES = [*GKE, "TPU_PROCESS_ADDRESSES"]


@pytest.fixture
def initialize(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """jax.distributed.initialize, recording its arguments instead of connecting."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for name in TPU_NAMES:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_gke_environment_gives_the_process_id_and_the_peers(
    initialize: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in GKE.items():
        monkeypatch.setenv(name, value)
    assert distributed.init_distributed() == 2
    assert initialize == [
        {"coordinator_address": "u-0.u:8476", "num_processes": 4, "process_id": 2}
    ]


def test_the_job_completion_index_stands_in_for_a_missing_worker_id(
    initialize: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", HOSTS)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert distributed.init_distributed() == 3
    assert initialize[0]["process_id"] == 3


def test_a_worker_id_that_is_not_the_completion_index_is_refused_before_connecting(
    initialize: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two hosts claiming one process id: jax.distributed could not form the unit.
    for name, value in {**GKE, "JOB_COMPLETION_INDEX": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="TPU_WORKER_ID 2 is not this pod's Job completion"):
        distributed.init_distributed()
    assert initialize == []
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "one")
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX must be an integer"):
        distributed.init_distributed()


def test_without_gke_the_operators_environment_works_as_before(
    initialize: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No TPU variables at all (a CPU unit, the local runtime): one process, nothing to join.
    assert distributed.init_distributed() == 0
    assert initialize == []
    # The operator's two variables alone (no completion index in the environment).
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0.svc, h1.svc,h2.svc")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    assert distributed.init_distributed() == 1
    assert initialize == [
        {"coordinator_address": "h0.svc:8476", "num_processes": 3, "process_id": 1}
    ]
    monkeypatch.delenv("TPU_WORKER_ID")
    with pytest.raises(ValueError, match=r"TPU_WORKER_ID .* is not set"):
        distributed.init_distributed()


@pytest.mark.parametrize("hostnames", ["localhost", "u-0.u", ""])
def test_a_single_host_has_no_peers(
    hostnames: str, initialize: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # GKE writes localhost for a one-host slice; the operator its one pod's name.
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hostnames)
    monkeypatch.setenv("TPU_WORKER_ID", "0")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    assert distributed.distributed_args(dict(distributed.os.environ)) is None
    assert distributed.init_distributed() == 0
    assert initialize == []
