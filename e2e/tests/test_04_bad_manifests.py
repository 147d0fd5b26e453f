"""The bad-manifest catalogue (tests/manifests/bad) against the API server itself: every file is
rejected at admission by the CRD's schema, CEL rules, list-map keys or strict field validation,
with a message that names the field (the `# expect:` header), and a good manifest is accepted;
and of an existing run's training, only the budget may change."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from runs import BAD_MANIFESTS, EXAMPLES

BAD = sorted(BAD_MANIFESTS.glob("*.yaml"))


def expected_field(path: Path) -> str:
    match = re.search(r"^# expect: (.*)$", path.read_text(), re.M)
    assert match, f"{path.name} has no '# expect:' header"
    return match.group(1).strip()


def server_dry_run(cluster: Any, namespace: str, path: Path) -> Any:
    # --validate=strict: unknown fields are reported by the server (field validation), not pruned.
    return cluster.kubectl(
        "create",
        "--dry-run=server",
        "--validate=strict",
        "-n",
        namespace,
        "-f",
        str(path),
        check=False,
    )


def test_catalogue_is_there() -> None:
    assert len(BAD) >= 20


def test_a_good_manifest_is_accepted(cluster: Any, crd: str, namespace: str) -> None:
    r = server_dry_run(cluster, namespace, EXAMPLES / "gke-tpu-v6e.yaml")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_api_server_rejects_naming_the_field(
    cluster: Any, crd: str, namespace: str, path: Path
) -> None:
    r = server_dry_run(cluster, namespace, path)
    assert r.returncode != 0, f"{path.name} was accepted by the API server"
    message = r.stderr.strip()
    # The server's words (an admission error), not a client-side parse failure.
    assert re.search(
        r"is invalid|strict decoding error|Invalid value|Unsupported value|Duplicate", message
    ), message
    assert expected_field(path) in message, message


def test_a_running_runs_budget_may_change_and_nothing_else_of_its_training(
    cluster: Any, crd: str, namespace: str, tmp_path: Path
) -> None:
    """The CRD's transition rules: spec.training is immutable once the run exists, except its
    budget (totalSteps, totalTokens), which the syncer takes with the next roster."""
    run = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": "budget"},
        "spec": {
            "image": "trainer:e2e",
            "suspend": True,  # nothing to schedule: only the API server's rules are under test
            "training": {"totalSteps": 1000, "fragments": 2},
        },
    }
    manifest = tmp_path / "run.json"
    manifest.write_text(json.dumps(run))
    cluster.kubectl("create", "-n", namespace, "-f", str(manifest))

    def patch(training: dict[str, Any]) -> Any:
        body = json.dumps({"spec": {"training": training}})
        return cluster.kubectl(
            "patch", "dlr", "budget", "-n", namespace, "--type=merge", "-p", body, check=False
        )

    for allowed in ({"totalSteps": 5000}, {"totalSteps": 10}, {"totalTokens": 10**9}):
        r = patch(allowed)
        assert r.returncode == 0, r.stderr
    refused: dict[str, dict[str, Any]] = {
        "training.fragments": {"fragments": 4},
        "training.model": {"model": {"preset": "small"}},
        "training.seed": {"seed": 7},
    }
    for field, change in refused.items():
        r = patch(change)
        assert r.returncode != 0, f"{change} was accepted"
        assert field in r.stderr and "immutable" in r.stderr, r.stderr
    r = patch({"totalSteps": None, "totalTokens": None})
    assert r.returncode != 0 and "a run needs a budget" in r.stderr, r.stderr
