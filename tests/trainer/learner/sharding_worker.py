"""One learner unit's SPMD training, run as a script by test_sharding.py (XLA_FLAGS set by the
test fakes several CPU devices; with a process count > 1 it joins the others by jax.distributed).

    python sharding_worker.py OUT MODE[+INSTALL] STEPS [PROCESS PROCESSES PORT]

Trains the built-in GPT from seed 3 through the learner's own step program (`build_step_program`,
`StepProgram.place`, `init_opt_state`), pushes and installs fragments through `FragmentBook`, and
writes (process 0) an .npz with the losses, the final parameters and where each started (its
initial value, or the value installed into it), the bytes each local device holds, the pushed
fragment and what the install did.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import jax
import numpy as np

OUT, STEPS = sys.argv[1], int(sys.argv[3])
MODE, _, INSTALL = sys.argv[2].partition("+")  # e.g. fsdp+rebase; the install defaults to replace
PROCESS, PROCESSES, PORT = (int(a) for a in sys.argv[4:7]) if len(sys.argv) > 4 else (0, 1, 0)
if PROCESSES > 1:
    jax.distributed.initialize(f"127.0.0.1:{PORT}", PROCESSES, PROCESS)

from diloco_trainer.config import TrainingConfig  # noqa: E402
from diloco_trainer.data.corpus import train_batches  # noqa: E402
from diloco_trainer.fragments import pack_fragments  # noqa: E402
from diloco_trainer.learner.distributed import StepSignal  # noqa: E402
from diloco_trainer.learner.fragment_sync import FragmentBook  # noqa: E402
from diloco_trainer.learner.loop import build_step_program, schedule_clock  # noqa: E402
from diloco_trainer.learner.sharding import bytes_per_device, fragment_to_host  # noqa: E402
from diloco_trainer.learner.sync_link import Arrival, host_copy  # noqa: E402
from diloco_trainer.learner.train import (  # noqa: E402
    ResumableScheduleState,
    init_opt_state,
    shard_batch,
    step_key,
)
from diloco_trainer.models.gpt import init_params, param_shapes  # noqa: E402

MIN_SHARD_BYTES = 4096
FLOOR = 500  # the run's schedule step the leader hears of at the install


def _is_schedule(node: Any) -> bool:
    return isinstance(node, ResumableScheduleState)


class RecordingLink:
    """The two calls FragmentBook makes on the leader's sync link, kept in memory: pushes are
    recorded, and `arrivals` are handed over on the next drain."""

    def __init__(self) -> None:
        self.complete = threading.Event()
        self.superseded = threading.Event()
        self.pushes: list[Any] = []
        self.arrivals: list[Any] = []

    def enqueue_push(self, push: Any) -> None:
        self.pushes.append(push)

    def drain(self) -> list[Any]:
        out, self.arrivals = self.arrivals, []
        return out

    def settled(self, fragment: int, base: Any) -> Any:
        return base


def main() -> None:
    cfg = TrainingConfig.model_validate(
        {
            "totalSteps": 1000,
            "seed": 3,
            "innerSteps": STEPS,
            "fragments": 2,
            "data": {"batchSize": 8, "maxBytes": 262144},
            "model": {"dModel": 64, "nLayers": 2, "nHeads": 4, "seqLen": 32},
            "innerOptimizer": {"lr": 3e-3, "warmupSteps": 2},
            "sharding": {"mode": MODE, "minShardBytes": MIN_SHARD_BYTES},
            "install": INSTALL or "replace",
        }
    )
    program = build_step_program(cfg, 1)
    mesh = program.mesh
    host = init_params(cfg.model, cfg.seed)
    params = program.place(host)
    state = init_opt_state(program.optimizer, params, mesh)
    shapes = param_shapes(cfg.model)
    layout = pack_fragments(shapes, cfg.fragments)
    start = {p: {n: host[n] for n in names} for p, names in enumerate(layout)}
    book = FragmentBook.starting(cfg, layout, shapes, [0] * len(layout), start)
    link = RecordingLink() if PROCESS == 0 else None
    rows = cfg.data.batch_size // PROCESSES
    batches = train_batches(cfg, unit=0, num_units=1)  # the global batch, the same everywhere
    losses, held = [], bytes_per_device(params, state)
    for step in range(1, STEPS + 1):
        local = next(batches)[PROCESS * rows : (PROCESS + 1) * rows]
        params, state, loss, _ = program.train_step(
            params, state, shard_batch(local, mesh), step_key(cfg.seed, len(losses))
        )
        book.push_due(step, params, link, cfg.tokens_per_step)
        losses.append(float(loss))

    # Install: a new global version of fragment 1 arrives (on the leader; broadcast to all).
    name = layout[1][0]
    before = params[name].sharding
    arrived = {n: np.full(shapes[n], 0.5, np.float32) for n in layout[1]}
    # What the install must leave: the arrived value, plus under rebase the steps made since
    # the fragment's last push (the whole value now minus the pushed base, on the host).
    expected = arrived[name]
    if book.rebase:
        now = fragment_to_host(params, [name])[name]  # a collective: on every host
        base = book.base[1][name]  # the leader's is what it pushed; only its file is kept
        expected = expected + (now - (base if isinstance(base, np.ndarray) else host_copy(base)))
    if link is not None:
        link.arrivals.append(Arrival(1, 7, arrived))
    # The leader's step signal reaches every process, and every process moves its LR schedule
    # to the floor it carries.
    signal = book.install_arrivals(STEPS, params, link, StepSignal(False, FLOOR * (PROCESS == 0)))
    assert signal == StepSignal(False, FLOOR), signal
    state = schedule_clock(cfg, 1, 0, mesh).keep_up(STEPS, signal.schedule_floor, state)
    installed = params[name]
    install_ok = installed.sharding == before
    installed_value = fragment_to_host(params, [name])[name]
    params, state, after_install, _ = program.train_step(
        params,
        state,
        shard_batch(next(batches)[PROCESS * rows : (PROCESS + 1) * rows], mesh),
        step_key(cfg.seed, STEPS),
    )
    schedule = [
        np.asarray(leaf.addressable_data(0))
        for node in jax.tree_util.tree_leaves(state, is_leaf=_is_schedule)
        if _is_schedule(node)
        for leaf in node
    ]
    final = fragment_to_host(params, list(shapes))
    held_after = bytes_per_device(params, state)
    if PROCESS != 0:
        return
    assert link is not None
    pushed = {f"pushed.{n}": host_copy(a) for n, a in link.pushes[0].theta.items()}
    pushed_replicated = all(a.sharding.is_fully_replicated for a in link.pushes[0].theta.values())
    np.savez(
        OUT,
        losses=np.array(losses),
        devices=jax.device_count(),
        held=np.array([max(held[d.id], held_after[d.id]) for d in jax.local_devices()]),
        initial_bytes=sum(a.nbytes for a in host.values()),
        scalar_state_bytes=sum(a.nbytes for a in jax.tree_util.tree_leaves(state) if a.ndim == 0),
        small_param_bytes=sum(a.nbytes for a in host.values() if a.nbytes < MIN_SHARD_BYTES),
        pushed_fragment=link.pushes[0].fragment,
        pushed_step=link.pushes[0].step,
        pushed_replicated=pushed_replicated,
        install_ok=install_ok,
        installed_value_ok=bool(np.allclose(installed_value, expected, atol=1e-6)),
        rebased_moved=bool(not np.array_equal(expected, arrived[name])),
        installed_version=book.versions[1],
        after_install=float(after_install),
        schedule_state=np.array(schedule),
        sharded_leaves=sum(not a.sharding.is_fully_replicated for a in params.values()),
        **pushed,
        **{f"param.{n}": v for n, v in final.items()},
        **{f"init.{n}": v for n, v in host.items()},
        **{f"origin.{n}": arrived.get(n, host[n]) for n in final},
    )


if __name__ == "__main__":
    main()
    if PROCESSES > 1:
        jax.distributed.shutdown()
