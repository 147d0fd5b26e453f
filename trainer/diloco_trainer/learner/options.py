"""What a learner is told to do (LearnerOptions) and what it reports when it stops
(LearnerResult): plain data, shared by the loop, its reporter and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LearnerOptions:
    syncer: str
    token: str
    unit: int
    num_units: int
    unit_name: str = ""
    attempt: int = 0
    group: str = "default"
    slowdown: float = 1.0  # >= 1: sleep (slowdown-1) * step time after each step
    log_every: int = 50
    max_steps: int | None = None  # stop after this many local steps (benchmarks, debugging)
    metrics_port: int = 0  # > 0: the leader serves Prometheus /metrics here (learner_metrics.py)
    ca_file: str | None = None  # CA bundle an https syncer is verified against (None: system)
    join: str = ""  # a join credential's public part: a unit of an away cluster sends it

    @property
    def name(self) -> str:
        return self.unit_name or f"unit-{self.unit}"


@dataclass
class LearnerResult:
    steps: int
    tokens: int
    seconds: float
    complete: bool
    final_loss: float | None
    versions: list[int]
    link_stats: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_joined: int = 0  # of bytes_received: the join and the full pull of the parameters
    # Where the loop's time went after its first (compiling) step: "train" = dispatching the step
    # and waiting for the previous one; "slowdown" = the --slowdown sleep; "other" = the rest of
    # the loop (installing arrivals, queueing pushes' references, logging). Nothing in the loop
    # waits on other learners or the syncer, so a unit's idle time would show up under "other".
    loop_seconds: dict[str, float] = field(default_factory=dict)
    # Of the learner's steps on each fragment, the share that installs replaced before a push
    # carried them: mostly the steps made while a merge it pushed to was under way.
    overwritten_share: float = 0.0
    superseded: bool = False  # stopped because another process is the unit now (sync_link.py)

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
