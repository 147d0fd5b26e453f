"""Bytes per token against loss (issue 21, item 3): the parity section's decoupled run with a
longer period H and int4 both ways, or a shorter one with int2 both ways and error feedback on
the pushes, its traffic counted by the learners themselves; then the int2 setting where the
product's parity holds (dModel 64, `install: rebase`) over three seeds, two runs each.

Each decoupled run is real (a `diloco-syncer` and M `diloco-learner` processes, 4,000 steps per
learner, alone on the machine) and changes only H, the compression (and there the width and the
install) of the parity section's run; its loss is read against data-parallel at the same seed,
width and tokens, and its bytes from the learners' exit lines (every request body sent; every
response body received after each attempt's join). Synchronous DiLoCo with the same H and
compression runs beside each, so a loss that moves can be split into DiLoCo's own cost of the
setting and what decoupling adds. The in-process runs are deterministic and go two at a time
after the decoupled ones.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from diloco_trainer.config import TrainingConfig

from bench.comm_bench import bytes_per_param, dp_bytes_per_token, n_params
from bench.common import (
    BenchContext,
    Section,
    interval_text,
    log,
    md_table,
    save_ratio_plot,
    two_at_a_time,
)
from bench.install_bench import with_install
from bench.parity_bench import (
    SEEDS,
    M,
    Outcome,
    data_parallel,
    decoupled,
    parity_config,
    sync_diloco,
)
from bench.parity_trend import Variant

BLOCK = 128  # the product's default quantization block
TARGET = 1.02  # loss / data-parallel at which the 1000x must hold (issue 21)


@dataclass(frozen=True)
class Setting:
    h: int
    push: str
    downlink: str
    feedback: bool = False  # error feedback on pushes (the downlink always has it)

    @property
    def label(self) -> str:
        return f"{self.push}{'+EF' if self.feedback else ''} / {self.downlink}"


# int4 crosses 1000x at H >= 67 (8H / b >= 1000, b = 0.5 + 4/128 bytes per parameter); int2 at
# H >= 36 (b = 0.25 + 4/128), which it can only afford with error feedback on the pushes. int4
# both ways at the parity row's H=30 cost nothing measurable (docs/design.md, "Downlink"), so
# the float32 parity run stands for H=30.
SETTINGS = [Setting(70, "int4", "int4"), Setting(40, "int2", "int2", feedback=True)]
# The narrower model: the width where the product reaches data-parallel in float32 with
# `install: rebase` (docs/bench/install.md), at the int2 setting.
NARROW = SETTINGS[1]
NARROW_WIDTH = 64
REPEATS = 2  # decoupled runs per seed there; single runs spread by 1-2%


def compressed(cfg: TrainingConfig, setting: Setting) -> TrainingConfig:
    compression = {
        "scheme": setting.push,
        "downlink": setting.downlink,
        "blockSize": BLOCK,
        "errorFeedback": setting.feedback,
    }
    return TrainingConfig.model_validate(
        {**cfg.model_dump(by_alias=True), "compression": compression}
    )


def narrow_config(seed: int, steps: int) -> TrainingConfig:
    variant = Variant(f"dModel {NARROW_WIDTH}", steps=steps, d_model=NARROW_WIDTH, seed=seed)
    return with_install(compressed(variant.config(NARROW.h), NARROW), "rebase")


def _per_token(out: Outcome) -> tuple[float, float]:
    assert out.traffic is not None
    return out.traffic.sent / out.traffic.tokens, out.traffic.received / out.traffic.tokens


def _times(out: Outcome, dp_bytes: float) -> tuple[float, float]:
    """How many times fewer bytes per token than data-parallel it sent and received."""
    sent, received = _per_token(out)
    return dp_bytes / sent, dp_bytes / received


def _row(out: Outcome, dp: Outcome, setting: Setting, dp_bytes: float) -> tuple:
    analytic = 8 * setting.h / bytes_per_param(setting.push, BLOCK)
    sent = received = "-"  # in-process synchronous DiLoCo: nothing crossed a network
    if out.traffic is not None:
        sent, received = (
            f"{b:.2f} B (**{x:,.0f}x**)"
            for b, x in zip(_per_token(out), _times(out, dp_bytes), strict=True)
        )
    return (
        out.name, setting.h, setting.label, f"{out.loss:.4f}", f"{out.loss / dp.loss:.3f}",
        f"{analytic:,.0f}x", sent, received, out.note,
    )  # fmt: skip


@dataclass(frozen=True)
class NarrowSeed:
    """The narrower model's runs at one seed."""

    seed: int
    dp: Outcome
    sync: Outcome
    runs: list[Outcome]  # decoupled, rebase
    dp_bytes: float

    @property
    def ratios(self) -> list[float]:
        return [r.loss / self.dp.loss for r in self.runs]

    @property
    def lowest_times(self) -> float:
        return min(x for r in self.runs for x in _times(r, self.dp_bytes))

    def row(self) -> tuple:
        decoupled_cells = "; ".join(
            f"{r.loss / self.dp.loss:.3f} ({s:,.0f}x, {x:,.0f}x)"
            for r in self.runs
            for s, x in [_times(r, self.dp_bytes)]
        )
        return (
            self.seed, f"{self.dp.loss:.4f}", decoupled_cells,
            f"**{statistics.fmean(self.ratios):.3f}**", f"{self.sync.loss / self.dp.loss:.3f}",
        )  # fmt: skip


