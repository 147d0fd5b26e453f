"""Every DilocoRun example validates with the pydantic model and the CRD schema, round-trips
(parse -> wire -> parse), yields valid Kubernetes children, and its pods find every file its
training config reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import ROOT, schema_errors
from diloco_operator.api import DilocoRunSpec, parse_manifest, parse_spec
from diloco_operator.api.pod_paths import IMAGE_DIRS, under
from diloco_operator.k8s import builders
from diloco_operator.planner import ObservedSyncer, plan
from diloco_trainer.config import TrainingConfig
from diloco_trainer.join_credentials import mint_join_credential
from k8s_roundtrip import roundtrip

EXAMPLES = [
    p
    for p in sorted((ROOT / "examples").glob("*.yaml"))
    if yaml.safe_load(p.read_text()).get("kind") == "DilocoRun"
]


def test_the_operator_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"gke-tpu-v6e.yaml", "mixed-v6e-v5p.yaml", "kind-cpu.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_and_round_trips(path: Path) -> None:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    spec = parse_manifest(doc, pods=True)
    assert not schema_errors(doc), [e.message for e in schema_errors(doc)]
    wire = spec.to_wire()
    assert parse_spec(wire) == spec
    assert not schema_errors({**doc, "spec": wire})
    run = builders.Run(doc["metadata"]["name"], "default", "uid", spec)
    first = plan(run.name, spec, [], None, 0.0, syncer=ObservedSyncer(False, False))
    # An away run makes no syncer of its own and derives its units' tokens from a credential.
    objs = [] if spec.away else builders.run_objects(run)
    key = mint_join_credential("run-secret", run.name, "g", 2**31) if spec.away else "run-secret"
    for action in first.of_type(builders.CreateUnit):
        objs += builders.unit_objects(run, action, key)
    local = [i for i, g in enumerate(spec.unit_groups) if not g.remote]
    assert len([o for o in objs if o["kind"] == "Job"]) == sum(map(spec.group_replicas, local))
    for obj in objs:
        assert roundtrip(obj) == obj


# --- the files the training config reads are there ---------------------------------------
# A learner whose data.path does not exist exits with code 2 (a config error): its unit is
# failed at once and recreated until maxUnitRestarts. What a pod can read is what the image holds
# (docker/trainer*.Dockerfile: the virtual environment and HOME) and what its volumes mount.


def paths_read(training: TrainingConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """(field, path, the containers that read it) for each local path the trainer reads.

    data.path (the built-in memmap source): the learners, and the syncer too (its workload check
    and held-out evaluation read the data); model.initFrom: the syncer."""
    reads: list[tuple[str, str, tuple[str, ...]]] = []
    data = training.data
    if data.entrypoint is None and data.source == "memmap" and data.path:
        reads.append(("training.data.path", data.path, ("learner", "syncer", "syncer-standby")))
    if training.model.init_from:
        reads.append(
            ("training.model.initFrom", training.model.init_from, ("syncer", "syncer-standby"))
        )
    return reads


def unprovided(path: str, container: dict[str, Any], volumes: list[dict[str, Any]]) -> str | None:
    """Why `container` cannot read `path` (None: it can): the path must lie in the image's own
    directories or under a mount whose volume the pod declares. Relative paths are the local
    runtime's (resolved against where it runs), which a pod never has."""
    if not path.startswith("/"):
        return f"{path} is relative: no pod resolves it to a file it has"
    if any(under(path, d) for d in IMAGE_DIRS):
        return None
    declared = {v["name"] for v in volumes}
    for mount in container.get("volumeMounts", []):
        if under(path, mount["mountPath"]):
            if mount["name"] in declared:
                return None
            return f"{path}: mounted from {mount['name']!r}, a volume the pod does not declare"
    return f"{path}: no volume of the pod is mounted there"


def pods_of(name: str, spec: DilocoRunSpec) -> dict[str, dict[str, Any]]:
    """A pod spec per place a container runs: the syncer, and one learner per unit group."""
    run = builders.Run(name, "default", "uid", spec)
    first = plan(run.name, spec, [], None, 0.0, syncer=ObservedSyncer(False, False))
    pods = {"syncer": builders.syncer_deployment(run)["spec"]["template"]["spec"]}
    for action in first.of_type(builders.CreateUnit):
        job = builders.unit_job(run, action)
        pods.setdefault(f"unitGroups[{action.group}]", job["spec"]["template"]["spec"])
    return pods


