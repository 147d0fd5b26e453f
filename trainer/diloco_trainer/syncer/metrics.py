"""Prometheus metrics of one syncer (own registry, so several syncers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SyncerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pushes = Counter(
            "diloco_syncer_pushes_total",
            "Fragment pushes by result and reason",
            ["result", "reason"],
            registry=r,
        )
        self.merges = Counter(
            "diloco_syncer_merges_total", "Merges by fragment", ["fragment"], registry=r
        )
        self.merge_seconds = Histogram(
            "diloco_syncer_merge_seconds",
            "Merge + outer step latency",
            buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.merge_contributions = Histogram(
            "diloco_syncer_merge_contributions",
            "Contributions per merge",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.grace_seconds = Histogram(
            "diloco_syncer_grace_seconds",
            "Grace window chosen after the quorum",
            buckets=(0, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
            registry=r,
        )
        self.quant_error = Histogram(
            "diloco_syncer_push_quant_error",
            "Relative L2 quantization error of accepted pushes, as measured by the sender",
            buckets=(0.001, 0.003, 0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.5),
            registry=r,
        )
        self.bytes_in = Counter(
            "diloco_syncer_bytes_received_total", "Request body bytes", registry=r
        )
        self.bytes_out = Counter(
            "diloco_syncer_bytes_sent_total", "Tensor payload bytes sent", registry=r
        )
        self.downloads = Counter(
            "diloco_syncer_fragment_downloads_total",
            "Fragment versions sent, as a quantized step from the previous one or as values",
            ["kind"],
            registry=r,
        )
        self.outer_step = Gauge("diloco_syncer_outer_step", "Sum of fragment versions", registry=r)
        self.fragment_version = Gauge(
            "diloco_syncer_fragment_version", "Version per fragment", ["fragment"], registry=r
        )
        self.learners_online = Gauge(
            "diloco_syncer_learners_online", "Learners with a recent heartbeat", registry=r
        )
        self.eval_loss = Gauge(
            "diloco_syncer_eval_loss", "Held-out loss of the global parameters", registry=r
        )
        # A counter, so rate() is the fleet's tokens/s. The run's cumulative count (restored from
        # checkpoints) is in /v1/status and the DilocoRun's status.tokens; this process counts
        # from what it restored, so a syncer restart reads as a counter reset, not a jump.
        self.tokens = Counter(
            "diloco_syncer_tokens_total",
            "Tokens the learners reported training since this syncer process started",
            registry=r,
        )
        self._tokens_seen: int | None = None
        self.checkpoints = Counter(
            "diloco_syncer_checkpoints_total", "Checkpoints written", registry=r
        )
        self._add_fault_metrics(r)
        self._add_trust_metrics(r)

    def _add_fault_metrics(self, r: CollectorRegistry) -> None:
        """What the syncer failed to do: merges, checkpoint writes, and checkpoints it had to
        roll back past (docs/protocol.md, "Readiness")."""
        self.failing = Gauge(
            "diloco_syncer_failing",
            "1 while the syncer cannot merge (what=merge) or write checkpoints "
            "(what=checkpoint); /readyz answers 503 meanwhile",
            ["what"],
            registry=r,
        )
        self.failures = Counter(
            "diloco_syncer_failures_total",
            "Failed merges (what=merge) and checkpoint writes (what=checkpoint)",
            ["what"],
            registry=r,
        )
        self.merges_refused = Counter(
            "diloco_syncer_merges_refused_total",
            "Merges whose result was not finite, refused (their contributions dropped)",
            ["fragment"],
            registry=r,
        )
        self.checkpoints_skipped = Gauge(
            "diloco_syncer_checkpoints_skipped",
            "Newer checkpoints found unusable at startup (the syncer rolled back past them)",
            registry=r,
        )
        for what in ("merge", "checkpoint"):
            self.failing.labels(what).set(0)

    def _add_trust_metrics(self, r: CollectorRegistry) -> None:
        """What the gate refused, limited or screened out (gate.py) and the malformed requests
        the server answered 400."""
        self.claims_refused = Counter(
            "diloco_syncer_claims_refused_total",
            "Heartbeats and pushes refused for counters no honest unit could send, by rule",
            ["kind", "rule"],
            registry=r,
        )
        self.screened = Counter(
            "diloco_syncer_screened_pushes_total",
            "Merged pushes by what the robust screens did with them (kept, clipped, dropped)",
            ["action"],
            registry=r,
        )
        self.quarantined = Counter(
            "diloco_syncer_quarantined_total",
            "Unit attempts quarantined for outlying pushes",
            registry=r,
        )
        self.limited = Counter(
            "diloco_syncer_requests_limited_total",
            "Unit requests answered 429 (rate limited), by kind",
            ["kind"],
            registry=r,
        )
        self.credential_refusals = Counter(
            "diloco_syncer_credential_refusals_total",
            "Requests with a join credential refused, by reason (credential_expired, ...)",
            ["reason"],
            registry=r,
        )
        self.malformed = Counter(
            "diloco_syncer_malformed_requests_total",
            "Connections whose request was not HTTP (answered 400), by reason",
            ["reason"],
            registry=r,
        )

    def count_tokens(self, run_total: int) -> None:
        """Advance the tokens counter to the run's total (the first call sets the baseline)."""
        if self._tokens_seen is not None and run_total > self._tokens_seen:
            self.tokens.inc(run_total - self._tokens_seen)
        if self._tokens_seen is None or run_total > self._tokens_seen:
            self._tokens_seen = run_total
