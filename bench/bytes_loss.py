"""Bytes per token against loss (issue 21, item 3): the parity section's decoupled run with a
longer period H and int4 both ways, or a shorter one with int2 both ways and error feedback on
the pushes, its traffic counted by the learners themselves.

Each row is a real phase-locked run (a `diloco-syncer` and M `diloco-learner` processes, 4,000
steps per learner) that changes only H and the compression of the parity section's run; its loss
is read against data-parallel at the same seed and tokens, and its bytes from the learners' exit
lines (every request body sent; every response body received after each attempt's join).
Synchronous DiLoCo with the same H and compression runs beside each, so a loss that moves can
be split into DiLoCo's own cost of the setting and what decoupling adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_trainer.config import TrainingConfig

from bench.comm_bench import bytes_per_param, dp_bytes_per_token, n_params
from bench.common import BenchContext, Section, log, md_table
from bench.parity_bench import M, Outcome, data_parallel, decoupled, parity_config, sync_diloco

BLOCK = 128  # the product's default quantization block


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


def _row(out: Outcome, dp: Outcome, setting: Setting, dp_bytes: float) -> tuple:
    analytic = 8 * setting.h / bytes_per_param(setting.push, BLOCK)
    sent = received = "-"  # in-process synchronous DiLoCo: nothing crossed a network
    if out.traffic is not None:
        sent, received = (f"{b:.2f} B (**{dp_bytes / b:,.0f}x**)" for b in _per_token(out))
    return (
        out.name, setting.h, setting.label, f"{out.loss:.4f}", f"{out.loss / dp.loss:.3f}",
        f"{analytic:,.0f}x", sent, received, out.note,
    )  # fmt: skip


def _per_token(out: Outcome) -> tuple[float, float]:
    assert out.traffic is not None
    return out.traffic.sent / out.traffic.tokens, out.traffic.received / out.traffic.tokens


def _meets(out: Outcome, dp: Outcome, dp_bytes: float) -> bool:
    return out.loss / dp.loss <= 1.02 and all(dp_bytes / b >= 1000 for b in _per_token(out))


def run(ctx: BenchContext) -> Section:
    steps = 300 if ctx.quick else 4000
    base = parity_config(steps, 30)  # the parity section's: one reference run serves both
    dp = data_parallel(base, steps)
    log(f"bytes_loss data-parallel: {dp.loss:.4f}")
    dp_bytes = dp_bytes_per_token(n_params(base.model), base.tokens_per_step)
    rows, meeting = [], []
    for setting in SETTINGS:
        cfg = compressed(parity_config(steps, setting.h), setting)
        out = decoupled(cfg, steps, f"decoupled DiLoCo, H={setting.h}")
        log(f"bytes_loss {out.name} {setting.label}: {out.loss:.4f} {out.traffic} {out.note}")
        rows.append(_row(out, dp, setting, dp_bytes))
        if _meets(out, dp, dp_bytes):
            meeting.append(f"H={setting.h} {setting.label}")
        # The same config in-process: DiLoCo's own cost of this H and compression.
        sync = sync_diloco(
            cfg, steps, scheme=setting.push, downlink=setting.downlink,
            name=f"synchronous DiLoCo, H={setting.h}",
        )  # fmt: skip
        log(f"bytes_loss {sync.name} {setting.label}: {sync.loss:.4f}")
        rows.append(_row(sync, dp, setting, dp_bytes))
    table = md_table(
        ["run", "H", "push / downlink", "eval loss", "/ data-parallel", "analytic DP / sent",
         "sent per token (DP / it)", "received per token (DP / it)", "note"],
        rows,
    )  # fmt: skip
    body = f"""
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

Target (issue 21): >= 1000x fewer bytes per token than data-parallel, sent and received, at a
loss <= 1.02 of data-parallel: **{"met by " + ", ".join(meeting) if meeting else "NOT met"}**
by a single run. One run per row at one seed: single runs of the parity setting
spread over about 2% (docs/bench/parity.md), so a row decides nothing alone.
"""
    return Section(
        name="bytes_loss",
        title="Bytes per token against loss",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M={M}, S={steps}, settings "
        + ", ".join(f"H={s.h} {s.label}" for s in SETTINGS)
        + f", seed {base.seed}",
        quick=ctx.quick,
    )
