"""Bytes per token against loss on the parity model, towards 1000x fewer bytes than
data-parallel at a loss within 2% of it: the parity section's decoupled run with a longer period H
and int4 both ways, or a shorter one with int2 both ways and error feedback on the pushes, its
traffic counted by the learners themselves. The int2 setting on the narrower model where the
product's parity holds is the section `bytes_loss_narrow` (bench/bytes/bytes_loss_narrow.py),
which shares this module's settings and bookkeeping.

Each decoupled run is real (a `diloco-syncer` and M `diloco-learner` processes, 4,000 steps per
learner, alone on the machine) and changes only H and the compression of the parity section's
run; its loss is read against data-parallel at the same seed and tokens, and its bytes from the
learners' exit lines (every request body sent; every response body received after each
attempt's join). Synchronous DiLoCo with the same H and compression runs beside each, so a loss
that moves can be split into DiLoCo's own cost of the setting and what decoupling adds. The
in-process runs are deterministic and go two at a time after the decoupled ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from diloco_trainer.config import TrainingConfig

from bench.bytes.communication import bytes_per_param, dp_bytes_per_token, n_params
from bench.lib.common import BenchContext, Section, log, md_table, two_at_a_time
from bench.lib.plots import axes, save_ratio_plot
from bench.lib.training import M, Outcome, data_parallel, decoupled, parity_config, sync_diloco

BLOCK = 128  # the product's default quantization block
TARGET = 1.02  # loss / data-parallel at which the 1000x fewer bytes must hold


@dataclass(frozen=True)
class Setting:
    h: int
    push: str
    downlink: str
    feedback: bool = False  # error feedback on pushes (the downlink always has it)

    @property
    def label(self) -> str:
        return f"{self.push}{'+EF' if self.feedback else ''} / {self.downlink}"

    @property
    def name(self) -> str:
        return f"H={self.h} {self.label}"


# int4 crosses 1000x at H >= 67 (8H / b >= 1000, b = 0.5 + 4/128 bytes per parameter); int2 at
# H >= 36 (b = 0.25 + 4/128), which it can only afford with error feedback on the pushes. int4
# both ways at the parity row's H=30 cost nothing measurable (docs/design.md, "Downlink"), so
# the float32 parity run stands for H=30.
SETTINGS = [Setting(70, "int4", "int4"), Setting(40, "int2", "int2", feedback=True)]


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


def per_token(out: Outcome) -> tuple[float, float]:
    assert out.traffic is not None
    return out.traffic.sent / out.traffic.tokens, out.traffic.received / out.traffic.tokens


def times_fewer(out: Outcome, dp_bytes: float) -> tuple[float, float]:
    """How many times fewer bytes per token than data-parallel it sent and received."""
    sent, received = per_token(out)
    return dp_bytes / sent, dp_bytes / received


def _row(out: Outcome, dp: Outcome, setting: Setting, dp_bytes: float) -> tuple:
    analytic = 8 * setting.h / bytes_per_param(setting.push, BLOCK)
    sent = received = "-"  # in-process synchronous DiLoCo: nothing crossed a network
    if out.traffic is not None:
        sent, received = (
            f"{b:.2f} B (**{x:,.0f}x**)"
            for b, x in zip(per_token(out), times_fewer(out, dp_bytes), strict=True)
        )
    return (
        out.name,
        setting.h,
        setting.label,
        f"{out.loss:.4f}",
        f"{out.loss / dp.loss:.3f}",
        f"{analytic:,.0f}x",
        sent,
        received,
        out.note,
    )


def decoupled_run(cfg: TrainingConfig, steps: int, name: str, what: str) -> Outcome:
    out = decoupled(cfg, steps, name)
    log(f"{what}: {out.loss:.4f} {out.traffic} ({out.seconds:.0f}s) {out.note}")
    return out


def sync_job(cfg: TrainingConfig, steps: int, setting: Setting, name: str) -> partial[Outcome]:
    return partial(
        sync_diloco, cfg, steps, scheme=setting.push, downlink=setting.downlink, name=name
    )


def in_process(section: str, jobs: dict[tuple[str, object], partial[Outcome]]) -> dict:
    """The deterministic in-process runs, two at a time; keys are (kind, what it is of)."""

    def done(key: tuple[str, object], out: Outcome) -> None:
        of = key[1].name if isinstance(key[1], Setting) else key[1]
        log(f"{section} {key[0]} {of}: {out.loss:.4f} ({out.seconds:.0f}s)")

    return two_at_a_time(jobs, done)  # type: ignore[arg-type]


# (data-parallel bytes / the run's lower of sent and received, loss ratio)
Point = tuple[float, float]


def point(out: Outcome, dp: Outcome, dp_bytes: float) -> Point:
    return min(times_fewer(out, dp_bytes)), out.loss / dp.loss


def meets(times: float, ratio: float) -> bool:
    return ratio <= TARGET and times >= 1000


def plot(series: list[tuple[list[Point], str, str, str]], path: Path, title: str) -> Path:
    """Each series is (points, colour, marker, label); the target's two lines drawn across."""
    fig, ax = axes((6, 4))
    for points, color, marker, label in series:
        ax.scatter(
            [x for x, _ in points], [y for _, y in points], c=color, marker=marker, label=label
        )
    ax.axhline(TARGET, color="tab:red", linestyle=":", label=f"loss target {TARGET}")
    ax.axvline(1000, color="tab:red", linestyle="-.", label="1000x fewer bytes")
    return save_ratio_plot(
        fig, ax, path, "data-parallel bytes per token / the run's (lower of sent, received)", title
    )


