"""The Cluster Toolkit blueprint (examples/cluster-toolkit/diloco-tpu.yaml) agrees, offline, with
the toolkit it names, with the operator's TPU table and with docs/gke.md.

Nothing here deploys it (no GCP project in the tests). What is checked:
- it is YAML, and every module `source` is a toolkit module read at TOOLKIT_COMMIT, each setting a
  variable of that module's variables.tf there;
- its TPU node pools are slices the operator accepts (`check_tpu`), with as many nodes as the
  operator runs pods per unit (`hosts`), and the same pools as the guide's gcloud commands;
- the Kueue objects it applies select those pools and the queue the Kueue example names;
- the namespace, the ServiceAccount and the node pool names are those docs/gke.md uses.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from diloco_operator.api.accelerators import check_tpu, hosts

ROOT = Path(__file__).resolve().parents[2]
BLUEPRINT = ROOT / "examples" / "cluster-toolkit" / "diloco-tpu.yaml"
KUEUE_TEMPLATE = ROOT / "examples" / "cluster-toolkit" / "diloco-kueue.yaml.tftpl"
GUIDE = ROOT / "docs" / "gke.md"
KUEUE_EXAMPLE = ROOT / "examples" / "gke-tpu-v6e-kueue.yaml"
GCSFUSE_EXAMPLE = ROOT / "examples" / "gke-tpu-v6e.yaml"

# github.com/GoogleCloudPlatform/cluster-toolkit, read at this commit (2026-06-25). For each module
# the blueprint uses: the input variables (its variables.tf) the blueprint sets. A setting outside
# these is a name nobody looked up: read the module's variables.tf and add it here.
TOOLKIT_COMMIT = "1047080375afbb44da4b596be314634e7486af4a"
TOOLKIT_MODULES: dict[str, frozenset[str]] = {
    "modules/network/vpc": frozenset({"subnetwork_name", "secondary_ranges_list"}),
    "modules/project/service-account": frozenset({"name", "project_roles"}),
    "modules/scheduler/gke-cluster": frozenset(
        {
            "cluster_availability_type",
            "release_channel",
            "version_prefix",
            "enable_private_endpoint",
            "master_authorized_networks",
            "enable_gcsfuse_csi",
            "enable_dcgm_monitoring",
            "system_node_pool_name",
            "system_node_pool_machine_type",
            "system_node_pool_node_count",
            "system_node_pool_taints",
            "configure_workload_identity_sa",
            "namespace",
            "k8s_service_account_name",
        }
    ),
    "modules/compute/gke-node-pool": frozenset(
        {
            "name",
            "machine_type",
            "num_slices",
            "static_node_count",
            "zones",
            "placement_policy",
            "spot",
        }
    ),
    "modules/management/kubectl-apply": frozenset({"kueue"}),
}
# The toolkit's map from a TPU machine family to the GKE accelerator label
# (modules/internal/tpu-definition/main.tf, tpu_accelerator_map, at TOOLKIT_COMMIT); chips per host
# are the machine type's "-<N>t" suffix (pkg/config/hardware.go, CalculateAcceleratorNodes).
TPU_FAMILIES = {
    "ct4p": "tpu-v4-podslice",
    "ct5lp": "tpu-v5-lite-podslice",
    "ct5p": "tpu-v5p-slice",
    "ct6e": "tpu-v6e-slice",
    "tpu7x": "tpu7x",
}
NODE_POOL = "modules/compute/gke-node-pool"
CLUSTER = "modules/scheduler/gke-cluster"

Blueprint = dict[str, Any]


def load(path: Path = BLUEPRINT) -> Blueprint:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def modules(bp: Blueprint) -> list[dict[str, Any]]:
    return [m for group in bp["deployment_groups"] for m in group["modules"]]


def resolve(bp: Blueprint, value: Any) -> Any:
    """A setting's value with a whole-value `$(vars.NAME)` replaced by the variable's value."""
    if isinstance(value, str):
        match = re.fullmatch(r"\$\(vars\.(\w+)\)", value)
        if match:
            return bp["vars"][match.group(1)]
    return value


def setting(bp: Blueprint, module: dict[str, Any], name: str) -> Any:
    return resolve(bp, module.get("settings", {}).get(name))


def by_id(bp: Blueprint, module_id: str) -> dict[str, Any]:
    return next(m for m in modules(bp) if m["id"] == module_id)


def the_module(bp: Blueprint, source: str) -> dict[str, Any]:
    (found,) = [m for m in modules(bp) if m["source"] == source]
    return found


# --- the toolkit's modules and settings -----------------------------------------------------


def toolkit_problems(bp: Blueprint) -> list[str]:
    problems = []
    ids = [m["id"] for m in modules(bp)]
    if len(ids) != len(set(ids)):
        problems.append(f"module ids repeat: {ids}")
    for m in modules(bp):
        known = TOOLKIT_MODULES.get(m["source"])
        if known is None:
            problems.append(f"{m['id']}: source {m['source']!r} is not a module read")
            continue
        unknown = sorted(set(m.get("settings", {})) - known)
        if unknown:
            problems.append(f"{m['id']}: {unknown} not variables of {m['source']}")
        problems += [
            f"{m['id']}: uses unknown module {u!r}" for u in m.get("use", []) if u not in ids
        ]
    return problems


# --- the TPU pools: the operator's table and the guide's gcloud commands ---------------------


def tpu_pools(bp: Blueprint) -> list[dict[str, Any]]:
    """One entry per node pool the blueprint creates (num_slices pools per module)."""
    pools = []
    for m in modules(bp):
        if m["source"] != NODE_POOL:
            continue
        machine = setting(bp, m, "machine_type")
        family, _, _ = machine.partition("-")
        chips = re.search(r"-(\d+)t$", machine)
        pool = {
            "id": m["id"],
            "machine": machine,
            "accelerator": TPU_FAMILIES.get(family),
            "chips_per_host": int(chips.group(1)) if chips else None,
            "topology": (setting(bp, m, "placement_policy") or {}).get("tpu_topology"),
            "nodes": setting(bp, m, "static_node_count"),
            "spot": bool(setting(bp, m, "spot")),
        }
        pools += [pool] * int(setting(bp, m, "num_slices") or 1)
    return pools


def tpu_problems(bp: Blueprint) -> list[str]:
    problems = []
    for p in tpu_pools(bp):
        if p["accelerator"] is None or p["chips_per_host"] is None:
            problems.append(f"{p['id']}: {p['machine']!r} is not a TPU machine type")
            continue
        why = check_tpu(p["accelerator"], p["topology"], p["chips_per_host"])
        if why:
            problems.append(f"{p['id']}: {why}")
            continue
        want = hosts(p["accelerator"], p["topology"], p["chips_per_host"])
        if p["nodes"] != want:
            problems.append(f"{p['id']}: static_node_count {p['nodes']}, a unit runs {want} pods")
    return problems


GCLOUD_POOL = re.compile(
    r"--machine-type=(?P<machine>\S+) --tpu-topology=(?P<topology>\S+) --num-nodes=(?P<nodes>\d+)"
    r"(?P<spot> --spot)?"
)


def guide_pools() -> list[tuple[str, str, int, bool]]:
    """The TPU pools the guide's section 1 creates: `for i in 0 1` loops create two."""
    section = GUIDE.read_text().split("## 1. ")[1].split("\n## ")[0]
    pools = []
    for command in re.split(r"\n(?=gcloud |for )", section):
        copies = len(m.group(1).split()) if (m := re.match(r"for \w+ in ([\w ]+);", command)) else 1
        for g in GCLOUD_POOL.finditer(command.replace("\\\n", " ").replace("  ", " ")):
            pool = (g["machine"], g["topology"], int(g["nodes"]), bool(g["spot"]))
            pools += [pool] * copies
    return pools


