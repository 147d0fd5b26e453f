"""One run across two clusters, each with its own control plane and its own real node
(docs/multi-cluster.md, docs/e2e.md "Two clusters").

"home" is the session's cluster: the chart's operator in-cluster, the syncer serving HTTPS and one
unit group on the home node. "away" is a second control plane started beside it (its own etcd,
API server, controllers and a real node on another bridge, e2e/cluster/real_node_config.AWAY)
with one unit group, its operator, and no syncer: its run names the home syncer's address, the
CA that signed the syncer's certificate and a join credential minted at home. The only path
between them is a TCP proxy (toxiproxy) on the away node's gateway that forwards to the home
syncer's Service: the link the tests cut.

In order, one run:
1. it trains in both clusters: the away learner's pushes are accepted at home (each group with
   its own compression: int2 away, int8 home), the home status lists the away unit Online
   (remote), the away status says the syncer is reachable;
2. the link is cut for 60 s: home goes on merging, the away status names the address and the
   error, the away unit keeps its pod; after the heal its pushes are accepted again;
3. the away learner's pod is deleted: the away operator recreates the unit, the new learner
   joins across the link with the global parameters;
4. the join credential is replaced in the away Secret and home revokes the old one: the unit is
   recreated with a token of the new one and pushes again;
5. away runs with an expired credential, another run's credential, and a CA that did not sign
   the syncer's certificate are refused, each with a condition that names why;
6. the budget, lowered at home, is reached: both runs Succeeded.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import runs
from conftest import kubectl, say, wait_for
from diloco_trainer.join_credentials import CLOCK_SKEW_SECONDS
from two_clusters import (
    AWAY,
    AWAY_UNIT,
    BUDGET_LEFT,
    CUT_SECONDS,
    HOME_UNIT,
    RUN,
    address,
    apply,
    carry,
    cli_credential,
    crafted,
    external,
    link_host,
    manifest,
    run_secret,
)

from bench.lib.toxiproxy import Link
from e2e.cluster import harness

pytestmark = [pytest.mark.timeout(1500), pytest.mark.two_clusters]


# ----------------------------------------------------------------------------------------------
# helpers


def away_pod(away: harness._ClusterBase, ns: str) -> dict[str, Any] | None:
    """The away unit's running learner pod."""
    for p in runs.learner_pods(away, ns, RUN):
        statuses = p.get("status", {}).get("containerStatuses") or []
        if (
            runs.running(p)
            and statuses
            and all(s.get("state", {}).get("running") for s in statuses)
        ):
            return p
    return None


def pushes(away: harness._ClusterBase, ns: str, pod: str) -> tuple[int, str]:
    """How many of the learner's pushes the home syncer has accepted (its latest progress
    line), and its log."""
    r = kubectl(away, "logs", "-n", ns, pod, "-c", "learner", check=False)
    text = r.stdout + r.stderr
    counts = re.findall(r"event=progress .*? pushes=(\d+) ", text)
    return (int(counts[-1]) if counts else 0), text


def pushed_schemes(home: harness._ClusterBase, ns: str) -> dict[str, set[str]]:
    """unit -> the schemes of its pushes the home syncer accepted (from the syncer's log)."""
    pods = runs.items(home, "pods", ns, runs.run_selector(RUN, "syncer"))
    name = pods[0]["metadata"]["name"]
    log = kubectl(home, "logs", "-n", ns, name, "-c", "syncer").stdout
    found: dict[str, set[str]] = {}
    for unit, scheme in re.findall(r"event=push_accepted .*?unit=(\S+) .*?scheme=(\w+)", log):
        found.setdefault(unit, set()).add(scheme)
    return found


def outer_step(c: harness._ClusterBase, ns: str) -> int:
    return int(runs.status(c, ns, RUN).get("outerStep") or 0)


def reach(
    away: harness._ClusterBase, ns: str, status: str, reason: str | None = None
) -> dict[str, Any] | None:
    """The away run's SyncerReachable condition once it has this status (and reason)."""
    cond = runs.condition(runs.status(away, ns, RUN), "SyncerReachable")
    if cond and cond["status"] == status and reason in (None, cond["reason"]):
        return cond
    return None


def both_online(c: harness._ClusterBase, ns: str) -> dict[str, dict[str, Any]] | None:
    units = runs.unit_status(c, ns, RUN)
    wanted = (HOME_UNIT, AWAY_UNIT)
    return units if all(units.get(n, {}).get("state") == "Online" for n in wanted) else None


# ----------------------------------------------------------------------------------------------
# the tests, in order: one run goes through all of them


