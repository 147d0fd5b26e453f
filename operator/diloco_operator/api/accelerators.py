"""Known GKE TPU accelerators: which topologies exist and how many chips sit on one host.

GKE labels TPU nodes with `cloud.google.com/gke-tpu-accelerator` and
`cloud.google.com/gke-tpu-topology`; a slice of topology AxB(xC) has A*B(*C) chips spread over
hosts with `chipsPerHost` chips each. A learner unit is one slice, so its Job runs one pod per host.

Sources, with what stays unverified, are in docs/gke.md section 9. In short: 3D slices (v4, v5p,
TPU7x) are built from 4-chip hosts, so hosts = chips / 4 (v5p: the hosts column of
cloud.google.com/tpu/docs/v5p; TPU7x: "All TPU7x slices use full-host, 4-chip VMs",
docs.cloud.google.com/tpu/docs/tpu7x). Their shapes are the four sub-cube ones plus any AxBxC,
A<=B<=C, of whole 4x4x4 cubes up to the generation's largest slice: the rule of Google's GKE
cluster tool (AI-Hypercomputer/xpk, generate_tpu_topologies), capped at the documented slice
limits (v4: its 4096-chip pod; v5p: 16x16x24 = 96 cubes; TPU7x: 9216 chips).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_TAINT_KEY = "google.com/tpu"
# GKE labels Spot VM nodes with it; Spot node pools may also carry it as a NoSchedule taint.
SPOT_LABEL = "cloud.google.com/gke-spot"

# A cube is 4x4x4 chips; cube-built dimensions are multiples of 4, at most 256 (xpk's bound).
CUBE_EDGE = 4
MAX_DIMENSION = 256


@dataclass(frozen=True)
class Accelerator:
    name: str
    # Shapes named one by one: every 2D shape; the 3D shapes smaller than a cube.
    topologies: tuple[str, ...]
    # Host sizes of the node pools: 4-chip hosts for multi-host slices; the 2D generations also
    # have an 8-chip single host for exactly 8-chip slices. 1x1 slices are single-chip hosts.
    chips_per_host: tuple[int, ...]
    # 3D only: besides `topologies`, every AxBxC with A<=B<=C, each a multiple of 4 (<= 256),
    # of at most this many 4x4x4 cubes. 0: no such shapes (the 2D generations).
    max_cubes: int = 0


_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_SUB_CUBE = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("tpu-v6e-slice", _2D, (4, 8)),
        Accelerator("tpu-v5-lite-podslice", _2D, (4, 8)),
        Accelerator("tpu-v5p-slice", _SUB_CUBE, (4,), max_cubes=96),
        Accelerator("tpu-v4-podslice", _SUB_CUBE, (4,), max_cubes=64),
        Accelerator("tpu7x", _SUB_CUBE, (4,), max_cubes=144),
    )
}

_CUBE_SHAPE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)x([1-9][0-9]*)")


def cube_dims(topology: str, max_cubes: int) -> tuple[int, int, int] | None:
    """The dimensions of a cube-built 3D shape within `max_cubes` cubes, else None."""
    match = _CUBE_SHAPE.fullmatch(topology)
    if match is None:
        return None
    a, b, c = (int(d) for d in match.groups())
    edges_ok = all(d % CUBE_EDGE == 0 and d <= MAX_DIMENSION for d in (a, b, c))
    if not (edges_ok and a <= b <= c):
        return None
    cubes = (a // CUBE_EDGE) * (b // CUBE_EDGE) * (c // CUBE_EDGE)
    return (a, b, c) if cubes <= max_cubes else None


def is_topology(accelerator: str, topology: str) -> bool:
    acc = ACCELERATORS[accelerator]
    return topology in acc.topologies or cube_dims(topology, acc.max_cubes) is not None


def describe_topologies(accelerator: str) -> str:
    acc = ACCELERATORS[accelerator]
    listed = ", ".join(acc.topologies)
    if not acc.max_cubes:
        return listed
    return (
        f"{listed}, or AxBxC with A<=B<=C, each a multiple of {CUBE_EDGE} up to "
        f"{MAX_DIMENSION}, of at most {acc.max_cubes} 4x4x4 cubes "
        f"({acc.max_cubes * CUBE_EDGE**3} chips)"
    )


def topology_chips(topology: str) -> int:
    """Chips in a slice: the product of the topology's dimensions ('2x2x1' -> 4)."""
    return math.prod(int(d) for d in topology.split("x"))


def allowed_chips_per_host(accelerator: str, topology: str) -> tuple[int, ...]:
    """Host sizes a slice can be built from; the first is the default."""
    chips = topology_chips(topology)
    if chips == 1:
        return (1,)
    sizes = ACCELERATORS[accelerator].chips_per_host
    return tuple(c for c in sizes if c == 4 or c == chips) if chips % 4 == 0 else (chips,)


def default_chips_per_host(accelerator: str, topology: str) -> int:
    return allowed_chips_per_host(accelerator, topology)[0]


def check_tpu(accelerator: str, topology: str, chips_per_host: int | None) -> str | None:
    """None when the combination exists, else a message that names the offending field."""
    if accelerator not in ACCELERATORS:
        return f"accelerator: unknown {accelerator!r}; known: {', '.join(sorted(ACCELERATORS))}"
    if not is_topology(accelerator, topology):
        return (
            f"topology: {topology!r} is not a topology of {accelerator}; "
            f"allowed: {describe_topologies(accelerator)}"
        )
    allowed = allowed_chips_per_host(accelerator, topology)
    if chips_per_host is not None and chips_per_host not in allowed:
        return (
            f"chipsPerHost: {chips_per_host} does not fit {accelerator} {topology} "
            f"(allowed: {', '.join(map(str, allowed))})"
        )
    return None


def hosts(accelerator: str, topology: str, chips_per_host: int | None) -> int:
    """Hosts (pods) in one slice."""
    per_host = chips_per_host or default_chips_per_host(accelerator, topology)
    return max(1, topology_chips(topology) // per_host)