def as_guide(bp: Blueprint) -> list[tuple[str, str, int, bool]]:
    return [(p["machine"], p["topology"], p["nodes"], p["spot"]) for p in tpu_pools(bp)]


# --- Kueue ----------------------------------------------------------------------------------


def kueue_objects(bp: Blueprint) -> list[dict[str, Any]]:
    """The template's documents with its variables filled in as the toolkit would (quotas: 1)."""
    values = the_module(bp, "modules/management/kubectl-apply")["settings"]["kueue"]
    filled = {k: resolve(bp, v) for k, v in values["config_template_vars"].items()}
    text = re.sub(
        r"\$\{(\w+)\}",
        lambda m: str(filled[m.group(1)]) if "quota" not in m.group(1) else "1",
        KUEUE_TEMPLATE.read_text(),
    )
    return [d for d in yaml.safe_load_all(text) if d]


def kueue_problems(bp: Blueprint) -> list[str]:
    problems = []
    objs = kueue_objects(bp)
    flavors = {
        o["metadata"]["name"]: o["spec"]["nodeLabels"]
        for o in objs
        if o["kind"] == "ResourceFlavor"
    }
    shapes = {(p["accelerator"], p["topology"]) for p in tpu_pools(bp)}
    selected = {
        (
            labels["cloud.google.com/gke-tpu-accelerator"],
            labels["cloud.google.com/gke-tpu-topology"],
        )
        for labels in flavors.values()
    }
    if selected != shapes:
        problems.append(f"flavors select {sorted(selected)}, the pools are {sorted(shapes)}")
    (queue,) = [o for o in objs if o["kind"] == "ClusterQueue"]
    for group in queue["spec"]["resourceGroups"]:
        problems += [
            f"ClusterQueue names unknown flavor {f['name']}"
            for f in group["flavors"]
            if f["name"] not in flavors
        ]
    (local,) = [o for o in objs if o["kind"] == "LocalQueue"]
    if local["spec"]["clusterQueue"] != queue["metadata"]["name"]:
        problems.append("the LocalQueue points at another ClusterQueue")
    if local["metadata"]["namespace"] != guide_variable("NS"):
        problems.append(f"LocalQueue in {local['metadata']['namespace']}, not docs/gke.md's $NS")
    wanted = load(KUEUE_EXAMPLE)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    if local["metadata"]["name"] != wanted:
        problems.append(f"LocalQueue {local['metadata']['name']}, the example queues on {wanted}")
    return problems


