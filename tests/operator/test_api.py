"""API models: accelerator table, replica semantics, clear field-naming errors, status wire form."""

from __future__ import annotations

import pytest
from diloco_operator.api import DilocoRunStatus, parse_manifest, parse_spec
from diloco_operator.api.accelerators import (
    ACCELERATORS,
    allowed_chips_per_host,
    check_tpu,
    cube_dims,
    hosts,
)
from diloco_operator.api.unit_group import UnitGroup

BASE = {"image": "t", "training": {"totalSteps": 10}}


@pytest.mark.parametrize(
    ("accelerator", "topology", "per_host", "expected_hosts"),
    [
        ("tpu-v6e-slice", "2x4", None, 2),  # the e2e pool: 4 chips per host, 2 hosts
        ("tpu-v6e-slice", "2x4", 8, 1),  # the single-host 8-chip machine type
        ("tpu-v6e-slice", "1x1", None, 1),
        ("tpu-v6e-slice", "4x8", None, 8),
        ("tpu-v5p-slice", "2x2x1", None, 1),
        ("tpu-v5p-slice", "2x2x4", None, 4),
        ("tpu-v4-podslice", "2x2x2", None, 2),
        # Larger slices (v5p's documented shapes; hosts column of cloud.google.com/tpu/docs/v5p)
        ("tpu-v5p-slice", "8x8x16", None, 256),
        ("tpu-v5p-slice", "16x16x24", None, 1536),
        ("tpu-v4-podslice", "16x16x16", None, 1024),
        ("tpu-v5-lite-podslice", "2x2", None, 1),
        # Cube-built shapes beyond the named ones (4 chips per host: chips / 4 hosts)
        ("tpu-v5p-slice", "4x4x12", None, 48),
        ("tpu-v4-podslice", "8x8x12", None, 192),
        # Ironwood: 4-chip VMs, 2x2x1 on one host; 2x2x2 on two (GKE's Ironwood NUMA sample)
        ("tpu7x", "2x2x1", None, 1),
        ("tpu7x", "2x2x1", 4, 1),
        ("tpu7x", "2x2x2", None, 2),
        ("tpu7x", "2x4x4", None, 8),
        ("tpu7x", "4x4x4", None, 16),
        ("tpu7x", "8x16x16", None, 512),
        ("tpu7x", "16x24x24", None, 2304),  # 144 cubes = 9216 chips, the whole pod
    ],
)
def test_hosts_per_slice(
    accelerator: str, topology: str, per_host: int | None, expected_hosts: int
) -> None:
    assert check_tpu(accelerator, topology, per_host) is None
    assert hosts(accelerator, topology, per_host) == expected_hosts


def test_every_known_topology_has_a_host_size_dividing_it() -> None:
    for name, acc in ACCELERATORS.items():
        for topology in acc.topologies:
            sizes = allowed_chips_per_host(name, topology)
            assert sizes and hosts(name, topology, None) >= 1, (name, topology)


def test_slices_beyond_a_pod_are_refused_with_the_field_named() -> None:
    problem = check_tpu("tpu-v4-podslice", "16x16x24", None)  # 6144 chips > the 4096 of a v4 pod
    assert problem is not None and problem.startswith("topology:")


@pytest.mark.parametrize(
    ("accelerator", "topology"),
    [
        ("tpu7x", "2x2x3"),  # not cube-built and not a named sub-cube shape
        ("tpu7x", "4x4x6"),
        ("tpu7x", "8x4x4"),  # A <= B <= C, as GKE's topologies are written
        ("tpu7x", "24x24x24"),  # 216 cubes > the 144 of a 9216-chip pod
        ("tpu7x", "4x4x260"),  # a dimension above 256
        ("tpu7x", "04x4x4"),  # no label is written with a leading zero
        ("tpu7x", "1x1x1"),  # every TPU7x slice is built from full 4-chip VMs
        ("tpu7x", "2x4"),  # a 2D topology
        ("tpu-v5p-slice", "16x16x32"),  # 128 cubes > v5p's largest slice, 16x16x24 (96)
        ("tpu-v6e-slice", "4x4x4"),  # 2D generations have no cube-built shapes
    ],
)
def test_wrong_topology_is_refused_naming_the_field(accelerator: str, topology: str) -> None:
    problem = check_tpu(accelerator, topology, None)
    assert problem is not None and problem.startswith("topology:"), problem
    assert repr(topology) in problem and accelerator in problem
    with pytest.raises(ValueError, match=r"topology: '[^']+' is not a topology of"):
        parse_spec({**BASE, "unitGroups": [{"name": "g", "tpu": tpu(accelerator, topology)}]})


def test_tpu7x_host_size_is_four_chips_only() -> None:
    problem = check_tpu("tpu7x", "2x2x2", 8)
    assert problem is not None and problem.startswith("chipsPerHost:"), problem
    assert allowed_chips_per_host("tpu7x", "4x4x8") == (4,)


def test_tpu7x_unit_group_runs_one_pod_per_host() -> None:
    spec = parse_spec({**BASE, "unitGroups": [{"name": "iw", "tpu": tpu("tpu7x", "2x2x4")}]})
    group = spec.unit_groups[0]
    assert group.tpu is not None
    assert (group.hosts, group.tpu.chips_on_each_host) == (4, 4)


def test_cube_dims_reads_only_cube_built_shapes_within_the_cap() -> None:
    assert cube_dims("4x8x12", 6) == (4, 8, 12)
    assert cube_dims("4x8x12", 5) is None  # 6 cubes
    assert cube_dims("2x2x4", 100) is None  # sub-cube shapes are named, not cube-built
    assert cube_dims("4x4", 100) is None


def tpu(accelerator: str, topology: str) -> dict[str, str]:
    return {"accelerator": accelerator, "topology": topology}


def test_spec_defaults_to_one_default_group() -> None:
    spec = parse_spec(BASE)
    assert [g.name for g in spec.unit_groups] == ["default"]
    assert spec.total_units == 1 and spec.unit_groups[0].hosts == 1


def test_replicas_semantics() -> None:
    spec = parse_spec(
        {**BASE, "replicas": 3, "unitGroups": [{"name": "a"}, {"name": "b", "replicas": 2}]}
    )
    assert [spec.group_replicas(i) for i in range(2)] == [3, 2]
    assert spec.total_units == 5
    assert spec.group("b") == UnitGroup(name="b", replicas=2)
    assert spec.group("zz") is None


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"apiVersion": "v1", "kind": "DilocoRun"}, "apiVersion"),
        ({"apiVersion": "diloco.dev/v1alpha1", "kind": "Job"}, "kind"),
        (
            {"apiVersion": "diloco.dev/v1alpha1", "kind": "DilocoRun", "metadata": {}},
            "metadata.name",
        ),
        (
            {"apiVersion": "diloco.dev/v1alpha1", "kind": "DilocoRun", "metadata": {"name": "x"}},
            "spec",
        ),
    ],
)
def test_manifest_envelope_errors_name_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_manifest(doc)


def test_errors_are_one_line_per_problem_without_pydantic_noise() -> None:
    with pytest.raises(ValueError) as info:
        parse_spec({"image": "", "replicas": 0, "training": {"totalSteps": 1, "fragments": 0}})
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert all(line.startswith("spec.") for line in lines)
    assert "Value error" not in str(info.value)


def test_status_wire_form_is_camel_case() -> None:
    wire = DilocoRunStatus(units_online=2, outer_step=5).to_wire()
    assert wire["unitsOnline"] == 2 and wire["outerStep"] == 5 and wire["phase"] == "Pending"
