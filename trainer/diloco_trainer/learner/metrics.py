"""Prometheus metrics of one learner unit, served on `/metrics` by its leader process.

Only the unit's leader (JAX process 0) serves them: its counters are the unit's (tokens are the
unit's global batch, pushes and bytes go through its link), so a multi-host unit is counted once.
Counters only move forward from what this process saw; a restarted attempt starts them at 0,
which Prometheus reads as a counter reset. MFU is the model's training FLOPs per token (6N plus
the attention matmuls, as bench/speed/gpu.py counts them) times tokens/s, over the peak bf16
FLOP/s of the unit's chips: known for the TPU generations in PEAK_BF16_FLOPS, else given by
DILOCO_PEAK_FLOPS (per device); without either the MFU gauge stays absent.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from diloco_trainer.models.gpt import flops_per_token, param_count

__all__ = ["flops_per_token", "param_count", "start_learner_metrics"]

PEAK_FLOPS_ENV = "DILOCO_PEAK_FLOPS"
# Dense bf16 peak FLOP/s per chip by JAX device_kind fragment, from the Cloud TPU pages:
# v6e 918 T (cloud.google.com/tpu/docs/v6e), v5p 459 T (.../v5p), v5e 197 T (.../v5e),
# v4 275 T (.../v4). Checked in this order ("TPU v5 lite" before "TPU v5").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("TPU v6", 918e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),
    ("TPU v4", 275e12),
)


def peak_flops_per_device(device_kind: str, env: Mapping[str, str]) -> float | None:
    """DILOCO_PEAK_FLOPS when set (ValueError naming it when not a positive number), else the
    table's value for this device kind, else None."""
    raw = env.get(PEAK_FLOPS_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{PEAK_FLOPS_ENV}: not a number: {raw!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{PEAK_FLOPS_ENV}: must be > 0, got {raw!r}")
        return value
    return next((peak for fragment, peak in PEAK_BF16_FLOPS if fragment in device_kind), None)


class LearnerMetrics:
    """The learner's metrics in their own registry (several learners may share a process in
    tests). `unit` and `group` label every series."""

    def __init__(
        self, unit: str, group: str, flops_per_token: float, peak_flops: float | None
    ) -> None:
        self.registry = CollectorRegistry()
        r, names = self.registry, ["unit", "group"]
        self._labels = (unit, group)
        self._flops_per_token = flops_per_token
        self._peak = peak_flops
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self.steps = Counter("diloco_learner_steps_total", "Inner steps trained", names, registry=r)
        self.tokens = Counter("diloco_learner_tokens_total", "Tokens trained", names, registry=r)
        self.step_seconds = Histogram(
            "diloco_learner_step_seconds",
            "Wall time of one inner step (after the first, compiling one)",
            names,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "diloco_learner_tokens_per_second",
            "Tokens/s over the last log window",
            names,
            registry=r,
        )
        self.loss = Gauge("diloco_learner_loss", "Training loss at the last log", names, registry=r)
        self.mfu = Gauge(
            "diloco_learner_mfu_ratio",
            "Model FLOPs utilisation over the last log window (0..1)",
            names,
            registry=r,
        )
        self.overwritten = Gauge(
            "diloco_learner_overwritten_ratio",
            "Share of this attempt's fragment-steps that installs replaced before a push sent "
            "them (install: replace; rebase keeps them)",
            names,
            registry=r,
        )
        self.pushes = Counter(
            "diloco_learner_pushes_total",
            "Fragment pushes by result (accepted, rejected, failed: retried later)",
            [*names, "result"],
            registry=r,
        )
        self.bytes_sent = Counter(
            "diloco_learner_bytes_sent_total", "Request bytes sent to the syncer", names, registry=r
        )
        self.bytes_received = Counter(
            "diloco_learner_bytes_received_total",
            "Response bytes received from the syncer",
            names,
            registry=r,
        )
        for result in ("accepted", "rejected", "failed"):
            self.pushes.labels(*self._labels, result)

    def serve(self, port: int) -> None:
        """Serve /metrics on `port` (all interfaces) from a daemon thread."""
        start_http_server(port, registry=self.registry)

    def step(self, seconds: float | None, tokens: int) -> None:
        """One inner step done; `seconds`: its wall time (None for the first, compiling one)."""
        self.steps.labels(*self._labels).inc()
        self.tokens.labels(*self._labels).inc(tokens)
        if seconds is not None:
            self.step_seconds.labels(*self._labels).observe(seconds)

    def progress(
        self,
        loss: float,
        tokens_per_second: float,
        pushes: Mapping[str, int],
        bytes_sent: int,
        bytes_received: int,
        overwritten_share: float,
    ) -> None:
        """At each progress log: the loss, throughput (and MFU), the share of steps installs
        dropped, and the link's running totals (`pushes`: SyncLink.stats; bytes: the client's),
        of which the counters add the growth."""
        if math.isfinite(loss):
            self.loss.labels(*self._labels).set(loss)
        self.overwritten.labels(*self._labels).set(overwritten_share)
        self.tokens_per_second.labels(*self._labels).set(tokens_per_second)
        if self._peak:
            achieved = tokens_per_second * self._flops_per_token
            self.mfu.labels(*self._labels).set(achieved / self._peak)
        with self._lock:
            self._advance(self.pushes.labels(*self._labels, "accepted"), "p", pushes.get("pushes"))
            self._advance(
                self.pushes.labels(*self._labels, "rejected"), "r", pushes.get("rejected")
            )
            self._advance(
                self.pushes.labels(*self._labels, "failed"), "f", pushes.get("push_failures")
            )
            self._advance(self.bytes_sent.labels(*self._labels), "bs", bytes_sent)
            self._advance(self.bytes_received.labels(*self._labels), "br", bytes_received)

    def _advance(self, counter: Counter, key: str, total: float | None) -> None:
        if total is None:
            return
        grown = total - self._seen.get(key, 0.0)
        if grown > 0:
            counter.inc(grown)
            self._seen[key] = total


def start_learner_metrics(
    flops_per_token: float | None,
    unit: str,
    group: str,
    port: int,
    device_kind: str,
    devices: int,
    env: Mapping[str, str],
) -> LearnerMetrics:
    """Metrics for a unit whose `devices` chips are of `device_kind`, served on `port`. MFU
    needs the model's `flops_per_token` (None: no MFU gauge)."""
    per_device = peak_flops_per_device(device_kind, env)
    peak = per_device * devices if per_device is not None and flops_per_token else None
    metrics = LearnerMetrics(unit, group, flops_per_token or 0.0, peak)
    metrics.serve(port)
    return metrics
