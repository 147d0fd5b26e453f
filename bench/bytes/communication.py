"""Communication: bytes sent per token by a learner vs data-parallel all-reduce.

Data-parallel baseline (ring all-reduce of float32 gradients every step): each worker sends
2 (W-1)/W x N x 4 bytes per step, which we round up to 2 x N x 4 (W large), over B x T tokens.
DiLoCo: each fragment goes out once per H inner steps, so the whole model once per H steps:
N x b bytes per H x B x T tokens, b = 4 (none), 1 + 4/block (int8), 0.5 + 4/block (int4).
Ratio = 8 H / b. Measured: a real learner against a real syncer, counting the request bodies
its client actually sent (pushes, heartbeats, joins, polls).
"""

from __future__ import annotations

from diloco_trainer.config import PER_BYTE, SCHEMES, ModelConfig, TrainingConfig
from diloco_trainer.learner.loop import run_learner
from diloco_trainer.models.gpt import param_shapes

from bench.lib.common import BenchContext, Section, fmt_bytes, log, md_table
from bench.lib.live import learner_config, only_learner, syncer


def bytes_per_param(scheme: str, block: int) -> float:
    if scheme == "none":
        return 4.0
    return 1.0 / PER_BYTE[scheme] + 4.0 / block  # packed values and one float32 scale per block


def n_params(model: ModelConfig) -> int:
    total = 0
    for shape in param_shapes(model).values():
        size = 1
        for d in shape:
            size *= d
        total += size
    return total


def dp_bytes_per_token(params: int, tokens_per_step: int) -> float:
    return 2 * params * 4 / tokens_per_step


def diloco_bytes_per_token(params: int, tokens_per_step: int, h: int, b: float) -> float:
    return params * b / (h * tokens_per_step)


def measure(cfg: TrainingConfig, steps: int) -> tuple[int, int, int, float, dict[str, int]]:
    """(bytes sent, bytes received after the join's full pull, tokens, seconds, link stats) of
    one real learner run."""
    with syncer(cfg) as sy:
        r = run_learner(cfg, only_learner(sy.url, log_every=10_000, max_steps=steps))
    return r.bytes_sent, r.bytes_received - r.bytes_joined, r.tokens, r.seconds, r.link_stats


def run(ctx: BenchContext) -> Section:
    block = 128
    analytic_rows = []
    for label, model, batch in (
        ("tiny (this repo's bench model)", ModelConfig(preset="tiny"), 16),
        ("100m preset", ModelConfig(preset="100m"), 16),
    ):
        n = n_params(model)
        tps = batch * model.context
        dp = dp_bytes_per_token(n, tps)
        for h in (24, 30, 50, 100, 500):
            cells = []
            for s in SCHEMES:
                d = diloco_bytes_per_token(n, tps, h, bytes_per_param(s, block))
                cells.append(f"{d:.3g} B ({dp / d:,.0f}x)")
            analytic_rows.append((label, f"{n / 1e6:.2f}M", tps, f"{dp:.3g} B", h, *cells))
    analytic = md_table(
        ["model", "params", "tokens/step", "DP sent/token", "H", *[f"DiLoCo {s}" for s in SCHEMES]],
        analytic_rows,
    )

    h = 30  # the parity section's setting: one H for both targets
    steps = 150 if ctx.quick else 400
    measured_rows = []
    int4_ratio = down_ratio = 0.0
    # (push scheme, downlink scheme): the downlink sends new versions as quantized steps
    for s, down in (("none", "none"), ("int8", "int8"), ("int4", "none"), ("int4", "int4")):
        cfg = learner_config(scheme=s, inner_steps=h)
        cfg = cfg.model_copy(
            update={"compression": cfg.compression.model_copy(update={"downlink": down})}
        )
        n = n_params(cfg.model)
        sent, received, tokens, seconds, stats = measure(cfg, steps)
        dp = dp_bytes_per_token(n, cfg.tokens_per_step)
        per_token = sent / tokens
        ratio = dp / per_token
        if s == "int4":
            int4_ratio = ratio
        received_ratio = dp / (received / tokens)
        if down == "int4":
            down_ratio = received_ratio
        fragment_payload = n * bytes_per_param(s, block) / cfg.fragments
        log(f"comm {s}/{down}: sent {sent} B, received {received} B for {tokens} tokens, {stats}")
        measured_rows.append(
            (
                f"{s} / {down}",
                steps,
                stats.get("pushes", 0),
                fmt_bytes(sent),
                f"{per_token:.3g} B",
                f"**{ratio:,.0f}x**",
                fmt_bytes(received),
                f"{received / tokens:.3g} B",
                f"{received_ratio:,.0f}x",
                f"{dp:.3g} B",
                fmt_bytes(fragment_payload),
                f"{sent / seconds / 1e3:.1f} kB/s",
            )
        )
    measured = md_table(
        [
            "compression (push / downlink)",
            "inner steps",
            "pushes",
            "bytes sent",
            "sent / token",
            "DP / DiLoCo, sent",
            "bytes received after the join",
            "received / token",
            "DP / DiLoCo, received",
            "DP sent (= received) / token",
            "largest burst (one fragment push, tensors)",
            "mean send rate",
        ],
        measured_rows,
    )
    verdict = "met" if int4_ratio >= 400 else "NOT met"
    body = f"""
**Formula.** Data-parallel ring all-reduce sends 2 x N x 4 bytes per worker per step (float32
gradients, reduce-scatter + all-gather, (W-1)/W rounded to 1); a DiLoCo learner sends each of
the P fragments once per H inner steps, N x b bytes per H steps, with b = 4 (none),
1 + 4/{block} (int8), 0.5 + 4/{block} (int4) bytes per parameter (values + one float32 scale per
block of {block}). Ratio DP / DiLoCo = 8H / b: int4 needs H >= 27 for 400x.

Analytic, per learner (or DP worker), bytes sent per token:

{analytic}

**Measured** (one real learner against a real `diloco-syncer` on loopback, tiny model, batch 16,
H={h}, P=4, counting every request body the client sent: pushes, joins, heartbeats, polls;
HTTP headers not counted; bytes received: every response body after the join's one full pull of
the parameters, which a learner pays once per attempt). Its first pushes come before a full
period of H steps, so the measured ratio is a little under the analytic one. A ring all-reduce
receives as much as it sends, so data-parallel's received bytes per token equal its sent bytes.
With a float32 downlink each new fragment version comes back whole (4 bytes per parameter), so
the received side, not the sent side, limits a symmetric link; the quantized downlink
(docs/protocol.md, "Compressed downlink") sends each version as an int4 step from the previous
one.

{measured}

Target: int4 bytes sent per token >= 400x below data-parallel: **{verdict}** (measured
{int4_ratio:,.0f}x at H={h}). With the int4 downlink as well, bytes received per token are
{down_ratio:,.0f}x below data-parallel's; with a float32 downlink the same run receives about as
much as the uncompressed row sends. Peak bytes/s: a push of one fragment is sent as one burst every
H/P steps, so the peak rate is the link speed for "largest burst" bytes; the mean rate above is
bytes sent / wall seconds on this CPU.
"""
    return Section(
        name="communication",
        title="Communication: bytes per token vs data-parallel",
        body=body,
        command=ctx.command,
        config=f"tiny preset, batch 16 x seqLen 128, H={h}, P=4, block {block}",
        quick=ctx.quick,
    )
