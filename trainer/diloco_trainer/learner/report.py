"""What a learner tells the outside while it trains: heartbeats through its sync link (leader
only), a progress line every `log_every` steps, the leader's Prometheus metrics, and one hint
when installs drop a large share of its steps."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax

from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner.fragment_sync import FragmentBook
from diloco_trainer.learner.metrics import LearnerMetrics, start_learner_metrics
from diloco_trainer.learner.sync_link import Progress, SyncLink
from diloco_trainer.learner.syncer_api import SyncerApi
from diloco_trainer.learner.train import ScheduleClock
from diloco_trainer.workload.check import Workload

if TYPE_CHECKING:
    from diloco_trainer.learner.options import LearnerOptions

log = logging.getLogger(__name__)

# Between the shares where `install: rebase` made no difference (12%; the demo at 12-18%) and
# where it trained 1-2.5% better (17% and more, narrow models): past it, rebase is worth trying,
# not a sure win (docs/design.md, "Installs: replace or rebase").
REBASE_HINT_SHARE = 0.15
HINT_AFTER_PERIODS = 4  # the share is noisy until each fragment has gone out a few times


@dataclass
class Reporter:
    opts: LearnerOptions
    client: SyncerApi
    link: SyncLink | None
    metrics: LearnerMetrics | None
    progress: Progress
    clock: ScheduleClock
    tokens_per_step: int
    hint_after: int  # steps
    window_start: float = field(default_factory=time.monotonic)
    window_steps: int = 0
    hinted: bool = False

    @classmethod
    def starting(
        cls,
        cfg: TrainingConfig,
        opts: LearnerOptions,
        client: SyncerApi,
        versions: list[int],
        leader: bool,
        workload: Workload | None,
        clock: ScheduleClock,
    ) -> Reporter:
        """`workload`: the run's; None (a test without one): the built-in workload's count."""
        progress = Progress()
        link = SyncLink(client, versions, cfg.heartbeat_seconds, progress) if leader else None
        if link is not None:
            link.start()
        metrics = None
        if link is not None and opts.metrics_port > 0:
            flops = workload.flops_per_token if workload is not None else None
            metrics = start_learner_metrics(
                flops,
                opts.name,
                opts.group,
                opts.metrics_port,
                jax.devices()[0].device_kind,
                jax.device_count(),
                os.environ,
            )
        hint_after = HINT_AFTER_PERIODS * cfg.inner_steps
        tokens = workload.tokens_per_step if workload is not None else cfg.tokens_per_step
        return cls(opts, client, link, metrics, progress, clock, tokens, hint_after)

    def step(
        self, step: int, loss: jax.Array, metrics: Any, done: bool, frags: FragmentBook
    ) -> None:
        self.window_steps += 1
        progress, tokens_per_step = self.progress, self.tokens_per_step
        progress.step, progress.tokens, progress.loss = step, step * tokens_per_step, loss
        if step % self.opts.log_every != 0 and not done:
            return
        elapsed = time.monotonic() - self.window_start
        progress.tokens_per_sec = self.window_steps * tokens_per_step / max(elapsed, 1e-9)
        self.window_start, self.window_steps = time.monotonic(), 0
        overwritten = frags.counters.overwritten_share(step)
        self.log_progress(step, frags.versions, overwritten)
        if not self.hinted and step >= self.hint_after and rebase_worth_trying(overwritten, frags):
            self.hinted = True
            log.warning(
                "event=install_hint unit=%s step=%d overwritten_share=%.3f: installs dropped "
                "this share of the unit's steps before a push sent them; `install: rebase` keeps "
                "them (docs/design.md, Installs: replace or rebase)",
                self.opts.name,
                step,
                overwritten,
            )
        if metrics:  # the model's own (float() waits for the step: only on logged steps)
            log.info(
                "event=model_metrics unit=%s step=%d %s",
                self.opts.name,
                step,
                " ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items())),
            )
        if self.metrics is not None and self.link is not None:
            self.metrics.progress(
                float(loss),
                progress.tokens_per_sec,
                self.link.stats,
                self.client.bytes_sent,
                self.client.bytes_received,
                overwritten,
            )

    def log_progress(self, step: int, versions: list[int], overwritten: float) -> None:
        """step/tokens: this attempt's (what heartbeats report); schedule_step: the unit's step
        in its LR schedule (earlier attempts included, never behind the run: `ScheduleClock`);
        lr: the LR of the last step; overwritten: the share of its fragment-steps so far that
        installs replaced before a push carried them; pushes: the pushes the syncer has
        accepted from this attempt (what tells a partitioned learner from a working one)."""
        progress, clock = self.progress, self.clock
        loss = float(progress.loss) if progress.loss is not None else float("nan")
        log.info(
            "event=progress unit=%s step=%d schedule_step=%d lr=%.3g tokens=%d loss=%.4f "
            "tokens_per_sec=%.0f versions=%s pushes=%d pending_pushes=%d overwritten_share=%.3f",
            self.opts.name,
            step,
            clock.position(step),
            clock.learning_rate(step),
            progress.tokens,
            loss,
            progress.tokens_per_sec,
            ",".join(map(str, versions)),
            self.link.stats["pushes"] if self.link is not None else 0,
            self.link.pending_pushes() if self.link is not None else 0,
            overwritten,
        )


def rebase_worth_trying(overwritten: float, frags: FragmentBook) -> bool:
    """Whether this learner, under replace, drops enough steps at installs for `install: rebase`
    to be worth a try."""
    return not frags.rebase and overwritten > REBASE_HINT_SHARE
