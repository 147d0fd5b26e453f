"""Builders produce valid Kubernetes objects (round-tripped through the kubernetes models) with
the TPU placement, env contract, labels and owner references the design asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.api import parse_spec, pod_security
from diloco_operator.k8s import builders, object_meta, run_secrets
from diloco_operator.k8s.spare_pods import spare_objects
from diloco_operator.planner import CreateSpare, CreateUnit, desired_units
from diloco_operator.planner.spares import desired_spares
from diloco_trainer.auth import spare_token, unit_token
from diloco_trainer.config import SERVING_LOCK_FILE, load_training_config
from k8s_roundtrip import roundtrip

MIXED = {
    "image": "trainer:1",
    "replicas": 2,
    "unitGroups": [
        {
            "name": "v6e",
            "tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x4"},
            "exclusiveTopology": True,
            "resources": {"requests": {"cpu": 4, "memory": "16Gi"}},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        },
        {
            "name": "v5p",
            "replicas": 1,
            "tpu": {"accelerator": "tpu-v5p-slice", "topology": "2x2x1"},
        },
        {"name": "cpu", "replicas": 1, "nodeSelector": {"pool": "cpu"}, "spares": 1},
    ],
    "training": {"totalSteps": 100, "quorum": 2, "innerSteps": 7},
    "serviceAccountName": "trainer",
}


def make_run(**overrides: Any) -> builders.Run:
    return builders.Run("mix", "ml", "uid-123", parse_spec({**MIXED, **overrides}))


def create(run: builders.Run, name: str, attempt: int = 0) -> CreateUnit:
    slot = next(s for s in desired_units(run.name, run.spec) if s.name == name)
    return CreateUnit(
        slot.name,
        slot.group,
        slot.index,
        slot.global_index,
        attempt,
        run.spec.total_units,
        slot.hosts,
    )


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    return container_env(job["spec"]["template"]["spec"]["containers"][0])


def container_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def all_objects(run: builders.Run) -> list[dict[str, Any]]:
    objs = builders.run_objects(run)
    for slot in desired_units(run.name, run.spec):
        objs += builders.unit_objects(run, create(run, slot.name), "run-secret")
    for spare in desired_spares(run.name, run.spec):
        action = CreateSpare(spare.name, spare.group, spare.index, 2, run.spec.total_units)
        objs += spare_objects(run, action, "run-secret")
    return objs


def test_a_spare_pod_is_its_groups_unit_pod_without_a_unit() -> None:
    run = make_run()
    secret, job = spare_objects(run, CreateSpare("mix-cpu-s0", "cpu", 0, 2, 4), "run-secret")
    unit = builders.unit_job(run, create(run, "mix-cpu-0"))
    assert secret["stringData"]["token"] == spare_token("run-secret", "mix-cpu-s0")
    assert job["metadata"]["labels"]["diloco.dev/spare"] == "true"
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"]["diloco.dev/spare"] == "true"
    assert pod["metadata"]["labels"]["diloco.dev/attempt"] == "2"
    env = env_of(job)
    assert env["DILOCO_SPARE"] == "mix-cpu-s0" and env["DILOCO_NUM_UNITS"] == "4"
    assert not {"DILOCO_UNIT", "DILOCO_UNIT_NAME", "DILOCO_ATTEMPT"} & set(env)
    assert (
        env["DILOCO_GROUP"] == "cpu" and env["DILOCO_SUPERVISE"] == env_of(unit)["DILOCO_SUPERVISE"]
    )
    # The same hardware and placement as the group's units; no Service to resolve it by.
    spare_pod, unit_pod = pod["spec"], unit["spec"]["template"]["spec"]
    assert "subdomain" not in spare_pod
    for key in ("nodeSelector", "securityContext", "affinity", "tolerations"):
        assert spare_pod.get(key) == unit_pod.get(key), key
    volumes = {v["name"]: v for v in spare_pod["volumes"]}
    assert volumes.pop("token")["secret"]["secretName"] == "mix-cpu-s0-token"
    assert volumes == {v["name"]: v for v in unit_pod["volumes"] if v["name"] != "token"}
    assert spare_pod["containers"][0]["resources"] == unit_pod["containers"][0]["resources"]


def test_every_object_round_trips_through_the_kubernetes_models() -> None:
    objs = all_objects(make_run())
    assert {o["kind"] for o in objs} == {
        "Job",
        "Service",
        "Secret",
        "ConfigMap",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "Deployment",
    }
    for obj in objs:
        assert roundtrip(obj) == obj, f"{obj['kind']} {obj['metadata']['name']}"


def test_multi_host_tpu_unit_is_an_indexed_job_over_its_hosts() -> None:
    run = make_run()
    job = builders.unit_job(run, create(run, "mix-v6e-1", attempt=3))
    spec = job["spec"]
    assert (
        spec["completionMode"],
        spec["completions"],
        spec["parallelism"],
        spec["backoffLimit"],
    ) == ("Indexed", 2, 2, 0)
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == "mix-v6e-1"
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert {"key": "spot", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["google.com/tpu"] == res["requests"]["google.com/tpu"] == "4"
    assert res["requests"]["cpu"] == "4"
    assert "podAntiAffinity" in pod["affinity"]
    assert pod["serviceAccountName"] == "trainer"
    env = env_of(job)
    # fixed groups first: v5p-0 is 0, cpu-0 is 1, then v6e-0 = 2, v6e-1 = 3
    assert env["DILOCO_UNIT"] == "3" and env["DILOCO_NUM_UNITS"] == "4"
    assert (env["DILOCO_UNIT_NAME"], env["DILOCO_ATTEMPT"], env["DILOCO_GROUP"]) == (
        "mix-v6e-1",
        "3",
        "v6e",
    )
    assert env["DILOCO_SYNCER_ADDR"] == "http://mix-syncer.ml.svc:8470"
    assert "DILOCO_TOKEN" not in env  # the token is a mounted file, never an env var
    assert env["DILOCO_TOKEN_FILE"] == "/var/run/diloco/token/token"
    assert env["TPU_WORKER_HOSTNAMES"] == "mix-v6e-1-0.mix-v6e-1,mix-v6e-1-1.mix-v6e-1"
    labels = spec["template"]["metadata"]["labels"]
    assert labels["diloco.dev/run"] == "mix" and labels["diloco.dev/attempt"] == "3"
    assert labels["diloco.dev/unit"] == "mix-v6e-1" and labels["diloco.dev/group"] == "v6e"
    owner = job["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("DilocoRun", "uid-123", True)


def test_ironwood_unit_selects_both_labels_and_runs_a_pod_per_4_chip_host() -> None:
    """GKE's own multi-host Ironwood sample selects tpu7x and its topology (2x2x2: 2 pods)."""
    ironwood = {"name": "iw", "tpu": {"accelerator": "tpu7x", "topology": "2x2x2"}}
    run = make_run(replicas=2, unitGroups=[ironwood])
    job = builders.unit_job(run, create(run, "mix-iw-0"))
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (2, 2)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "2x2x2",
    }
    res = pod["containers"][0]["resources"]
    assert res["limits"]["google.com/tpu"] == res["requests"]["google.com/tpu"] == "4"


