"""The Kubernetes side of a sharded syncer (`spec.syncer.shards`, docs/operator.md "Sharded
syncer"): per shard a Deployment, Service, budget and claim with its own labels, env and lock;
learners given every shard; the network policy letting shard 0 reach the others; the shards'
status gathered for the planner and shown shard by shard. A run of one shard is unchanged."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from diloco_operator.api import DilocoRunStatus, parse_spec
from diloco_operator.api.status import SyncerShardStatus
from diloco_operator.k8s import actions, builders, handlers, kube, run_secrets, state
from diloco_operator.k8s.netpolicy import OperatorIdentity, run_objects_with_policy
from diloco_operator.k8s.shard_status import gathered_report, report_shards
from diloco_operator.k8s.syncer_calls import ShardRead
from diloco_operator.k8s.syncer_shards import (
    LABEL_SHARD,
    SyncerDeployment,
    observed_syncer,
    shard_of,
)
from diloco_operator.planner import CreateUnit, ScaleSyncer, desired_units
from diloco_trainer.config import SERVING_LOCK_FILE
from diloco_trainer.status import FragmentStatus, SyncerStatus
from k8s_roundtrip import roundtrip

SPEC: dict[str, Any] = {
    "image": "trainer:1",
    "replicas": 2,
    "training": {"totalSteps": 100, "fragments": 4},
}
MOUNT = builders.CHECKPOINT_MOUNT
ADDRESSES = "http://r-syncer.ml.svc:8470,http://r-syncer-1.ml.svc:8470"


def make_run(shards: int = 2, name: str = "r", **syncer: Any) -> builders.Run:
    spec = {**SPEC, "syncer": {**({"shards": shards} if shards else {}), **syncer}}
    return builders.Run(name, "ml", "uid-1", parse_spec(spec, run=name))


def named(objs: list[dict[str, Any]]) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in objs]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def unit_objects(run: builders.Run) -> list[dict[str, Any]]:
    objs = []
    for slot in desired_units(run.name, run.spec):
        unit = CreateUnit(slot.name, slot.group, slot.index, slot.global_index, 0, 2, slot.hosts)
        objs += builders.unit_objects(run, unit, "run-secret")
    return objs


# ----------------------------------------------------------------------------------------------
# objects


def test_each_shard_has_its_deployment_service_budget_and_claim() -> None:
    objs = builders.run_objects(make_run(), token="t")
    assert named(objs) == [
        "Secret/r-token",
        "ConfigMap/r-config",
        "PersistentVolumeClaim/r-checkpoints",
        "PersistentVolumeClaim/r-checkpoints-1",
        "Service/r-syncer",
        "Service/r-syncer-1",
        "PodDisruptionBudget/r-syncer",
        "PodDisruptionBudget/r-syncer-1",
        "Deployment/r-syncer",
        "Deployment/r-syncer-1",
    ]
    for obj in objs[2:]:
        shard = "1" if obj["metadata"]["name"].endswith("-1") else "0"
        assert obj["metadata"]["labels"][LABEL_SHARD] == shard
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "syncer"
        if obj["kind"] == "PersistentVolumeClaim":  # retained, as an unsharded run's
            assert "ownerReferences" not in obj["metadata"]
        else:  # deleted with the run
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert roundtrip(obj) == obj


def test_every_selector_picks_its_own_shard_only() -> None:
    """Without the shard in the selectors shard 0's Service would send learners to shard 1's
    pod, and two budgets over one pod would make every eviction of it fail."""
    run = make_run()
    for shard in (0, 1):
        want = {"diloco.dev/run": "r", "app.kubernetes.io/component": "syncer"}
        want[LABEL_SHARD] = str(shard)
        deploy = builders.syncer_deployment(run, shard)
        assert deploy["spec"]["selector"]["matchLabels"] == want
        assert want.items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
        assert builders.syncer_service(run, shard)["spec"]["selector"] == want
        budget = builders.syncer_disruption_budget(run, shard)
        assert budget["spec"]["selector"]["matchLabels"] == want
        assert budget["spec"]["maxUnavailable"] == 0


def test_each_shard_is_told_its_index_and_every_peer_on_both_containers() -> None:
    run = make_run()
    for shard in (0, 1):
        pod = builders.syncer_deployment(run, shard)["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == ["syncer", "syncer-standby"]
        for container in pod["containers"]:
            e = env(container)
            assert e["DILOCO_SYNCER_SHARD"] == f"{shard}/2"
            assert e["DILOCO_SYNCER_PEERS"] == ADDRESSES
            # the same path for every shard: each derives its own folder in it
            assert e["DILOCO_CHECKPOINT_PATH"] == MOUNT
            # the lock in the shard's own folder: shards sharing a claim never wait on each other
            assert e["DILOCO_SYNCER_LOCK"] == f"{MOUNT}/shard-{shard}-of-2/{SERVING_LOCK_FILE}"
        claim = pod["volumes"][1]["persistentVolumeClaim"]["claimName"]
        assert claim == ("r-checkpoints" if shard == 0 else "r-checkpoints-1")


@pytest.mark.parametrize(
    ("checkpoint", "claims", "mounted"),
    [
        (
            {"size": "1Gi"},
            ["r-checkpoints", "r-checkpoints-1"],
            ["r-checkpoints", "r-checkpoints-1"],
        ),
        # a claim the user names is every shard's (ReadWriteMany, or one node)
        ({"path": "shared-claim"}, [], ["shared-claim", "shared-claim"]),
        ({"path": "gs://bucket/run"}, [], [None, None]),
        ({"ephemeral": True}, [], [None, None]),
    ],
)
def test_checkpoint_storage_per_shard(
    checkpoint: dict[str, Any], claims: list[str], mounted: list[str | None]
) -> None:
    run = make_run(checkpoint=checkpoint)
    objs = builders.run_objects(run)
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"] == claims
    for shard, want in enumerate(mounted):
        pod = builders.syncer_deployment(run, shard)["spec"]["template"]["spec"]
        got = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert got == ([want] if want else [])
        path = env(pod["containers"][0])["DILOCO_CHECKPOINT_PATH"]
        assert path == (checkpoint["path"] if "gs://" in str(checkpoint.get("path")) else MOUNT)


def test_learners_get_every_shard_shard_0_first() -> None:
    run = make_run()
    job = next(o for o in unit_objects(run) if o["kind"] == "Job")
    assert env(job["spec"]["template"]["spec"]["containers"][0])["DILOCO_SYNCER_ADDR"] == ADDRESSES


def test_network_policy_admits_learners_operator_and_shard_0_to_every_shard() -> None:
    objs = run_objects_with_policy(make_run(), OperatorIdentity("ops", {"app": "op"}))
    kinds = [o["kind"] for o in objs]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    # one policy over every shard's pods
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "diloco.dev/run": "r",
        "app.kubernetes.io/component": "syncer",
    }
    sources = policy["spec"]["ingress"][0]["from"]
    assert {
        "podSelector": {
            "matchLabels": {"diloco.dev/run": "r", "app.kubernetes.io/component": "learner"}
        }
    } in sources
    lead = {"diloco.dev/run": "r", "app.kubernetes.io/component": "syncer", LABEL_SHARD: "0"}
    assert {"podSelector": {"matchLabels": lead}} in sources
    assert len(sources) == 3
    alone = run_objects_with_policy(make_run(shards=1), OperatorIdentity("ops", {"app": "op"}))
    (single,) = [o for o in alone if o["kind"] == "NetworkPolicy"]
    assert len(single["spec"]["ingress"][0]["from"]) == 2


def test_operator_made_certificate_names_every_shard() -> None:
    secret = run_secrets.syncer_tls_secret(make_run(tls={}))
    assert secret is not None
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(secret["stringData"]["tls.crt"].encode())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    assert {"r-syncer.ml.svc", "r-syncer-1.ml.svc"} <= set(dns)


def test_sharded_https_syncers_verify_each_other_with_the_runs_ca() -> None:
    for shard in (0, 1):
        pod = builders.syncer_deployment(make_run(tls={}), shard)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "syncer-tls"]
        assert {i["key"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        for container in pod["containers"]:
            assert env(container)["DILOCO_CA_FILE"].endswith("/ca.crt")
    alone = builders.syncer_deployment(make_run(shards=0, tls={}))["spec"]["template"]["spec"]
    assert all("DILOCO_CA_FILE" not in env(c) for c in alone["containers"])


def test_names_fit_a_dns_label_at_the_longest_run_name_and_most_shards() -> None:
    name = "a" * 40
    spec = {**SPEC, "training": {"totalSteps": 1, "fragments": 64}, "syncer": {"shards": 64}}
    run = builders.Run(name, "ml", "u", parse_spec(spec, run=name))
    objs = builders.run_objects(run)
    assert len([o for o in objs if o["kind"] == "Deployment"]) == 64
    assert max(len(o["metadata"]["name"]) for o in objs) <= 63


def test_one_shard_is_the_run_it_always_was() -> None:
    """`shards: 1` (or unset) builds exactly what an unsharded run built: no shard label, env,
    folder or extra object."""
    implicit, explicit = make_run(shards=0), make_run(shards=1)
    for run in (implicit, explicit):
        objs = builders.run_objects(run, token="t") + unit_objects(run)
        text = json.dumps(objs)
        assert LABEL_SHARD not in text and "DILOCO_SYNCER_SHARD" not in text
        assert "shard-" not in text
    one = builders.run_objects(implicit, token="t") + unit_objects(implicit)
    assert one == builders.run_objects(explicit, token="t") + unit_objects(explicit)
    deploy = builders.syncer_deployment(implicit)
    assert env(deploy["spec"]["template"]["spec"]["containers"][0])["DILOCO_SYNCER_LOCK"] == (
        f"{MOUNT}/{SERVING_LOCK_FILE}"
    )


OBJCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "objcheck"


@pytest.mark.skipif(not OBJCHECK.exists(), reason="objcheck not built (crds/validate/build.sh)")
def test_kube_apiserver_create_validation_accepts_every_sharded_object() -> None:
    run = make_run(shards=3)
    objs = run_objects_with_policy(run, OperatorIdentity("ops", {})) + unit_objects(run)
    out = subprocess.run(
        [str(OBJCHECK)], input=yaml.safe_dump_all(objs), capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout
    assert sum(line.startswith("VALID ") for line in out.stdout.splitlines()) == len(objs)


# ----------------------------------------------------------------------------------------------
# what the operator sees


def test_the_planner_sees_one_syncer_present_and_ready_only_with_every_shard() -> None:
    run = make_run()
    up = [SyncerDeployment(True, 1, 0), SyncerDeployment(True, 1, 1)]
    assert observed_syncer(run, up) == handlers.ObservedSyncer(True, True, 1)
    # a shard missing: not present, so CreateSyncer makes it (the others exist: no-ops)
    assert not observed_syncer(run, up[:1]).present
    assert observed_syncer(run, []) == handlers.ObservedSyncer(False, False)
    starting = [up[0], SyncerDeployment(False, 1, 1)]
    assert observed_syncer(run, starting) == handlers.ObservedSyncer(True, False, 1)
    # a scale that reached one shard: the planner is shown a count it does not want
    half = [SyncerDeployment(True, 0, 0), SyncerDeployment(True, 1, 1)]
    assert observed_syncer(run, half).replicas == 0  # running run: wants 1
    suspended = make_run()
    suspended.spec = suspended.spec.model_copy(update={"suspend": True})
    assert observed_syncer(suspended, half).replicas == 1  # suspended: wants 0
    assert shard_of({LABEL_SHARD: "3"}) == 3 and shard_of({}) == 0 and shard_of(None) == 0


def test_scale_scales_every_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    scaled: list[tuple[str, int]] = []

    async def fake_scale(namespace: str, name: str, replicas: int) -> None:
        scaled.append((name, replicas))

    monkeypatch.setattr(kube, "scale_deployment", fake_scale)
    asyncio.run(actions.scale_syncer(actions.Pass(make_run(shards=3), {}), ScaleSyncer(0)))
    assert scaled == [("r-syncer", 0), ("r-syncer-1", 0), ("r-syncer-2", 0)]


def shard_doc(shard: int, versions: dict[int, int], **extra: Any) -> SyncerStatus:
    frags = tuple(FragmentStatus(index=p, version=v) for p, v in versions.items())
    return SyncerStatus.from_json(
        {
            "run": "r",
            "shard": f"{shard}/2",
            "outerStep": sum(versions.values()),
            "fragments": [f.to_json() for f in frags],
            "bytesReceived": 10,
            "bytesSent": 20,
            **extra,
        }
    )


LEAD = shard_doc(0, {0: 5, 2: 4}, steps=300, tokens=9000, complete=False)
OTHER = shard_doc(1, {1: 6, 3: 3})


def reads(*reports: SyncerStatus | None) -> list[ShardRead]:
    return [
        ShardRead(i, f"http://r-syncer-{i}", r, None if r else "ClientConnectorError: refused")
        for i, r in enumerate(reports)
    ]


def test_the_run_report_gathers_the_shards_and_never_shows_a_partial_sum() -> None:
    run = make_run()
    both = gathered_report(run, reads(LEAD, OTHER))
    assert both is not None
    assert both.outer_step == 18 and [f.index for f in both.fragments] == [0, 1, 2, 3]
    assert (both.steps, both.tokens, both.bytes_sent) == (300, 9000, 40)
    silent = gathered_report(run, reads(LEAD, None))
    assert silent is not None
    # the run-level parts are shard 0's; the outer step is unknown, not 9
    assert silent.steps == 300 and silent.outer_step is None and silent.bytes_sent is None
    assert gathered_report(run, reads(None, OTHER)) is None
    assert gathered_report(run, []) is None
    alone = make_run(shards=1)
    assert gathered_report(alone, reads(LEAD)) is LEAD


def test_status_shows_each_shard_and_names_the_one_down(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[tuple[str, str, str]] = []
    monkeypatch.setattr(
        "diloco_operator.k8s.shard_status.kopf.event",
        lambda body, type, reason, message: posted.append((type, reason, message)),
    )
    run = make_run()
    seen = [SyncerDeployment(True, 1, 0), SyncerDeployment(True, 1, 1)]
    first = report_shards(run, DilocoRunStatus(), None, seen, reads(LEAD, OTHER), {}, 1, 100.0)
    shards = first.syncer_shards or []
    assert [(s.index, s.name, s.ready, s.answering, s.outer_step) for s in shards] == [
        (0, "r-syncer", True, True, 9),
        (1, "r-syncer-1", True, True, 9),
    ]
    assert [(f.index, f.version) for f in shards[1].fragments] == [(1, 6), (3, 3)]
    cond = next(c for c in first.conditions if c.type == "SyncerShards")
    assert (cond.status, cond.reason) == ("True", "AllShardsAnswering")
    assert posted == []  # shards that came up say nothing

    down = report_shards(run, first, first, seen, reads(LEAD, None), {}, 1, 105.0)
    silent = (down.syncer_shards or [])[1]
    # what it last reported is kept, with why it is silent
    assert (silent.answering, silent.outer_step, len(silent.fragments)) == (False, 9, 2)
    assert silent.message and "http://r-syncer-1" in silent.message
    cond = next(c for c in down.conditions if c.type == "SyncerShards")
    assert (cond.status, cond.reason) == ("False", "ShardsNotAnswering")
    assert "shard 1 (r-syncer-1)" in cond.message
    assert [(t, r) for t, r, _ in posted] == [("Warning", "SyncerShardDown")]
    assert "shard 1 (r-syncer-1)" in posted[0][2]

    again = report_shards(run, down, down, seen, reads(LEAD, OTHER), {}, 1, 110.0)
    assert [(t, r) for t, r, _ in posted][1:] == [("Normal", "SyncerShardBack")]
    assert all(s.answering for s in again.syncer_shards or [])
    # status survives the API server's round trip and a re-read
    doc = again.model_dump(mode="json", by_alias=True)
    assert doc["syncerShards"][1]["outerStep"] == 9
    assert DilocoRunStatus.model_validate(doc) == again
    # an unsharded run's status is not touched
    assert report_shards(make_run(shards=1), first, None, seen, reads(LEAD), {}, 1, 1.0) is first


def test_a_suspended_run_says_so_and_posts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[str] = []
    monkeypatch.setattr(
        "diloco_operator.k8s.shard_status.kopf.event",
        lambda body, type, reason, message: posted.append(reason),
    )
    run = make_run()
    seen = [SyncerDeployment(True, 1, 0), SyncerDeployment(True, 1, 1)]
    up = report_shards(run, DilocoRunStatus(), None, seen, reads(LEAD, OTHER), {}, 1, 1.0)
    run.spec = run.spec.model_copy(update={"suspend": True})
    gone = report_shards(run, up, up, [], [], {}, 2, 2.0)
    cond = next(c for c in gone.conditions if c.type == "SyncerShards")
    assert (cond.status, cond.reason) == ("False", "RunSuspended") and posted == []
    assert [s.outer_step for s in gone.syncer_shards or []] == [9, 9]


def test_shard_entries_fit_the_crd() -> None:
    SyncerShardStatus(index=0, name="x" * 63)
    with pytest.raises(ValueError):
        SyncerShardStatus(index=0, name="x" * 64)


# ----------------------------------------------------------------------------------------------
# one pass against two shards over HTTP


def test_a_pass_reads_every_shard_and_hands_each_the_roster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rosters: list[str] = []
    statuses = {"r-syncer": LEAD.to_json(), "r-syncer-1": OTHER.to_json()}

    async def status(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer s3cret"
        return web.json_response(statuses[request.match_info["name"]])

    async def units(request: web.Request) -> web.Response:
        rosters.append(request.match_info["name"])
        return web.json_response({})

    async def scenario() -> DilocoRunStatus | None:
        app = web.Application()
        app.router.add_get("/{name}/v1/status", status)
        app.router.add_put("/{name}/v1/units", units)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        state.STATE.options = state.Options(syncer_url=f"http://127.0.0.1:{port}/{{name}}")
        state.STATE.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        state.STATE.tokens[("ns", "r")] = "s3cret"
        body = {"metadata": {"generation": 2}, "spec": {**SPEC, "syncer": {"shards": 2}}}
        deployments = Store([SyncerDeployment(True, 1, 0), SyncerDeployment(True, 1, 1)])
        indexes = {
            "learner_jobs": {},
            "learner_pods": {},
            "syncer_deployments": {("ns", "r"): deployments},
            "cluster_nodes": {},
        }
        try:
            _, new = await handlers.reconcile_once("r", "ns", "uid", body, None, indexes)
        finally:
            await state.STATE.http.close()
            state.STATE.http = None
            state.STATE.tokens.clear()
            state.STATE.reach.clear()
            await runner.cleanup()
        return new

    async def no_create(obj: dict[str, Any], run_uid: str) -> bool:
        return False

    async def no_patch(namespace: str, name: str, status: dict[str, Any]) -> None:
        return None

    monkeypatch.setattr(kube, "create", no_create)
    monkeypatch.setattr(kube, "patch_status", no_patch)
    monkeypatch.setattr(handlers.kopf, "event", lambda *a, **k: None)
    new = asyncio.run(scenario())
    assert new is not None
    assert sorted(rosters) == ["r-syncer", "r-syncer-1"]  # every shard admits the units
    assert new.outer_step == 18 and new.steps == 300
    assert [s.outer_step for s in new.syncer_shards or []] == [9, 9]


class Store(list[Any]):
    """Stands in for a kopf index store: an iterable of values."""
