"""The training block of a run: one schema for the learner, the syncer, the operator and the CRD.

This module must stay importable without JAX: the operator embeds `TrainingConfig` as
`DilocoRun.spec.training` and generates the CRD's OpenAPI schema from it.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python; both
spellings are accepted when parsing. Unknown fields are errors, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import Field, ValidationError, model_validator

# Re-exported: every schema block and its users import them from here.
from diloco_trainer.config_base import INT64_MAX as INT64_MAX
from diloco_trainer.config_base import MIN_PERIOD_SECONDS as MIN_PERIOD_SECONDS
from diloco_trainer.config_base import Strict as Strict
from diloco_trainer.config_merge import GraceConfig as GraceConfig
from diloco_trainer.config_merge import MergeConfig as MergeConfig
from diloco_trainer.config_merge import RobustConfig as RobustConfig
from diloco_trainer.config_merge import TrustConfig as TrustConfig

ModelPreset = Literal["tiny", "small", "100m"]
# `package.module:attribute` (the attribute may be dotted: `models:Registry.build`).
ENTRYPOINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def _entrypoint(description: str) -> Any:
    return Field(None, pattern=ENTRYPOINT_PATTERN, description=description)


def _entrypoint_args(what: str) -> Any:
    return Field(default_factory=dict, description=f"Keyword arguments for the {what} entrypoint.")


# Decoder-only transformer sizes. Byte-level vocabulary (256) keeps the embedded corpus
# tokenizer-free; `100m` is ~85M parameters at byte vocabulary.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 256, "d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 128},
    "small": {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 8, "seq_len": 256},
    "100m": {"vocab_size": 256, "d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024},
}


class ModelConfig(Strict):
    """The model. Without an entrypoint: the built-in decoder-only transformer, a preset filling
    every size not given explicitly. With one: the user's model (`diloco_trainer.api.Model`), and
    `seqLen` is the built-in model's and data source's tokens per example; a user's model or
    data counts its own (docs/library.md, "Tokens per step")."""

    entrypoint: str | None = _entrypoint(
        "module:attribute of a callable returning the model, called with args; unset: the "
        "built-in transformer."
    )
    args: dict[str, Any] = _entrypoint_args("model")
    preset: ModelPreset = Field("tiny", description="Size preset: tiny, small or 100m.")
    vocab_size: int | None = Field(None, ge=2, le=1 << 20, description="Vocabulary size.")
    d_model: int | None = Field(None, ge=8, le=65536, description="Residual stream width.")
    n_layers: int | None = Field(None, ge=1, le=512, description="Transformer blocks.")
    n_heads: int | None = Field(None, ge=1, le=512, description="Attention heads.")
    seq_len: int | None = Field(None, ge=2, le=1 << 17, description="Context length in tokens.")
    mlp_ratio: int = Field(4, ge=1, le=16, description="MLP hidden width / d_model.")
    init_from: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A safetensors file or orbax checkpoint directory, or a gs:// object or "
        "prefix holding either, with the starting global parameters named by pytree path (as "
        "`diloco export` writes them). Read by "
        "the syncer on a fresh run; a run resuming from its own checkpoint ignores it.",
    )

    @model_validator(mode="after")
    def _fill_from_preset(self) -> ModelConfig:
        for key, value in MODEL_PRESETS[self.preset].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.d_model % self.n_heads:  # type: ignore[operator]
            raise ValueError(
                f"dModel ({self.d_model}) must be divisible by nHeads ({self.n_heads})"
            )
        return self

    # Resolved sizes (never None after validation); typed accessors for callers.
    @property
    def vocab(self) -> int:
        assert self.vocab_size is not None
        return self.vocab_size

    @property
    def width(self) -> int:
        assert self.d_model is not None
        return self.d_model

    @property
    def depth(self) -> int:
        assert self.n_layers is not None
        return self.n_layers

    @property
    def heads(self) -> int:
        assert self.n_heads is not None
        return self.n_heads

    @property
    def context(self) -> int:
        assert self.seq_len is not None
        return self.seq_len


class DataConfig(Strict):
    """Where tokens come from. `stdlib` is the embedded corpus: the Python standard library's own
    sources, byte-tokenized, present on every machine. `memmap` reads pre-tokenized shards."""

    source: Literal["stdlib", "memmap"] = Field(
        "stdlib", description="Built-in token source (when no entrypoint is set)."
    )
    entrypoint: str | None = _entrypoint(
        "module:attribute of a data source (diloco_trainer.api.DataSource), called with args; "
        "unset: the built-in source."
    )
    args: dict[str, Any] = _entrypoint_args("data")
    path: str | None = Field(
        None, description="For source=memmap: a .npy/.bin file or a directory of shards."
    )
    dtype: Literal["uint8", "uint16", "uint32"] = Field(
        "uint16", description="Token dtype of raw .bin memmap shards."
    )
    batch_size: int = Field(
        16, ge=1, le=1 << 16, description="Sequences per inner step per learner."
    )
    eval_fraction: float = Field(
        0.05, gt=0.0, lt=0.5, description="Held-out share of the corpus for evaluation."
    )
    max_bytes: int | None = Field(
        None,
        ge=1 << 16,
        le=INT64_MAX,
        description="Cap on corpus size (stdlib source), for quick runs.",
    )
    shards: int = Field(
        64,
        ge=1,
        le=1 << 20,
        description="Virtual shards of the train split, leased to units one at a time by the "
        "syncer (each read once per epoch); fixed for the life of the run.",
    )

    @model_validator(mode="after")
    def _memmap_needs_path(self) -> DataConfig:
        if self.source == "memmap" and not self.path:
            raise ValueError("data.path is required when data.source is memmap")
        return self


class InnerOptimizerConfig(Strict):
    """AdamW on each learner (optax.adamw), with linear warmup then cosine decay."""

    lr: float = Field(1e-3, gt=0, le=1.0, description="Peak learning rate.")
    b1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay (beta1).")
    b2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay (beta2).")
    weight_decay: float = Field(
        0.1, ge=0, le=10, description="AdamW decoupled weight decay (applied to every leaf)."
    )
    warmup_steps: int = Field(
        50, ge=0, le=INT64_MAX, description="Linear warmup length in inner steps."
    )
    grad_clip: float | None = Field(1.0, gt=0, description="Global-norm clip; null disables.")
    schedule: Literal["constant", "cosine"] = Field("cosine", description="Decay after warmup.")


class OuterOptimizerConfig(Strict):
    """SGD with Nesterov momentum on the syncer, applied to merged outer gradients."""

    lr: float = Field(0.7, gt=0, le=10, description="Outer learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer momentum coefficient.")
    nesterov: bool = Field(True, description="Nesterov momentum; false: heavy-ball momentum.")
    momentum_per: Literal["merge", "round"] = Field(
        "merge",
        description="round: the momentum moves once per round of contributions (their "
        "participation shares add up to 1) and each merge in between is a plain SGD step; "
        "merge: once per merge (plain optax Nesterov). Identical when every merge holds "
        "every learner.",
    )


# How a tensor travels: float32 values, or int8 / int4 / int2 with one scale per block
# (quantize.py); PER_BYTE: values packed into one byte, so a block must be a multiple of it.
Scheme = Literal["none", "int8", "int4", "int2"]
PER_BYTE: dict[str, int] = {"int8": 1, "int4": 2, "int2": 4}
SCHEMES: tuple[Scheme, ...] = get_args(Scheme)


class CompressionConfig(Strict):
    """Quantization of what travels between learners and the syncer (docs/protocol.md)."""

    scheme: Scheme = Field("none", description="Quantization of deltas.")
    block_size: int = Field(128, ge=8, le=1 << 16, description="Values per quantization scale.")
    downlink: Scheme = Field(
        "none",
        description="Quantization of the new global fragment versions the syncer sends: each "
        "goes out as a quantized step from the previous version, with error feedback "
        "(docs/protocol.md, 'Compressed downlink'); none sends float32 values.",
    )

    error_feedback: bool = Field(
        False,
        description="Add what quantization left out of a unit's last push of a fragment to its "
        "next push of that fragment (meant for int2, which loses about a third of each push's "
        "norm). Kept in the learner's memory: a restarted attempt starts with "
        "none owed.",
    )

    @model_validator(mode="after")
    def _blocks_fill_bytes(self) -> CompressionConfig:
        for scheme in (self.scheme, self.downlink):
            per_byte = PER_BYTE.get(scheme, 1)
            if self.block_size % per_byte:
                raise ValueError(
                    f"blockSize: {self.block_size} is not a multiple of {per_byte}; "
                    f"{scheme} packs {per_byte} values per byte"
                )
        return self


class LinkCompression(Strict):
    """A unit group's own compression of its pushes, over the run's `compression`: a group across
    a thin link pushes int2 with error feedback while the home region's push int8. The syncer
    reads each push's scheme from the push itself; what it sends back (the downlink) is one
    publication per version for every group, so the downlink stays the run's."""

    scheme: Scheme | None = Field(None, description="Quantization of this group's deltas.")
    block_size: int | None = Field(
        None, ge=8, le=1 << 16, description="Values per quantization scale."
    )
    error_feedback: bool | None = Field(
        None, description="Carry what quantization left out into the next push (for int2)."
    )

    def over(self, run: CompressionConfig) -> CompressionConfig:
        """The run's compression with this group's fields in its place (validated again)."""
        mine = self.model_dump(exclude_none=True)
        return CompressionConfig.model_validate({**run.model_dump(), **mine})


