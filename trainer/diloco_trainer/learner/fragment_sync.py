"""The learner's bookkeeping per fragment between train steps: which fragments are due for a push
(handed to the sender thread), and installing the newer global fragments that arrived (the same on
every host of the unit). `learner.run_learner` calls both once a step.

With FSDP (`sharding.py`) a push first gathers its fragment's leaves to replicated device arrays
(every host at the same step), so the sender reads whole tensors; an install scatters each
arriving tensor back to its leaf's own sharding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np

from diloco_trainer.config import TrainingConfig
from diloco_trainer.fragments import FragmentCounters, PushClock
from diloco_trainer.learner.distributed import StepSignal, exchange_arrivals
from diloco_trainer.learner.sharding import gather_fragment, scatter_leaf
from diloco_trainer.learner.sync_link import PendingPush, SyncLink, host_copy
from diloco_trainer.learner.train import Params


@dataclass
class FragmentBook:
    """The learner's bookkeeping per fragment: the global version it holds, where the next push's
    delta is measured from (the fragment at the last push (device) or install (host), whichever
    came later), the steps and tokens since, and when a push is due.

    An install replaces the fragment with the new global version, and with it the steps made on
    it since the last push (its merge arrives while the learner trains on). With `rebase` those
    steps are kept: the learner's fragment becomes the new version plus its own progress since
    `base`, and since `base` becomes the new version, the next push carries them, counted."""

    layout: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    versions: list[int]
    base: dict[int, Mapping[str, np.ndarray | jax.Array]]
    counters: FragmentCounters
    clock: PushClock
    rebase: bool = False  # `install: rebase`: an install keeps the steps since the last push

    @classmethod
    def starting(
        cls,
        cfg: TrainingConfig,
        layout: list[list[str]],
        shapes: dict[str, tuple[int, ...]],
        versions: list[int],
        fragments: Mapping[int, Mapping[str, np.ndarray]],
    ) -> FragmentBook:
        """At the start: `versions` and `fragments` are what the unit starts from; a fragment
        already merged (version > 0) is one the run is under way on (`PushClock.joined_running`)."""
        clock = PushClock(cfg.inner_steps, len(layout), cfg.phase_lock)
        for p in range(len(layout)):
            if versions[p] > 0:
                clock.joined_running(p)
        base: dict[int, Mapping[str, np.ndarray | jax.Array]] = dict(fragments)
        counters = FragmentCounters(len(layout))
        return cls(layout, shapes, versions, base, counters, clock, cfg.install == "rebase")

    def push_due(
        self, step: int, params: Params, link: SyncLink | None, tokens_per_step: int
    ) -> None:
        """Count the step, then hand each fragment due now to the sender (leader only). Every
        host runs this at every step: a sharded fragment's gather is a collective."""
        self.counters.add_step(tokens_per_step)
        for p in range(len(self.layout)):
            if not self.clock.due(step, p):
                continue
            self.clock.pushed(step, p)
            theta = gather_fragment(params, self.layout[p])
            if link is not None:
                c_steps, c_tokens = self.counters.get(p)
                link.enqueue_push(
                    PendingPush(p, self.versions[p], self.base[p], theta, c_steps, c_tokens, step)
                )
                # The next push of p carries only what comes after this one.
                self.base[p] = theta
            elif self.rebase:
                # A rebase replays each host's shards of p from its own base, so every host
                # keeps what the leader pushed (on the host: no replicated copy on devices).
                self.base[p] = {name: host_copy(leaf) for name, leaf in theta.items()}
            self.counters.reset(p)

    def install_arrivals(
        self, step: int, params: Params, link: SyncLink | None, signal: StepSignal
    ) -> StepSignal:
        """Install the global fragments the pollers received (the same on every host);
        returns the leader's `signal`, its stop also set when the run is complete, as every
        host agrees on it."""
        newest: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        if link is not None:
            if link.complete.is_set() or link.superseded.is_set():
                signal = signal._replace(stop=True)
            for arrival in link.drain():
                newest[arrival.fragment] = (arrival.version, arrival.tensors)
        if link is not None:  # references of sent pushes move to host (device memory back)
            for p in range(len(self.layout)):
                self.base[p] = link.settled(p, self.base[p])
        newest, signal = exchange_arrivals(newest, self.layout, self.shapes, signal)
        for p, (version, tensors) in sorted(newest.items()):
            if version == self.versions[p]:
                continue  # an older one is installed too: the syncer restored from a checkpoint
            for name, value in tensors.items():
                sharding = params[name].sharding
                fresh = scatter_leaf(value, sharding)
                if self.rebase:  # the steps since the last push or install, replayed on top
                    fresh = fresh + (params[name] - scatter_leaf(self.base[p][name], sharding))
                params[name] = fresh
            self.base[p], self.versions[p] = tensors, version
            if not self.rebase:
                self.counters.overwrite(p)
            self.clock.installed(step, p)
        return signal