def unreadable(name: str, spec: DilocoRunSpec) -> list[str]:
    """Each (container, field, why) where a container reads a path it does not have."""
    problems = []
    pods = pods_of(name, spec)
    for field, path, readers in paths_read(spec.training):
        for where, pod in pods.items():
            for container in pod["containers"]:
                if container["name"] in readers:
                    why = unprovided(path, container, pod.get("volumes", []))
                    if why:
                        problems.append(f"{where} {container['name']}: {field} {why}")
    # A group's compile cache: its learners write there.
    for group in spec.unit_groups:
        pod = pods.get(f"unitGroups[{group.name}]")
        if group.compile_cache and pod is not None:
            why = unprovided(group.compile_cache, pod["containers"][0], pod.get("volumes", []))
            if why:
                problems.append(f"unitGroups[{group.name}] learner: compileCache {why}")
    # The syncer's checkpoints: the operator's own volume, or a bucket.
    for container in pods["syncer"]["containers"]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        checkpoint = env["DILOCO_CHECKPOINT_PATH"]
        if not checkpoint.startswith("gs://"):
            why = unprovided(checkpoint, container, pods["syncer"]["volumes"])
            assert why is None, f"{container['name']}: DILOCO_CHECKPOINT_PATH {why}"
    return problems


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_pods_mount_every_path_the_training_reads(path: Path) -> None:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    assert unreadable(doc["metadata"]["name"], parse_manifest(doc)) == []


def no_volume(where: str, field: str, path: str) -> str:
    return f"{where}: training.{field} {path}: no volume of the pod is mounted there"


def test_the_check_names_a_path_no_volume_provides() -> None:
    memmap = {"source": "memmap", "path": "/data/tokens"}
    training = {"totalSteps": 5, "data": memmap, "model": {"initFrom": "/w/x.safetensors"}}
    syncers = ("syncer syncer", "syncer syncer-standby")
    bare = parse_spec({"image": "t", "training": training})
    assert set(unreadable("r", bare)) == {
        *(no_volume(w, "data.path", "/data/tokens") for w in syncers),
        *(no_volume(w, "model.initFrom", "/w/x.safetensors") for w in syncers),
        no_volume("unitGroups[default] learner", "data.path", "/data/tokens"),
    }
    # The learners' volume alone is not enough: the syncer reads the data too.
    volume = {"name": "tokens", "persistentVolumeClaim": {"claimName": "tokens", "readOnly": True}}
    template = {
        "spec": {"volumes": [volume]},
        "mainContainer": {"volumeMounts": [{"name": "tokens", "mountPath": "/data"}]},
    }
    groups = [{"name": "default", "template": template}]
    learners_only = parse_spec({"image": "t", "unitGroups": groups, "training": training})
    assert set(unreadable("r", learners_only)) == {
        *(no_volume(w, "data.path", "/data/tokens") for w in syncers),
        *(no_volume(w, "model.initFrom", "/w/x.safetensors") for w in syncers),
    }
    both = {"image": "t", "unitGroups": groups, "syncer": {"template": template}}
    assert set(unreadable("r", parse_spec({**both, "training": training}))) == {
        no_volume(w, "model.initFrom", "/w/x.safetensors") for w in syncers
    }
    # A mount of a volume the pod lacks provides nothing (the models refuse it in a template).
    pod = {"volumeMounts": [{"name": "gone", "mountPath": "/data"}]}
    assert "'gone', a volume the pod does not declare" in str(unprovided("/data/x", pod, []))
    # What the image holds needs no volume; a relative path is no file a pod has.
    shipped = {**training, "data": {}, "model": {"initFrom": "/opt/diloco/w.safetensors"}}
    assert unreadable("r", parse_spec({"image": "t", "training": shipped})) == []
    relative = {**training, "data": {**memmap, "path": "tokens"}, "model": {}}
    problems = unreadable("r", parse_spec({**both, "training": relative}))
    assert problems and all("tokens is relative" in problem for problem in problems)


def test_a_groups_compile_cache_is_where_its_learners_mount_a_volume() -> None:
    """A recreated pod reads what the last one compiled only if the cache is on a volume."""
    volume = {"name": "xla", "persistentVolumeClaim": {"claimName": "xla-cache"}}
    mounted = {
        "spec": {"volumes": [volume]},
        "mainContainer": {"volumeMounts": [{"name": "xla", "mountPath": "/cache"}]},
    }
    groups = [
        {"name": "v6e", "compileCache": "/cache/xla", "template": mounted},
        {"name": "v5p", "replicas": 1, "compileCache": "/nowhere/xla"},
    ]
    spec = parse_spec({"image": "t", "unitGroups": groups, "training": {"totalSteps": 5}})
    assert unreadable("r", spec) == [
        "unitGroups[v5p] learner: compileCache /nowhere/xla: no volume of the pod is mounted there"
    ]
    pods = pods_of("r", spec)
    env = {e["name"]: e.get("value") for e in pods["unitGroups[v6e]"]["containers"][0]["env"]}
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/cache/xla"
    syncer_env = {e["name"] for e in pods["syncer"]["containers"][0]["env"]}
    assert "JAX_COMPILATION_CACHE_DIR" not in syncer_env
    with pytest.raises(ValueError, match="compileCache"):
        parse_spec(
            {
                "image": "t",
                "unitGroups": [{"name": "g", "compileCache": "relative/xla"}],
                "training": {"totalSteps": 5},
            }
        )