def run(ctx: BenchContext) -> Section:
    steps = 300 if ctx.quick else 4000
    base = parity_config(steps, 30)  # the parity section's: one reference run serves both
    wide = {s: compressed(parity_config(steps, s.h), s) for s in SETTINGS}
    # The decoupled runs first, alone on the machine.
    runs = {
        s: decoupled_run(cfg, steps, f"decoupled DiLoCo, H={s.h}", f"bytes_loss {s.name}")
        for s, cfg in wide.items()
    }
    jobs: dict[tuple[str, object], partial[Outcome]] = {
        ("data-parallel", "dModel 128"): partial(data_parallel, base, steps)
    }
    for s, cfg in wide.items():
        jobs["synchronous", s] = sync_job(cfg, steps, s, f"synchronous DiLoCo, H={s.h}")
    done = in_process("bytes_loss", jobs)
    dp = done["data-parallel", "dModel 128"]
    dp_bytes = dp_bytes_per_token(n_params(base.model), base.tokens_per_step)
    rows = []
    for s in SETTINGS:
        rows += [_row(runs[s], dp, s, dp_bytes), _row(done["synchronous", s], dp, s, dp_bytes)]
    meeting = [s.name for s in SETTINGS if meets(*point(runs[s], dp, dp_bytes))]
    png = plot(
        [
            ([point(runs[s], dp, dp_bytes)], color, marker, s.name)
            for s, color, marker in zip(SETTINGS, ("tab:blue", "tab:orange"), "s^", strict=True)
        ],
        ctx.plot_path("bytes_loss.png"),
        f"Decoupled DiLoCo, M={M}, dModel 128: bytes against loss",
    )
    return Section(
        name="bytes_loss",
        title="Bytes per token against loss",
        body=_body(ctx, base, steps, dp, dp_bytes, rows, meeting, png),
        command=ctx.command,
        config=f"tiny preset, M={M}, S={steps}, settings "
        + ", ".join(s.name for s in SETTINGS)
        + f", seed {base.seed}",
        quick=ctx.quick,
    )


def _body(
    ctx: BenchContext,
    base: TrainingConfig,
    steps: int,
    dp: Outcome,
    dp_bytes: float,
    rows: list[tuple],
    meeting: list[str],
    png: Path,
) -> str:
    table = md_table(
        [
            "run",
            "H",
            "push / downlink",
            "eval loss",
            "/ data-parallel",
            "analytic DP / sent",
            "sent per token (DP / it)",
            "received per token (DP / it)",
            "note",
        ],
        rows,
    )
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
alone (single runs spread by 1-2%, docs/bench/parity.md). The int2 setting on the narrower
model, over three seeds: the section bytes_loss_narrow.

![bytes against loss]({ctx.link(png)})
"""