def test_a_multi_host_cpu_unit_is_one_jax_program_over_its_pods() -> None:
    run = make_run(
        replicas=1,
        unitGroups=[{"name": "g", "hostsPerUnit": 2}],
        training={"totalSteps": 5},
    )
    (slot,) = desired_units(run.name, run.spec)
    assert slot.hosts == 2
    job = builders.unit_job(run, create(run, slot.name))
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == slot.name
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TPU_WORKER_HOSTNAMES"] == f"{slot.name}-0.{slot.name},{slot.name}-1.{slot.name}"
    assert env["DILOCO_SUPERVISE"] == "1"  # the supervisors restart the unit's hosts together


def test_single_host_and_cpu_units() -> None:
    run = make_run()
    v5p = builders.unit_job(run, create(run, "mix-v5p-0"))
    assert v5p["spec"]["completions"] == 1
    assert v5p["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "google.com/tpu": "4"
    }
    cpu = builders.unit_job(run, create(run, "mix-cpu-0"))
    pod = cpu["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert "tolerations" not in pod and "affinity" not in pod
    assert pod["containers"][0]["resources"] == {}


def test_unit_service_is_headless_and_selects_the_units_attempt() -> None:
    """The pods of the attempt before keep their hostnames while they are deleted in the
    background: the Service must not answer a host's lookup of its peer with one of them."""
    run = make_run()
    unit = create(run, "mix-v6e-0")
    svc = builders.unit_service(run, unit)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {
        "diloco.dev/unit": "mix-v6e-0",
        "diloco.dev/attempt": str(unit.attempt),
    }
    pod_labels = builders.unit_job(run, unit)["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_syncer_deployment_recreate_with_readiness_and_checkpoint_pvc() -> None:
    run = make_run()
    dep = builders.syncer_deployment(run)
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["command"][0] == "diloco-syncer"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "mix-checkpoints"
    claim = builders.checkpoint_claim(run)
    assert claim is not None and claim["spec"]["resources"]["requests"]["storage"] == "10Gi"


@pytest.mark.parametrize(
    ("checkpoint", "volume", "path"),
    [
        ({"path": "gs://b/runs"}, None, "gs://b/runs"),
        ({"ephemeral": True}, "emptyDir", builders.CHECKPOINT_MOUNT),
        ({"path": "my-claim"}, "persistentVolumeClaim", builders.CHECKPOINT_MOUNT),
    ],
)
def test_checkpoint_storage_variants(
    checkpoint: dict[str, Any], volume: str | None, path: str
) -> None:
    run = make_run(syncer={"checkpoint": checkpoint})
    assert builders.checkpoint_claim(run) is None  # nothing for the operator to own
    dep = builders.syncer_deployment(run)
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DILOCO_CHECKPOINT_PATH"] == path
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    if volume is None:
        assert "checkpoints" not in volumes
    else:
        assert volume in volumes["checkpoints"]
    assert roundtrip(dep) == dep


def test_token_is_random_per_run() -> None:
    run = make_run()
    a, b = run_secrets.token_secret(run), run_secrets.token_secret(run)
    assert a["stringData"]["token"] != b["stringData"]["token"]
    assert len(a["stringData"]["token"]) >= 32


def test_config_map_is_readable_by_the_trainer(tmp_path: Path) -> None:
    """The learner and syncer load this very file with the trainer's own loader."""
    run = make_run()
    cm = builders.config_map(run)
    path = tmp_path / "run.yaml"
    path.write_text(cm["data"][builders.CONFIG_FILE])
    assert load_training_config(path) == run.spec.training
    assert yaml.safe_load(path.read_text())["metadata"]["name"] == "mix"


def test_unknown_group_is_a_clear_error() -> None:
    run = make_run()
    with pytest.raises(ValueError, match="group 'gone'"):
        builders.unit_job(run, CreateUnit("mix-gone-0", "gone", 0, 0, 0, 1, 1))


OBJCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "objcheck"


@pytest.mark.skipif(not OBJCHECK.exists(), reason="objcheck not built (crds/validate/build.sh)")
def test_kube_apiserver_create_validation_accepts_every_built_object() -> None:
    """kube-apiserver's own validation code (k8s.io/kubernetes v1.37), no cluster needed."""
    import subprocess

    objs = all_objects(make_run()) + all_objects(
        make_run(syncer={"checkpoint": {"ephemeral": True}})
    )
    out = subprocess.run(
        [str(OBJCHECK)], input=yaml.safe_dump_all(objs), capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout
    assert sum(line.startswith("VALID ") for line in out.stdout.splitlines()) == len(objs)


def _pod_specs(run: builders.Run) -> dict[str, dict[str, Any]]:
    job = builders.unit_job(run, create(run, "mix-cpu-0"))
    syncer = builders.syncer_deployment(run)
    return {
        "learner": job["spec"]["template"]["spec"],
        "syncer": syncer["spec"]["template"]["spec"],
    }


@pytest.mark.parametrize("role", ["learner", "syncer"])
def test_pods_meet_the_restricted_pod_security_profile(role: str) -> None:
    """The checks of the "restricted" profile that a pod spec can fail (the e2e suite also
    enforces the profile on a namespace): non-root, no escalation, no capabilities, seccomp."""
    pod = _pod_specs(make_run())[role]
    sec = pod["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["runAsUser"] != 0
    assert sec["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"]:
        csec = c["securityContext"]
        assert csec["allowPrivilegeEscalation"] is False
        assert csec["capabilities"] == {"drop": ["ALL"]}
        assert csec["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("role", ["learner", "syncer"])
def test_pods_get_the_token_as_a_group_readable_file(role: str) -> None:
    pod = _pod_specs(make_run())[role]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert "DILOCO_TOKEN" not in env
    path = env["DILOCO_TOKEN_FILE"]["value"]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    # the syncer holds the run secret; a learner only its own unit's token
    assert volume["secret"]["secretName"] == (
        "mix-token" if role == "syncer" else "mix-cpu-0-token"
    )
    assert volume["secret"]["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


@pytest.mark.parametrize("role", ["learner", "syncer"])
def test_uid_without_home_gets_writable_home_and_caches(role: str) -> None:
    """uid 65532 has no passwd entry (HOME would be /) and the root filesystem is read-only:
    HOME, the trainer cache and /tmp must be writable volumes."""
    pod = _pod_specs(make_run())[role]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    for var in ("HOME", "DILOCO_CACHE_DIR"):
        assert any(env[var] == p or env[var].startswith(p + "/") for p in writable), var
    assert "/tmp" in writable


def test_syncer_placement_follows_its_spec() -> None:
    toleration = {"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
    run = make_run(syncer={"nodeSelector": {"pool": "cpu"}, "tolerations": [toleration]})
    pod = builders.syncer_deployment(run)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [toleration]
    roundtrip(builders.syncer_deployment(run))


def test_each_unit_gets_its_own_token_derived_from_the_run_secret() -> None:
    run = make_run()
    unit = create(run, "mix-cpu-0")
    service, secret, job = builders.unit_objects(run, unit, "the-run-secret")
    assert (service["kind"], secret["kind"], job["kind"]) == ("Service", "Secret", "Job")
    assert secret["metadata"]["name"] == "mix-cpu-0-token"
    assert secret["stringData"]["token"] == unit_token("the-run-secret", "mix-cpu-0")
    assert secret["stringData"]["token"] != "the-run-secret"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-123"
    other = run_secrets.unit_token_secret(run, "mix-v5p-0", "the-run-secret")
    assert other["stringData"]["token"] != secret["stringData"]["token"]
    roundtrip(secret)


def test_syncer_readiness_is_its_ability_to_merge_and_persist() -> None:
    run = make_run()
    container = builders.syncer_deployment(run)["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # not ready is reported, never a reason to cut learners off from it
    assert builders.syncer_service(run)["spec"]["publishNotReadyAddresses"] is True


def test_syncer_standby_is_a_second_container_on_the_same_lock_and_port() -> None:
    template = {"mainContainer": {"env": [{"name": "EXTRA", "value": "1"}]}}
    run = make_run(syncer={"template": template})
    pod = builders.syncer_deployment(run)["spec"]["template"]
    serving, standby = pod["spec"]["containers"][:2]
    assert (serving["name"], standby["name"]) == ("syncer", "syncer-standby")
    assert pod["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == "syncer"
    for c in (serving, standby):
        env = container_env(c)
        # on the claim: a replacement pod's syncer waits for the old pod's to exit
        lock = f"{builders.CHECKPOINT_MOUNT}/{SERVING_LOCK_FILE}"
        assert env["DILOCO_SYNCER_LOCK"] == lock and env["EXTRA"] == "1"
        assert c["command"] == serving["command"]
        assert c["securityContext"] == pod_security.container_security_context()
        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}  # the shared lock's dir
    assert "ports" not in standby  # the port is served by whichever holds the lock
    assert standby["readinessProbe"]["httpGet"]["port"] == 8470
    assert standby["livenessProbe"]["httpGet"]["port"] == 8470
    assert serving["readinessProbe"]["httpGet"]["port"] == "http"  # the copy changed nothing
    for c in (serving, standby):  # liveness waits until one of them serves
        assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": 8470}
    assert "requests" not in standby.get("resources", {})  # the pod fits where one syncer did
    limited = builders.syncer_deployment(
        make_run(syncer={"resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "8Gi"}}})
    )["spec"]["template"]["spec"]["containers"]
    assert limited[0]["resources"]["requests"] == {"memory": "4Gi"}
    assert limited[1]["resources"] == {"limits": {"memory": "8Gi"}}
    assert roundtrip(builders.syncer_deployment(run)) == builders.syncer_deployment(run)

    alone = builders.syncer_deployment(make_run(syncer={"standby": False}))["spec"]["template"]
    assert [c["name"] for c in alone["spec"]["containers"]] == ["syncer"]
    assert container_env(alone["spec"]["containers"][0])["DILOCO_SYNCER_LOCK"] == lock


@pytest.mark.parametrize(
    ("checkpoint", "standby", "lock"),
    [
        ({"size": "1Gi"}, True, "/var/lib/diloco/checkpoints/.serving.lock"),
        ({"size": "1Gi"}, False, "/var/lib/diloco/checkpoints/.serving.lock"),
        ({"ephemeral": True}, True, "/tmp/diloco-syncer.lock"),
        ({"ephemeral": True}, False, None),
        ({"path": "gs://bucket/run"}, True, "/tmp/diloco-syncer.lock"),
        ({"path": "gs://bucket/run"}, False, None),
    ],
)
def test_the_serving_lock_is_on_the_claim_else_in_the_pod_for_a_standby(
    checkpoint: dict[str, Any], standby: bool, lock: str | None
) -> None:
    run = make_run(syncer={"checkpoint": checkpoint, "standby": standby})
    containers = builders.syncer_deployment(run)["spec"]["template"]["spec"]["containers"]
    for c in containers:
        assert container_env(c).get("DILOCO_SYNCER_LOCK") == lock
    assert len(containers) == (2 if standby else 1)


SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"


@pytest.mark.parametrize("standby", [True, False])
def test_the_syncer_is_kept_from_node_consolidation_and_drains(standby: bool) -> None:
    run = make_run(syncer={"standby": standby})
    objs = builders.run_objects(run)
    kinds = [o["kind"] for o in objs]
    # Created with the syncer's objects, before its Deployment: the pod never runs without it.
    assert kinds.count("PodDisruptionBudget") == 1
    assert kinds.index("PodDisruptionBudget") < kinds.index("Deployment")
    budget = objs[kinds.index("PodDisruptionBudget")]
    deployment = objs[kinds.index("Deployment")]
    # A child of the run under a name a restarted operator finds again (a create meets a 409).
    assert budget["metadata"]["name"] == "mix-syncer" == run.syncer_name
    assert budget["metadata"]["ownerReferences"] == [object_meta.owner_reference(run)]
    assert budget["metadata"]["labels"]["diloco.dev/run"] == "mix"
    # No voluntary eviction: the standby is a container of the same pod, so it goes with it.
    assert budget["spec"]["maxUnavailable"] == 0 and "minAvailable" not in budget["spec"]
    # ... but a syncer that is not ready (starting, crash-looping) never blocks a drain for good.
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    learner = builders.unit_job(run, create(run, "mix-cpu-0"))["spec"]["template"]
    assert not selector.items() <= learner["metadata"]["labels"].items()
    # The cluster autoscaler does not move it to consolidate nodes.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations[SAFE_TO_EVICT] == "false"
    assert SAFE_TO_EVICT not in learner["metadata"].get("annotations", {})
    assert roundtrip(budget) == budget


def test_a_syncer_template_may_let_the_autoscaler_move_it() -> None:
    template = {"metadata": {"annotations": {SAFE_TO_EVICT: "true", "team": "ml"}}}
    run = make_run(syncer={"template": template})
    annotations = builders.syncer_deployment(run)["spec"]["template"]["metadata"]["annotations"]
    assert annotations[SAFE_TO_EVICT] == "true" and annotations["team"] == "ml"


V6E_2X4 = {"accelerator": "tpu-v6e-slice", "topology": "2x4"}  # 2 hosts of 4 chips
V5P_2X2X1 = {"accelerator": "tpu-v5p-slice", "topology": "2x2x1"}  # 1 host


@pytest.mark.parametrize(
    ("group", "exclusive"),
    [
        ({"tpu": V6E_2X4}, True),  # a multi-host unit keeps to one slice by default
        ({"tpu": V6E_2X4, "exclusiveTopology": False}, False),  # unless told otherwise
        ({"tpu": {**V6E_2X4, "chipsPerHost": 8}}, False),  # the same shape on one 8-chip host
        ({"tpu": V5P_2X2X1}, False),
        ({"tpu": V5P_2X2X1, "exclusiveTopology": True}, True),
        ({}, False),  # a CPU/GPU unit: one pod
        ({"hostsPerUnit": 2}, False),  # GPU node pools: nothing to keep whole
    ],
)
def test_multi_host_units_keep_to_one_slice_by_default(
    group: dict[str, Any], exclusive: bool
) -> None:
    run = make_run(replicas=2, unitGroups=[{"name": "g", **group}], training={"totalSteps": 5})
    assert run.spec.unit_groups[0].exclusive_topology is exclusive
    pod = builders.unit_job(run, create(run, "mix-g-0"))["spec"]["template"]["spec"]
    if exclusive:
        # every host of the unit in one node pool, and no other unit's pods there
        rule = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert rule == [
            {
                "labelSelector": {"matchLabels": {"diloco.dev/unit": "mix-g-0"}},
                "topologyKey": "cloud.google.com/gke-nodepool",
            }
        ]
        assert "podAntiAffinity" in pod["affinity"]
    else:
        assert "affinity" not in pod
    # The resolved value is what the manifest reads back as: a round trip keeps it.
    assert parse_spec(run.spec.to_wire()) == run.spec