SERVING_LOCK_FILE = ".serving.lock"  # `diloco-syncer --lock` in a checkpoint folder (on a claim)


class CheckpointConfig(Strict):
    """Periodic syncer checkpoints of the run's global state (resumed after a restart)."""

    path: str = Field(
        "runs/checkpoints",
        description="Directory (PVC mount) or gs://bucket/prefix for syncer checkpoints.",
    )
    every_seconds: float = Field(30.0, ge=MIN_PERIOD_SECONDS, description="Checkpoint period.")
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints to retain.")


class EvalConfig(Strict):
    """Held-out evaluation of the global model, run by the syncer."""

    every_seconds: float | None = Field(
        15.0,
        ge=MIN_PERIOD_SECONDS,
        description="Syncer evaluates the global model this often; null disables.",
    )
    batches: int = Field(8, ge=1, le=10000, description="Held-out batches per evaluation.")


class ShardingConfig(Strict):
    """How a unit lays its parameters and optimizer state over its devices (learner/sharding.py)."""

    mode: Literal["replicated", "fsdp"] = Field(
        "replicated",
        description="replicated: every device holds all parameters and optimizer state; fsdp: "
        "each large leaf is split over the unit's devices (the model's partitionRules, else "
        "its largest axis the device count divides), gathered by XLA where a step needs it.",
    )
    min_shard_bytes: int = Field(
        65536,
        ge=0,
        le=INT64_MAX,
        description="fsdp: a leaf smaller than this stays replicated (its gather would cost "
        "more than the memory it saves); partition rules apply whatever the size.",
    )