def test_one_run_trains_in_both_clusters(
    cluster: harness._ClusterBase, away: harness._ClusterBase, away_run: str
) -> None:
    ns = away_run
    pod = wait_for("the away learner running", lambda: away_pod(away, ns), timeout=300)
    assert pod["spec"]["nodeName"] == away.info()["real_node"]
    name = pod["metadata"]["name"]
    wait_for(f"{name}'s pushes accepted at home", lambda: pushes(away, ns, name)[0] >= 2, 300)
    units = wait_for("both units Online at home", lambda: both_online(cluster, ns), 120)
    assert units[AWAY_UNIT].get("remote") is True and not units[HOME_UNIT].get("remote")
    assert units.keys() == {HOME_UNIT, AWAY_UNIT}
    # the away cluster runs its own unit only, and sees the syncer through the link
    assert set(runs.jobs(away, ns, RUN)) and all(AWAY_UNIT in j for j in runs.jobs(away, ns, RUN))
    assert not runs.items(away, "pods", ns, runs.run_selector(RUN, "syncer"))
    cond = wait_for("SyncerReachable=True away", lambda: reach(away, ns, "True"), 60)
    # each group pushes with its own compression: the away group's int2 crossed the link
    schemes = pushed_schemes(cluster, ns)
    assert schemes == {HOME_UNIT: {"int8"}, AWAY_UNIT: {"int2"}}, schemes
    syncer = runs.status(away, ns, RUN)["syncer"]
    assert syncer["reachable"] is True and syncer["address"].startswith("https://"), syncer
    say(f"both clusters train: {cond['message']}; outer step {outer_step(cluster, ns)}")


def test_cut_link_keeps_home_merging_and_away_rejoins(
    cluster: harness._ClusterBase, away: harness._ClusterBase, away_run: str, link: Link
) -> None:
    ns = away_run
    pod = away_pod(away, ns)
    assert pod is not None
    name = pod["metadata"]["name"]
    accepted_before, _ = pushes(away, ns, name)
    step_at_cut = outer_step(cluster, ns)
    link.set_enabled(False)
    cut_at = time.monotonic()
    try:
        cond = wait_for(
            "SyncerReachable=False away",
            lambda: reach(away, ns, "False"),
            timeout=CUT_SECONDS - 15,
        )
        assert cond["reason"] == "Unreachable", cond
        assert link_host(cluster) in cond["message"], cond
        wait_for(
            "the away unit Offline at home",
            lambda: runs.unit_status(cluster, ns, RUN)[AWAY_UNIT]["state"] == "Offline",
            timeout=CUT_SECONDS - (time.monotonic() - cut_at),
        )
        time.sleep(max(0.0, CUT_SECONDS - (time.monotonic() - cut_at)))
        # home merged on without the away unit
        step_at_heal = outer_step(cluster, ns)
        assert step_at_heal > step_at_cut, (step_at_cut, step_at_heal)
        accepted_in_cut, _ = pushes(away, ns, name)
    finally:
        link.set_enabled(True)
    healed_at = time.monotonic()
    wait_for(
        "an away push accepted after the heal",
        lambda: pushes(away, ns, name)[0] > accepted_in_cut,
        timeout=120,
    )
    rejoin_s = time.monotonic() - healed_at
    wait_for(
        "the away unit Online at home again",
        lambda: runs.unit_status(cluster, ns, RUN)[AWAY_UNIT]["state"] == "Online",
        timeout=60,
    )
    wait_for("SyncerReachable=True away", lambda: reach(away, ns, "True"))
    # the partition was an outage of the link, not of the unit: the same pod, never restarted
    after = away_pod(away, ns)
    assert after is not None and after["metadata"]["name"] == name
    assert all(s["restartCount"] == 0 for s in after["status"]["containerStatuses"])
    assert accepted_in_cut >= accepted_before
    say(
        f"cut {CUT_SECONDS}s: home's outer step {step_at_cut} -> {step_at_heal} during it; "
        f"an away push accepted {rejoin_s:.1f}s after the heal"
    )


def test_away_learner_replaced_and_rejoins_across_the_link(
    cluster: harness._ClusterBase, away: harness._ClusterBase, away_run: str
) -> None:
    ns = away_run
    pod = away_pod(away, ns)
    assert pod is not None
    old = pod["metadata"]["name"]
    attempt = runs.job_attempt(next(iter(runs.live_jobs(away, ns, RUN).values())))
    kubectl(away, "delete", "pod", old, "-n", ns, "--grace-period=0", "--wait=false")
    t0 = time.monotonic()
    new = wait_for(
        "a new away learner running",
        lambda: (p := away_pod(away, ns)) and p["metadata"]["name"] != old and p,
        timeout=240,
    )
    name = new["metadata"]["name"]
    assert int(new["metadata"]["labels"][runs.LABEL_ATTEMPT]) > attempt
    wait_for(
        f"{name} joined with the global parameters and pushed",
        lambda: _joined_and_pushed(pushes(away, ns, name)),
        timeout=240,
    )
    wait_for(
        "the away unit Online at home",
        lambda: runs.unit_status(cluster, ns, RUN)[AWAY_UNIT]["state"] == "Online",
        timeout=60,
    )
    say(f"away learner replaced and pushing again in {time.monotonic() - t0:.1f}s")


def succeeded(c: harness._ClusterBase, ns: str) -> bool:
    return runs.status(c, ns, RUN).get("phase") == "Succeeded"


def _joined_and_pushed(found: tuple[int, str]) -> bool:
    accepted, text = found
    joins = [line for line in text.splitlines() if "event=joined" in line]
    pulled = bool(joins) and "versions=[0, 0]" not in joins[-1]
    return pulled and accepted >= 1