# --- names the guide uses -------------------------------------------------------------------


def guide_variable(name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", GUIDE.read_text())
    assert match, name
    return match.group(1)


def naming_problems(bp: Blueprint) -> list[str]:
    problems = []
    guide = GUIDE.read_text()
    cluster = the_module(bp, CLUSTER)
    expected = {
        "deployment_name (the cluster)": (bp["vars"]["deployment_name"], guide_variable("CLUSTER")),
        "namespace": (setting(bp, cluster, "namespace"), guide_variable("NS")),
    }
    account = setting(bp, cluster, "k8s_service_account_name")
    if f"kubectl create serviceaccount {account} -n $NS" not in guide:
        problems.append(f"the guide creates no ServiceAccount {account}")
    if f"serviceAccountName: {account}" not in guide:
        problems.append(f"the guide's run does not use ServiceAccount {account}")
    for what, (ours, theirs) in expected.items():
        if ours != theirs:
            problems.append(f"{what}: blueprint {ours!r}, docs/gke.md {theirs!r}")
    if setting(bp, cluster, "configure_workload_identity_sa") is not True:
        problems.append("the ServiceAccount is not bound through Workload Identity")
    mounts_bucket = "gcsfuse.csi.storage.gke.io" in GCSFUSE_EXAMPLE.read_text()
    if mounts_bucket and setting(bp, cluster, "enable_gcsfuse_csi") is not True:
        problems.append("examples/gke-tpu-v6e.yaml mounts a bucket: enable_gcsfuse_csi")
    system = setting(bp, cluster, "system_node_pool_name")
    toolkit = re.split(r"\n##+ ", guide.split("### Cluster Toolkit")[1])[0]
    if f"cloud.google.com/gke-nodepool: {system}" not in toolkit:
        problems.append(
            f"the guide's Cluster Toolkit section does not place the syncer on {system}"
        )
    if setting(bp, cluster, "system_node_pool_taints") != []:
        problems.append("the CPU pool keeps the toolkit's taint: the operator would not run there")
    return problems


# --- the tests ------------------------------------------------------------------------------


def test_the_blueprint_uses_toolkit_modules_and_settings_that_exist() -> None:
    bp = load()
    assert bp["blueprint_name"] and bp["deployment_groups"]
    assert toolkit_problems(bp) == []
    assert TOOLKIT_COMMIT in BLUEPRINT.read_text()
    assert TOOLKIT_COMMIT in GUIDE.read_text()


def test_its_tpu_pools_are_slices_the_operator_accepts() -> None:
    bp = load()
    assert len(tpu_pools(bp)) >= 2
    assert len({p["accelerator"] for p in tpu_pools(bp)}) == 2
    assert tpu_problems(bp) == []


def test_its_tpu_pools_are_the_guides() -> None:
    assert len(guide_pools()) == 4
    assert sorted(as_guide(load())) == sorted(guide_pools())


def test_its_kueue_objects_select_its_pools_and_the_examples_queue() -> None:
    assert kueue_problems(load()) == []


def test_its_names_are_the_guides() -> None:
    assert naming_problems(load()) == []


def test_a_broken_blueprint_is_caught() -> None:
    bp = load()
    pools = [m for m in modules(bp) if m["source"] == NODE_POOL]

    wrong_shape = copy.deepcopy(bp)
    by_id(wrong_shape, pools[0]["id"])["settings"]["placement_policy"]["tpu_topology"] = "2x3"
    assert any("topology" in p for p in tpu_problems(wrong_shape))
    assert sorted(as_guide(wrong_shape)) != sorted(guide_pools())

    wrong_nodes = copy.deepcopy(bp)
    by_id(wrong_nodes, pools[-1]["id"])["settings"]["static_node_count"] = 1
    assert any("static_node_count" in p for p in tpu_problems(wrong_nodes))

    typo = copy.deepcopy(bp)
    the_module(typo, CLUSTER)["settings"]["enable_gcs_fuse_csi"] = True
    the_module(typo, "modules/network/vpc")["source"] = "modules/net/vpc"
    assert len(toolkit_problems(typo)) == 2

    renamed = copy.deepcopy(bp)
    renamed["vars"]["namespace"] = "default"
    the_module(renamed, CLUSTER)["settings"]["k8s_service_account_name"] = (
        "workload-identity-k8s-sa"
    )
    assert len(naming_problems(renamed)) == 3
    assert any("LocalQueue in default" in p for p in kueue_problems(renamed))
