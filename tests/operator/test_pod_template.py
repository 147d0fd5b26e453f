"""Pod template overrides: the merge (a pure function) and its precedence rules, the refusal of
operator-owned fields by the pydantic model and by the CRD's CEL rules (the API server's own
validation code when crdcheck is built), and the merged pods as the builders emit them."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import ROOT, openapi_schema, schema_errors
from diloco_operator.api import crdgen, parse_spec
from diloco_operator.api.pod_security import container_security_context
from diloco_operator.api.pod_template import (
    OWNED_MOUNT_PATHS,
    OWNED_VOLUMES,
    PodTemplate,
    PodTemplateMetadata,
    apply_template,
)
from diloco_operator.k8s import builders
from diloco_operator.planner import CreateUnit, desired_units
from k8s_roundtrip import roundtrip

GCS = {
    "name": "tokens",
    "csi": {
        "driver": "gcsfuse.csi.storage.gke.io",
        "readOnly": True,
        "volumeAttributes": {"bucketName": "b", "mountOptions": "implicit-dirs"},
    },
}
FULL = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"gke-gcsfuse/volumes": "true"}},
    "spec": {
        "volumes": [GCS],
        "containers": [{"name": "proxy", "image": "proxy:1", "args": ["--port", "9"]}],
        "initContainers": [
            {
                "name": "warm",
                "image": "busybox:1",
                "securityContext": {"runAsUser": 1000, "allowPrivilegeEscalation": False},
            }
        ],
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "training-high",
        "securityContext": {"supplementalGroups": [1234], "fsGroup": 4000},
        "terminationGracePeriodSeconds": 25,
    },
    "mainContainer": {
        "env": [
            {"name": "XLA_FLAGS", "value": "--xla_dump_to=/tmp/x"},
            {"name": "HOME", "value": "/data/home"},
            {"name": "SHARD", "value": "$(DILOCO_UNIT)"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "volumeMounts": [{"name": "tokens", "mountPath": "/data/tokens", "readOnly": True}],
    },
}

BASE = {
    "image": "trainer:1",
    "replicas": 2,
    "unitGroups": [
        {"name": "v6e", "tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x4"}},
    ],
    "training": {"totalSteps": 100},
}


def operator_pod() -> dict[str, Any]:
    """A pod template shaped as the builders make it (the merge only reads the shape)."""
    return {
        "metadata": {"labels": {"diloco.dev/run": "r", "app.kubernetes.io/name": "diloco"}},
        "spec": {
            "containers": [
                {
                    "name": "learner",
                    "env": [
                        {"name": "DILOCO_UNIT", "value": "3"},
                        {"name": "HOME", "value": "/tmp"},
                    ],
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "securityContext": {"runAsUser": 65532, "fsGroup": 65532, "runAsNonRoot": True},
        },
    }


def test_no_template_leaves_the_pod_as_built_and_never_mutates_its_input() -> None:
    pod = operator_pod()
    before = copy.deepcopy(pod)
    assert apply_template(pod, None) == before
    merged = apply_template(pod, PodTemplate.model_validate(FULL))
    assert pod == before
    assert merged != before


def test_merge_follows_the_precedence_rules() -> None:
    merged = apply_template(operator_pod(), PodTemplate.model_validate(FULL))
    meta, spec = merged["metadata"], merged["spec"]
    assert meta["labels"] == {
        "diloco.dev/run": "r",
        "app.kubernetes.io/name": "diloco",
        "team": "ml",
    }
    assert meta["annotations"] == {"gke-gcsfuse/volumes": "true"}
    main, proxy = spec["containers"]
    assert main["name"] == "learner"  # the main container stays first
    # env: operator vars first (user values may expand them), HOME replaced in place.
    assert [(e["name"], e.get("value")) for e in main["env"]] == [
        ("DILOCO_UNIT", "3"),
        ("HOME", "/data/home"),
        ("XLA_FLAGS", "--xla_dump_to=/tmp/x"),
        ("SHARD", "$(DILOCO_UNIT)"),
        ("POD", None),
    ]
    assert main["volumeMounts"][-1] == {
        "name": "tokens",
        "mountPath": "/data/tokens",
        "readOnly": True,
    }
    assert [v["name"] for v in spec["volumes"]] == ["tmp", "tokens"]
    assert spec["volumes"][1]["csi"]["volumeAttributes"]["bucketName"] == "b"
    # Extra containers pass through; without a securityContext they get the restricted one.
    assert proxy["args"] == ["--port", "9"]
    assert proxy["securityContext"] == container_security_context()
    assert spec["initContainers"][0]["securityContext"]["runAsUser"] == 1000
    # securityContext: key by key, the user's keys win, the others stay the operator's.
    assert spec["securityContext"] == {
        "runAsUser": 65532,
        "fsGroup": 4000,
        "runAsNonRoot": True,
        "supplementalGroups": [1234],
    }
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["priorityClassName"] == "training-high"
    assert spec["terminationGracePeriodSeconds"] == 25


def test_operator_labels_win_even_over_an_unvalidated_template() -> None:
    labels = {"diloco.dev/run": "other", "team": "x"}
    sneaky = PodTemplate.model_construct(
        metadata=PodTemplateMetadata.model_construct(labels=labels)
    )
    merged = apply_template(operator_pod(), sneaky)
    assert merged["metadata"]["labels"]["diloco.dev/run"] == "r"


def mount(path: str, name: str = "tokens") -> dict[str, Any]:
    return {
        "spec": {"volumes": [GCS]},
        "mainContainer": {"volumeMounts": [{"name": name, "mountPath": path}]},
    }


# (template, the field both the model and the API server name, what the model says about it)
OWNED_CASES = [
    ({"metadata": {"labels": {"diloco.dev/unit": "x"}}}, "metadata.labels", "diloco.dev/unit"),
    (
        {"metadata": {"labels": {"app.kubernetes.io/component": "x"}}},
        "metadata.labels",
        "app.kubernetes.io/component",
    ),
    ({"metadata": {"annotations": {"diloco.dev/x": "1"}}}, "metadata.annotations", "diloco.dev/x"),
    ({"spec": {"volumes": [{"name": "cache", "emptyDir": {}}]}}, "spec.volumes", "cache"),
    ({"spec": {"containers": [{"name": "learner", "image": "i"}]}}, "spec.containers", "learner"),
    (
        {"spec": {"initContainers": [{"name": "syncer", "image": "i"}]}},
        "spec.initContainers",
        "syncer",
    ),
    (
        {"mainContainer": {"env": [{"name": "DILOCO_UNIT", "value": "9"}]}},
        "mainContainer.env",
        "DILOCO_UNIT",
    ),
    (
        {"mainContainer": {"env": [{"name": "TPU_WORKER_ID", "value": "0"}]}},
        "mainContainer.env",
        "TPU_WORKER_ID",
    ),
    (mount("/tmp"), "mainContainer.volumeMounts", "/tmp overlaps the operator's mount /tmp"),
    (
        mount("/etc/diloco/x"),
        "mainContainer.volumeMounts",
        "overlaps the operator's mount /etc/diloco",
    ),
    (mount("/var/lib"), "mainContainer.volumeMounts", "mount /var/lib/diloco/checkpoints"),
    (
        mount("/data", name="nope"),
        "mainContainer.volumeMounts",
        "nope is not a volume of template.spec.volumes",
    ),
]


@pytest.mark.parametrize(("template", "field", "detail"), OWNED_CASES)
def test_pydantic_refuses_operator_owned_fields_naming_them(
    template: dict[str, Any], field: str, detail: str
) -> None:
    doc = copy.deepcopy(BASE)
    doc["unitGroups"][0]["template"] = template
    with pytest.raises(ValueError, match=r"spec\.unitGroups\.0\.template") as info:
        parse_spec(doc)
    assert f"{field}: " in str(info.value) and detail in str(info.value), str(info.value)
    with pytest.raises(ValueError, match=r"spec\.syncer\.template"):
        parse_spec({**BASE, "syncer": {"template": template}})


@pytest.mark.parametrize(
    "path", ["/tmp/", "data", "/data/../tmp", "/./tmp", "//tmp", "/data/.", "/"]
)
def test_mount_paths_must_be_normal_so_the_overlap_check_holds(path: str) -> None:
    with pytest.raises(ValueError, match="mountPath"):
        parse_spec({**BASE, "syncer": {"template": mount(path)}})
    assert schema_errors(wrap({"syncer": {"template": mount(path)}}))


def test_paths_beside_the_operators_are_fine() -> None:
    for path in ("/data", "/tmpdata", "/etc/dilocox", "/var/cache/other", "/.hidden/..x"):
        parse_spec({**BASE, "syncer": {"template": mount(path)}})


def wrap(spec_extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": "t"},
        "spec": {**copy.deepcopy(BASE), **spec_extra},
    }


def template_rules() -> list[dict[str, str]]:
    groups = openapi_schema()["properties"]["spec"]["properties"]["unitGroups"]
    node = groups["items"]["properties"]["template"]
    rules: list[dict[str, str]] = node["x-kubernetes-validations"]
    syncer = openapi_schema()["properties"]["spec"]["properties"]["syncer"]
    assert syncer["properties"]["template"]["x-kubernetes-validations"] == rules
    return rules


def test_crd_has_a_rule_for_every_owned_field_with_the_same_field_name() -> None:
    rules = template_rules()
    for _, field, _ in OWNED_CASES:
        assert any(r["message"].startswith(field + ":") for r in rules), field
    for rule in rules:
        # The message names the field, with [] for any list item; fieldPath cannot index a
        # list, so it names the field up to its first list.
        field = rule["message"].split(":")[0]
        assert rule["fieldPath"] == "." + field.split("[")[0]
        assert ("." + field.replace("[]", "")).startswith(rule["fieldPath"])


def test_rules_shared_by_two_templates_are_copies_not_yaml_aliases() -> None:
    rendered = crdgen.render()
    assert "&id" not in rendered and "*id" not in rendered


def test_crd_passes_volume_sources_and_containers_through() -> None:
    doc = wrap({"unitGroups": [{**BASE["unitGroups"][0], "template": FULL}]})
    assert not schema_errors(doc)


CRDCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "crdcheck"


@pytest.mark.skipif(not CRDCHECK.exists(), reason="crdcheck not built (crds/validate/build.sh)")
def test_api_server_validation_refuses_each_owned_field_and_accepts_the_full_template(
    tmp_path: Path,
) -> None:
    """The CEL rules as kube-apiserver's own code evaluates them, case by case. The full
    template is accepted only because its pass-through parts (csi source, args, securityContext,
    valueFrom) are preserved: without x-kubernetes-preserve-unknown-fields, strict field
    validation reports each as an unknown field."""
    files = []
    for i, template in enumerate([FULL, *(case[0] for case in OWNED_CASES)]):
        doc = wrap({"unitGroups": [{**BASE["unitGroups"][0], "template": template}]})
        path = tmp_path / f"{i:02d}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.append(path)
    out = subprocess.run(
        [str(CRDCHECK), str(ROOT / "crds" / "diloco.dev_dilocoruns.yaml"), *map(str, files)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    verdicts = {line.split(" ", 2)[1]: line for line in out[1:]}
    assert verdicts[str(files[0])].startswith("ACCEPT"), verdicts[str(files[0])]
    for path, (_, field, _) in zip(files[1:], OWNED_CASES, strict=True):
        line = verdicts[str(path)]
        assert line.startswith("REJECT") and f"template.{field}" in line, line


KEY_SYNTAX_CASES = [
    ({"metadata": {"labels": {"bad key": "x"}}}, "metadata.labels"),
    ({"metadata": {"annotations": {"-starts-with-dash": "1"}}}, "metadata.annotations"),
    ({"metadata": {"labels": {"UPPER.example.com/x": "1"}}}, "metadata.labels"),
]


@pytest.mark.skipif(not CRDCHECK.exists(), reason="crdcheck not built (crds/validate/build.sh)")
def test_label_and_annotation_keys_have_kubernetes_syntax_in_both_validators(
    tmp_path: Path,
) -> None:
    """A key the API server refuses on a Pod would make every Job of the group fail to create:
    the model and admission refuse the run instead, naming the map."""
    files = []
    for i, (template, field) in enumerate(KEY_SYNTAX_CASES):
        with pytest.raises(ValueError, match=rf"spec\.syncer\.template\.{field}"):
            parse_spec({**BASE, "syncer": {"template": template}})
        path = tmp_path / f"{i:02d}.yaml"
        path.write_text(yaml.safe_dump(wrap({"syncer": {"template": template}})))
        files.append(path)
    out = subprocess.run(
        [str(CRDCHECK), str(ROOT / "crds" / "diloco.dev_dilocoruns.yaml"), *map(str, files)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    verdicts = {line.split(" ", 2)[1]: line for line in out[1:]}
    for path, (_, field) in zip(files, KEY_SYNTAX_CASES, strict=True):
        line = verdicts[str(path)]
        assert line.startswith("REJECT") and f"template.{field}" in line, line


# --- the builders --------------------------------------------------------------------------


def make_run(**overrides: Any) -> builders.Run:
    return builders.Run("r", "ml", "uid", parse_spec({**copy.deepcopy(BASE), **overrides}))


def learner_pod(run: builders.Run) -> dict[str, Any]:
    slot = desired_units(run.name, run.spec)[0]
    unit = CreateUnit(slot.name, slot.group, 0, slot.global_index, 0, 2, slot.hosts)
    template: dict[str, Any] = builders.unit_job(run, unit)["spec"]["template"]
    return template


def syncer_pod(run: builders.Run) -> dict[str, Any]:
    template: dict[str, Any] = builders.syncer_deployment(run)["spec"]["template"]
    return template


def test_owned_lists_cover_every_volume_mount_and_env_the_builders_make() -> None:
    """OWNED_* are spelled in pod_template.py; this keeps them in step with the builders."""
    run = make_run(syncer={"checkpoint": {"size": "1Gi"}})
    for pod in (learner_pod(run), syncer_pod(run)):
        spec = pod["spec"]
        assert {v["name"] for v in spec["volumes"]} <= set(OWNED_VOLUMES)
        main = spec["containers"][0]
        assert {m["mountPath"] for m in main["volumeMounts"]} <= set(OWNED_MOUNT_PATHS)
        for var in main["env"]:
            assert var["name"].startswith(("DILOCO_", "TPU_")) or var["name"] == "HOME"
    assert any(
        m["mountPath"] == builders.CHECKPOINT_MOUNT
        for m in syncer_pod(run)["spec"]["containers"][0]["volumeMounts"]
    )
    assert builders.CONFIG_DIR in OWNED_MOUNT_PATHS


def test_group_and_syncer_templates_reach_their_pods_and_only_theirs() -> None:
    group = {**BASE["unitGroups"][0], "template": FULL}
    run = make_run(unitGroups=[group], syncer={"template": {"metadata": {"labels": {"s": "1"}}}})
    learner, syncer = learner_pod(run), syncer_pod(run)
    assert learner["metadata"]["labels"]["team"] == "ml"
    assert learner["metadata"]["labels"]["diloco.dev/unit"] == "r-v6e-0"
    assert "tokens" in {v["name"] for v in learner["spec"]["volumes"]}
    assert learner["spec"]["priorityClassName"] == "training-high"
    assert learner["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert syncer["metadata"]["labels"]["s"] == "1"
    assert "team" not in syncer["metadata"]["labels"]
    assert "tokens" not in {v["name"] for v in syncer["spec"]["volumes"]}
    job = builders.unit_job(
        run, CreateUnit("r-v6e-0", "v6e", 0, 0, 0, 2, run.spec.unit_groups[0].hosts)
    )
    assert roundtrip(job) == job
    assert roundtrip(builders.syncer_deployment(run)) == builders.syncer_deployment(run)


OBJCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "objcheck"


@pytest.mark.skipif(not OBJCHECK.exists(), reason="objcheck not built (crds/validate/build.sh)")
def test_kube_apiserver_create_validation_accepts_the_merged_objects() -> None:
    group = {**BASE["unitGroups"][0], "template": FULL, "spot": True}
    run = make_run(unitGroups=[group], syncer={"template": FULL})
    slot = desired_units(run.name, run.spec)[0]
    unit = CreateUnit(slot.name, slot.group, 0, slot.global_index, 0, 2, slot.hosts)
    objs = [builders.unit_job(run, unit), builders.syncer_deployment(run)]
    out = subprocess.run(
        [str(OBJCHECK)], input=yaml.safe_dump_all(objs), capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout
    assert sum(line.startswith("VALID ") for line in out.stdout.splitlines()) == 2