def pod_after(away: harness._ClusterBase, ns: str, attempt: int) -> dict[str, Any] | None:
    """The away unit's running pod of an attempt after `attempt`."""
    pod = away_pod(away, ns)
    if pod is not None and int(pod["metadata"]["labels"][runs.LABEL_ATTEMPT]) > attempt:
        return pod
    return None


def test_a_replaced_credential_takes_over_once_home_revokes_the_old_one(
    cluster: harness._ClusterBase, away: harness._ClusterBase, away_run: str
) -> None:
    """Rotation as a user does it: a new credential minted at home replaces the old one in the
    away Secret, then home revokes the old one. The away learner, refused, goes stale; the away
    operator reads the credential again and recreates the unit with a token of the new one."""
    ns = away_run
    old_secret = json.loads(kubectl(away, "get", "secret", "join", "-n", ns, "-o", "json").stdout)
    old_id = old_secret["metadata"]["annotations"]["diloco.dev/credential-id"]
    pod = away_pod(away, ns)
    assert pod is not None
    attempt = int(pod["metadata"]["labels"][runs.LABEL_ATTEMPT])
    kubectl(
        away, "apply", "-n", ns, "-f", "-", input=cli_credential(cluster, ns, AWAY, "1h", "join")
    )
    revoke = {"spec": {"syncer": {"revokedCredentials": [old_id]}}}
    kubectl(cluster, "patch", "dlr", RUN, "-n", ns, "--type=merge", "-p", json.dumps(revoke))
    t0 = time.monotonic()
    new = wait_for(
        "the away unit recreated with the new credential",
        lambda: pod_after(away, ns, attempt),
        timeout=180,
    )
    name = new["metadata"]["name"]
    wait_for(f"{name} pushing again", lambda: pushes(away, ns, name)[0] >= 1, timeout=180)
    wait_for("SyncerReachable=True away", lambda: reach(away, ns, "True"), timeout=60)
    mounted = {v["secret"]["secretName"] for v in new["spec"]["volumes"] if "secret" in v}
    assert not any(old_id[:12] in m for m in mounted), mounted
    say(
        f"credential replaced and the old one revoked: pushing again in {time.monotonic() - t0:.1f}s"
    )


@pytest.mark.parametrize(
    "case,reason",
    [
        ("expired", "CredentialExpired"),
        ("foreign-run", "CredentialForeignRun"),
        ("wrong-ca", "CertificateNotVerified"),
    ],
)
def test_bad_join_is_refused_with_a_condition(
    cluster: harness._ClusterBase,
    away: harness._ClusterBase,
    away_run: str,
    link: Link,
    home_ca: Path,
    other_ca: Path,
    real: dict[str, Any],
    case: str,
    reason: str,
) -> None:
    """Another away namespace joins the same run with a bad credential or the wrong CA: its
    operator says why in SyncerReachable, and the home run admits none of its units."""
    ns = f"{away_run[:40]}-{case}"
    kubectl(away, "create", "namespace", ns)
    name, now = f"bad-{case}", int(time.time())
    if case == "expired":  # by more than the syncer's allowance for clock skew
        secret = crafted(name, run_secret(cluster, away_run), RUN, now - 2 * CLOCK_SKEW_SECONDS)
    elif case == "foreign-run":
        secret = crafted(name, "another run's secret", "another-run", now + 3600)
    else:
        secret = cli_credential(cluster, away_run, AWAY, "1h", name)
    ca = other_ca if case == "wrong-ca" else home_ca
    carry(away, ns, name, secret, ca)
    doc = manifest(real["images"]["trainer"], AWAY, external(address(link), name))
    doc["spec"]["suspend"] = True  # the operator's own read of the syncer says it all
    apply(away, ns, doc)
    cond = wait_for(
        f"SyncerReachable=False with {reason}",
        lambda: reach(away, ns, "False", reason),
        timeout=90,
    )
    say(f"{case}: {cond['reason']}: {cond['message']}")
    assert set(runs.unit_status(cluster, away_run, RUN)) == {HOME_UNIT, AWAY_UNIT}
    kubectl(away, "delete", "namespace", ns, "--wait=false")


def test_budget_reached_both_runs_succeed(
    cluster: harness._ClusterBase, away: harness._ClusterBase, away_run: str
) -> None:
    ns = away_run
    steps = int(runs.status(cluster, ns, RUN).get("steps") or 0)
    patch = {"spec": {"training": {"totalSteps": steps + BUDGET_LEFT}}}
    kubectl(cluster, "patch", "dlr", RUN, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    wait_for("the home run Succeeded", lambda: succeeded(cluster, ns), timeout=300)
    wait_for("the away run Succeeded", lambda: succeeded(away, ns), timeout=120)
    # The syncer evaluates the global model once more after the budget; the operator copies
    # that loss on a later pass than the one that saw the run complete.
    wait_for(
        "the home run's finalLoss",
        lambda: runs.status(cluster, ns, RUN).get("finalLoss") is not None,
        timeout=180,
    )