class TrainingConfig(Strict):
    """The training block of a DilocoRun (`spec.training`): configures learners and the syncer."""

    model: ModelConfig = Field(default_factory=lambda: ModelConfig())
    data: DataConfig = Field(default_factory=lambda: DataConfig())
    inner_steps: int = Field(
        50, ge=1, le=1_000_000, description="H: inner steps between syncs of a fragment."
    )
    fragments: int = Field(
        4, ge=1, le=4096, description="P: parameter fragments, synced staggered."
    )
    overlap: int = Field(2, ge=0, le=1_000_000, description="tau: inner steps a sync may overlap.")
    phase_lock: bool = Field(
        True,
        description="Restart a fragment's H-step push countdown when a new version of it is "
        "installed, so learners push it together and merges hold several deltas; false: each "
        "fragment every H steps at its own fixed offset.",
    )
    install: Literal["replace", "rebase"] = Field(
        "replace",
        description="How a learner installs a new global version of a fragment. replace: the "
        "steps it made on the fragment since its last push are lost; rebase: they are kept, "
        "added on top of the new version, and sent with its next push.",
    )
    quorum: int = Field(1, ge=1, le=100_000, description="K: minimum contributions before a merge.")
    max_staleness: int = Field(
        8, ge=1, le=1_000_000, description="Reject pushes whose base is this many versions old."
    )
    grace: GraceConfig = Field(default_factory=lambda: GraceConfig())
    merge: MergeConfig = Field(default_factory=lambda: MergeConfig())
    trust: TrustConfig = Field(default_factory=lambda: TrustConfig())
    compression: CompressionConfig = Field(default_factory=lambda: CompressionConfig())
    inner_optimizer: InnerOptimizerConfig = Field(default_factory=lambda: InnerOptimizerConfig())
    outer_optimizer: OuterOptimizerConfig = Field(default_factory=lambda: OuterOptimizerConfig())
    total_steps: int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description="Stop after this many inner steps summed over all learners.",
    )
    total_tokens: int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description="Stop after this many tokens summed over all learners.",
    )
    seed: int = Field(0, ge=0, le=INT64_MAX, description="Seeds initialisation and data order.")
    heartbeat_seconds: float = Field(
        2.0, ge=MIN_PERIOD_SECONDS, le=600, description="Learner heartbeat period."
    )
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig())
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig())
    sharding: ShardingConfig = Field(default_factory=lambda: ShardingConfig())

    @model_validator(mode="after")
    def _has_budget(self) -> TrainingConfig:
        if self.total_steps is None and self.total_tokens is None:
            raise ValueError("set totalSteps or totalTokens: a run needs a budget")
        return self

    def to_wire(self) -> dict[str, Any]:
        """The manifest form, keeping nulls: in a training block null means "off" (gradClip,
        eval.everySeconds), so dropping it would bring the default back on a round trip."""
        return self.model_dump(mode="json", by_alias=True)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one inner step of the built-in model on the built-in source (batchSize x
        seqLen), known without building either. A run's own count comes from the batch it
        trains on (`diloco_trainer.workload.check.tokens_per_step`), which only that batch can
        tell once a model or data entrypoint is set."""
        if self.model.entrypoint is not None or self.data.entrypoint is not None:
            raise ValueError(
                "TrainingConfig.tokens_per_step is the built-in workload's; with a model or data "
                "entrypoint use diloco_trainer.workload.check.tokens_per_step(cfg)"
            )
        return self.data.batch_size * self.model.context


class ConfigError(Exception):
    """A config file that cannot be used; the message names the offending field."""


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the field path in manifest (camelCase) spelling."""
    lines = []
    for problem in err.errors():
        loc = ".".join(str(part) for part in problem["loc"] if part != "__root__")
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "(root)")
        lines.append(f"{where}: {problem['msg']}")
    return "\n".join(lines)


def read_document(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a mapping, with a clear error for anything else."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from exc
    try:
        doc = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return doc


def training_block(doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The training mapping of a document and its field path: a DilocoRun manifest carries it under
    spec.training; a bare training config is the document itself."""
    if doc.get("kind") == "DilocoRun":
        training = (doc.get("spec") or {}).get("training")
        if not isinstance(training, dict):
            raise ConfigError("spec.training: required (a mapping) in a DilocoRun manifest")
        return training, "spec.training"
    return doc, ""


def load_training_config(path: str | Path) -> TrainingConfig:
    """Load a TrainingConfig from a bare config file or from a DilocoRun manifest."""
    raw, prefix = training_block(read_document(path))
    try:
        return TrainingConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, prefix)) from exc
