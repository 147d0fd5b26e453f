"""The CRD's CEL mirror of the TPU table (accelerators.py): known topologies and host sizes.

Named shapes are map lookups; cube-built 3D shapes (`accelerators.cube_dims`) are checked by
arithmetic on the topology's digits, so the CRD does not list hundreds of shapes.
"""

from __future__ import annotations

from diloco_operator.api.accelerators import (
    ACCELERATORS,
    CUBE_EDGE,
    MAX_DIMENSION,
    allowed_chips_per_host,
)


def _cel_list(items: list[str] | list[int]) -> str:
    return "[" + ", ".join(repr(i) if isinstance(i, str) else str(i) for i in items) + "]"


def _cube_shape_rule() -> str:
    """CEL for `accelerators.cube_dims`: AxBxC, A<=B<=C, multiples of 4 up to 256, <= N cubes.

    The schema bounds the topology to 16 characters, so findAll and int() stay cheap."""
    dims = "self.topology.findAll('[0-9]+')"
    a, b, c = (f"int({dims}[{i}])" for i in range(3))
    cubes = ", ".join(f"{n!r}: {acc.max_cubes}" for n, acc in ACCELERATORS.items() if acc.max_cubes)
    return (
        f"self.accelerator in {{{cubes}}} && {dims}.size() == 3 && "
        "!self.topology.matches('(^|x)0') && "
        f"{dims}.all(d, int(d) % {CUBE_EDGE} == 0 && int(d) <= {MAX_DIMENSION}) && "
        f"{a} <= {b} && {b} <= {c} && "
        f"({a} / {CUBE_EDGE}) * ({b} / {CUBE_EDGE}) * ({c} / {CUBE_EDGE}) <= "
        f"{{{cubes}}}[self.accelerator]"
    )


def tpu_rules() -> list[dict[str, str]]:
    topologies = ", ".join(
        f"{name!r}: {_cel_list(list(acc.topologies))}" for name, acc in ACCELERATORS.items()
    )
    hosts = ", ".join(
        f"{name + '/' + topo!r}: {_cel_list(list(allowed_chips_per_host(name, topo)))}"
        for name, acc in ACCELERATORS.items()
        for topo in acc.topologies
    )
    # Every cube-built shape of an accelerator has the same host sizes as its first cube.
    cube_hosts = ", ".join(
        f"{name!r}: {_cel_list(list(allowed_chips_per_host(name, '4x4x4')))}"
        for name, acc in ACCELERATORS.items()
        if acc.max_cubes
    )
    key = "self.accelerator + '/' + self.topology"
    cube_shape = _cube_shape_rule()
    return [
        {
            # An unknown accelerator is already refused by its enum; no second error for it.
            "rule": f"!(self.accelerator in {{{topologies}}}) || "
            f"self.topology in {{{topologies}}}[self.accelerator] || ({cube_shape})",
            "message": "topology: not a known topology of this accelerator",
            "fieldPath": ".topology",
        },
        {
            # Only for a known topology: an unknown one already has the topology error.
            "rule": f"!has(self.chipsPerHost) || (({key}) in {{{hosts}}} ? "
            f"self.chipsPerHost in {{{hosts}}}[{key}] : "
            f"!({cube_shape}) || self.chipsPerHost in {{{cube_hosts}}}[self.accelerator])",
            "message": "chipsPerHost: does not fit this accelerator and topology",
            "fieldPath": ".chipsPerHost",
        },
    ]