def _decoupled(cfg: TrainingConfig, steps: int, name: str, what: str) -> Outcome:
    out = decoupled(cfg, steps, name)
    log(f"bytes_loss {what}: {out.loss:.4f} {out.traffic} ({out.seconds:.0f}s) {out.note}")
    return out


def _sync(cfg: TrainingConfig, steps: int, setting: Setting, name: str) -> partial[Outcome]:
    return partial(
        sync_diloco, cfg, steps, scheme=setting.push, downlink=setting.downlink, name=name
    )


def _label(of: object) -> str:
    if isinstance(of, Setting):
        return f"H={of.h} {of.label}"
    if isinstance(of, int):  # a seed of the narrower model
        return f"dModel {NARROW_WIDTH} seed {of}"
    return str(of)


def _in_process(jobs: dict[tuple[str, object], partial[Outcome]]) -> dict:
    def done(key: tuple[str, object], out: Outcome) -> None:
        log(f"bytes_loss {key[0]} {_label(key[1])}: {out.loss:.4f} ({out.seconds:.0f}s)")

    return two_at_a_time(jobs, done)  # type: ignore[arg-type]


Point = tuple[
    float, float
]  # (data-parallel bytes / the run's lower of sent and received, loss ratio)


def plot(wide: list[Point], narrow: list[Point], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    narrow_label = f"dModel {NARROW_WIDTH}, rebase, H={NARROW.h} {NARROW.label} (each run)"
    for points, color, marker, label in (
        (wide, "tab:blue", "s", "dModel 128, seed 0 (each setting)"),
        (narrow, "tab:green", "o", narrow_label),
    ):
        ax.scatter(
            [x for x, _ in points], [y for _, y in points], c=color, marker=marker, label=label
        )
    ax.axhline(TARGET, color="tab:red", linestyle=":", label=f"loss target {TARGET}")
    ax.axvline(1000, color="tab:red", linestyle="-.", label="1000x fewer bytes")
    return save_ratio_plot(
        fig,
        ax,
        path,
        "data-parallel bytes per token / the run's (lower of sent, received)",
        f"Decoupled DiLoCo, M={M}: bytes against loss",
    )


def _point(out: Outcome, dp: Outcome, dp_bytes: float) -> Point:
    return min(_times(out, dp_bytes)), out.loss / dp.loss


def run(ctx: BenchContext) -> Section:
    steps = 300 if ctx.quick else 4000
    seeds, repeats = ((0, 1), 1) if ctx.quick else (SEEDS, REPEATS)
    base = parity_config(steps, 30)  # the parity section's: one reference run serves both
    wide = {s: compressed(parity_config(steps, s.h), s) for s in SETTINGS}
    narrow = {seed: narrow_config(seed, steps) for seed in seeds}
    # The decoupled runs first, alone on the machine.
    wide_runs = {
        s: _decoupled(cfg, steps, f"decoupled DiLoCo, H={s.h}", f"H={s.h} {s.label}")
        for s, cfg in wide.items()
    }
    narrow_runs = {
        seed: [
            _decoupled(cfg, steps, "decoupled DiLoCo, rebase", f"dModel {NARROW_WIDTH} seed {seed}")
            for _ in range(repeats)
        ]
        for seed, cfg in narrow.items()
    }
    jobs: dict[tuple[str, object], partial[Outcome]] = {
        ("data-parallel", "dModel 128"): partial(data_parallel, base, steps)
    }
    for s, cfg in wide.items():
        jobs["synchronous", s] = _sync(cfg, steps, s, f"synchronous DiLoCo, H={s.h}")
    for seed, cfg in narrow.items():
        jobs["data-parallel", seed] = partial(data_parallel, cfg, steps)
        jobs["synchronous", seed] = _sync(cfg, steps, NARROW, "synchronous DiLoCo")
    done = _in_process(jobs)
    dp, dp_bytes = (
        done["data-parallel", "dModel 128"],
        dp_bytes_per_token(n_params(base.model), base.tokens_per_step),
    )
    rows = []
    for s in SETTINGS:
        rows += [_row(wide_runs[s], dp, s, dp_bytes), _row(done["synchronous", s], dp, s, dp_bytes)]
    meeting = [
        f"H={s.h} {s.label}" for s in SETTINGS if _meets(*_point(wide_runs[s], dp, dp_bytes))
    ]
    narrow_seeds = [
        NarrowSeed(seed, done["data-parallel", seed], done["synchronous", seed], narrow_runs[seed],
                   dp_bytes_per_token(n_params(cfg.model), cfg.tokens_per_step))
        for seed, cfg in narrow.items()
    ]  # fmt: skip
    png = plot(
        [_point(wide_runs[s], dp, dp_bytes) for s in SETTINGS],
        [_point(r, ns.dp, ns.dp_bytes) for ns in narrow_seeds for r in ns.runs],
        ctx.plot_path("bytes_loss.png"),
    )
    body = _body(ctx, base, steps, dp, dp_bytes, rows, meeting, narrow_seeds, png)
    return Section(
        name="bytes_loss",
        title="Bytes per token against loss",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M={M}, S={steps}, settings "
        + ", ".join(f"H={s.h} {s.label}" for s in SETTINGS)
        + f", seed {base.seed}; dModel {NARROW_WIDTH} rebase H={NARROW.h} {NARROW.label} at seeds "
        + ", ".join(str(s) for s in seeds)
        + f", {repeats} runs each",
        quick=ctx.quick,
    )


def _meets(times: float, ratio: float) -> bool:
    return ratio <= TARGET and times >= 1000


def _body(
    ctx: BenchContext,
    base: TrainingConfig,
    steps: int,
    dp: Outcome,
    dp_bytes: float,
    rows: list[tuple],
    meeting: list[str],
    narrow: list[NarrowSeed],
    png: Path,
) -> str:
    table = md_table(
        ["run", "H", "push / downlink", "eval loss", "/ data-parallel", "analytic DP / sent",
         "sent per token (DP / it)", "received per token (DP / it)", "note"],
        rows,
    )  # fmt: skip
    narrow_table = md_table(
        ["seed", "data-parallel", "decoupled, rebase: / data-parallel (DP / sent, DP / received)",
         "seed mean", "synchronous DiLoCo, same compression"],
        [ns.row() for ns in narrow],
    )  # fmt: skip
    means = [statistics.fmean(ns.ratios) for ns in narrow]
    mean, lowest = statistics.fmean(means), min(ns.lowest_times for ns in narrow)
    sync_mean = statistics.fmean(ns.sync.loss / ns.dp.loss for ns in narrow)
    verdict = "met" if _meets(lowest, mean) else "NOT met"
    return f"""
The parity section's run (M={M}, batch {base.data.batch_size} x seqLen {base.model.context} per
learner, {steps} steps each, phase-locked, outer {base.outer_optimizer.lr}/{base.outer_optimizer.momentum},
seed {base.seed}) with one change per row: the period H and the quantization (block {BLOCK}) of
the pushes (int4, or int2 with error feedback: each push adds what quantization dropped from the
learner's last push of the fragment) and of the downlink (each new version sent as a quantized
step from the previous one, always with error feedback). Data-parallel at the same seed and tokens: {dp.loss:.4f}; it sends and
receives {dp_bytes:,.0f} bytes per token per worker (a ring all-reduce of float32 gradients every
step, 2 x N x 4 bytes over one worker's {base.tokens_per_step} tokens). Bytes per token: summed
over the learners' exit lines, sent = every request body, received = every response body after
the join's one full pull of the parameters. Analytic = 8H / b, b = {bytes_per_param("int4", BLOCK):.3f}
bytes per parameter for int4 and {bytes_per_param("int2", BLOCK):.3f} for int2 (docs/bench/communication.md). The float32 run at H=30 is the parity
section's (docs/bench/parity.md).

{table}

On the parity model a single run {"meets" if meeting else "does not meet"} the target
(>= 1000x fewer bytes per token than data-parallel, sent and received, at a loss <= {TARGET} of
it){": " + ", ".join(meeting) if meeting else ""}; one run per row at one seed decides nothing
alone (single runs spread by 1-2%, docs/bench/parity.md).

**The narrower model.** At dModel {NARROW_WIDTH} the product reaches data-parallel in float32 with
`install: rebase` (docs/bench/install.md). The H={NARROW.h} {NARROW.label} setting, rebase, at
seeds {", ".join(str(ns.seed) for ns in narrow)} ({len(narrow[0].runs)} decoupled run(s) per seed), read against
data-parallel at its own seed and width ({narrow[0].dp_bytes:,.0f} bytes per token per worker):

{narrow_table}

Mean of the seed means **{mean:.3f}** of data-parallel (95% interval over seeds
{interval_text(means)}; synchronous DiLoCo with the same compression {sync_mean:.3f}), every run
at **>= {lowest:,.0f}x** fewer bytes per token, sent and received: the target is **{verdict}**
at dModel {NARROW_WIDTH} on the mean.

![bytes against loss]({png.relative_to(ctx.out_dir.parent).as_posix()})
"""
