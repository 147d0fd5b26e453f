"""The syncer's blocks of the training schema: the grace window, how a merge combines and
screens its contributions, and how far a unit's counters are believed (re-exported by
config.py, where every user imports them from)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from diloco_trainer.config_base import Strict


class GraceConfig(Strict):
    """How long the syncer waits for stragglers once the quorum is met."""

    mode: Literal["adaptive", "fixed", "none"] = Field(
        "adaptive",
        description="adaptive: bounded by overlap*stepTime minus quorum and sync time (EMA per learner).",
    )
    max_seconds: float = Field(2.0, ge=0, le=3600, description="Upper bound on any grace window.")
    ema: float = Field(0.2, gt=0, le=1, description="EMA factor for per-learner timings.")


class RobustConfig(Strict):
    """How one unit's outlying pushes are kept from steering a merge (syncer/robust.py)."""

    clip_ratio: float | None = Field(
        2.0,
        ge=1.0,
        le=1e6,
        description="Scale a push down to this multiple of the median push norm of its merge "
        "(of the fragment's recent merges when fewer than three take part); null: off.",
    )
    min_cosine: float | None = Field(
        0.05,
        ge=-1.0,
        le=1.0,
        description="Leave out of a merge of three or more a push whose cosine with the "
        "weighted mean direction of the others is below this, when the merge's median "
        "cosine is at least twice this (noise: about 0, a sign-flipped delta: negative); "
        "null: off.",
    )
    quarantine_after: int = Field(
        3,
        ge=0,
        le=1000,
        description="Quarantine an attempt (its pushes refused until the unit restarts) once "
        "this many of its last quarantineWindow merged pushes were outliers (left out, or "
        "longer than twice clipRatio x their merge's median); 0: never.",
    )
    quarantine_window: int = Field(
        6, ge=1, le=1000, description="The merged pushes of one attempt quarantineAfter counts in."
    )


class MergeConfig(Strict):
    """How the syncer combines the contributions of one merge into an outer gradient."""

    method: Literal["rda", "mean"] = Field(
        "rda", description="rda: radial-directional averaging; mean: plain weighted mean."
    )
    token_weighting: bool = Field(True, description="Weight contributions by cTokens^2/cSteps.")
    participation_scaling: bool = Field(
        True,
        description=(
            "Scale each merge's outer gradient by the share of online learners it contains, so"
            " M separate one-learner merges add up to one averaged outer step, not M full ones."
        ),
    )
    max_push_norm: float | None = Field(
        10.0,
        gt=0,
        le=1e6,
        description="Refuse a push whose delta's L2 norm exceeds this multiple of its "
        "fragment's L2 norm (a value of at least 0.01 per element counts as the fragment's "
        "norm); null disables. A finite but huge delta (a diverging learner) would otherwise "
        "be merged into the global model. Measured pushes of the default config stay below "
        "0.6 times their fragment's norm.",
    )
    robust: RobustConfig = Field(default_factory=lambda: RobustConfig())


class TrustConfig(Strict):
    """How far the syncer believes a unit's counters (syncer/trust.py)."""

    max_steps_per_second: float = Field(
        100_000.0,
        gt=0,
        le=1e9,
        description="Refuse a unit's push or heartbeat whose step is beyond what its attempt "
        "could reach at this many steps per second (no training step of any model takes under "
        "10 us: the default catches corrupted and invented counters, never a real unit).",
    )
    max_speed_ratio: float | None = Field(
        None,
        ge=1.0,
        le=1e6,
        description="Also refuse a step beyond this multiple of the other units' median step "
        "rate; null (the default): no such bound. Only for fleets of one speed: a compile at "
        "start or a slowed unit makes the measured rates unreliable, and mixed hardware may "
        "differ by more than any fixed ratio.",
    )
