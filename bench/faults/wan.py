"""One run across an emulated WAN: two "home" units reach the syncer directly, two "away" units
through a toxiproxy link on loopback (bench/lib/toxiproxy.py), as an away cluster's units reach
the home syncer (docs/multi-cluster.md).

Rows, each the same run (the parity section's model, data and seed, one token budget) with
another link: LAN (the proxy without toxics); 1 Gbps + 50 ms RTT; 100 Mbps + 200 ms RTT +
connection resets; the last with the link cut for a while; LAN once more, for the spread between
two runs of one setting. Goodput is the local runtime's (useful learner-seconds /
learner-seconds, from the heartbeats the syncer reports: `compute_goodput`), the loss the parity
section's evaluation of the global parameters at the budget, the bytes what the proxy carried
each way; the syncer's and learners' logs say what became of the away units' pushes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from diloco_operator.local.recorder import Heartbeat, Recorder
from diloco_operator.local.report import compute_goodput
from diloco_trainer.config import TrainingConfig

from bench.bytes.communication import dp_bytes_per_token, n_params
from bench.lib import plots
from bench.lib.common import BenchContext, Section, log, loss_cells, md_table
from bench.lib.live import SyncerProc, exit_fields, learner_process, syncer
from bench.lib.syncer_logs import TIMESTAMP, LogEvent, fields, log_time, syncer_log_events
from bench.lib.toxiproxy import REDRAW_SECONDS, Link, Shape, version, wan_link
from bench.lib.training import global_loss, parity_config

H = 30  # the parity section's period
HOME = ("home-0", "home-1")  # units 0, 1: straight to the syncer
AWAY = ("away-2", "away-3")  # units 2, 3: through the link
UNITS = len(HOME) + len(AWAY)
CUT_AT = 0.25  # the cut starts when the syncer has counted this share of the budget
POLL_SECONDS = 0.5  # the syncer's status, as often as the local runtime looks
REJOIN_TARGET = 10.0  # seconds from the heal to each cut-off unit's next accepted push
# Retries the cut caused: (seconds before the cut, seconds after the heal), the learners'
# backoff being at most 5 s.
CUT_MARGIN = (0.5, 6.0)
# A learner's request that failed even after the client's own retry on a fresh connection.
_RETRY = re.compile("^" + TIMESTAMP + r" .*event=(push_retry|poll_retry|heartbeat_retry)")
# A push the syncer refused (4xx): the learner drops it; the reason follows the status code.
_REFUSED = re.compile(r"event=push_rejected .*?error=HTTP \d+ (\w+)")
# Why the syncer quarantined a unit (the quoted `reason` of its `event=quarantined` line).
_REASON = re.compile(r'reason="([^"]*)"')


@dataclass(frozen=True)
class Row:
    label: str
    shape: Shape
    cut_seconds: float = 0.0  # > 0: the link is cut this long, once


@dataclass
class Outcome:
    """What one run measured; times are seconds since the run started."""

    row: Row
    goodput: float
    per_unit: dict[str, float]  # each unit's goodput
    loss: float
    up: int  # bytes the proxy read from the away units (upstream)
    down: int  # bytes the proxy read from the syncer for them (downstream)
    away_tokens: int
    seconds: float  # first training heartbeat to the budget
    steps_per_sec: float  # one learner's, mean over the units
    connections: int  # TCP connections opened through the link
    failed_requests: int  # the away learners' failed requests, outside the cut
    refused: Counter[str]  # the away learners' refused pushes, by reason
    screens: Counter[str]  # what the syncer's screens did with the away pushes it merged
    wall: float
    cut: tuple[float, float] | None = None  # (cut, heal)
    rest_goodput: float | None = None  # the home units' during the cut
    merges_in_cut: int | None = None  # fragment versions published during the cut
    rejoin: dict[str, float | None] = field(default_factory=dict)  # unit -> heal to push
    accepted: list[tuple[float, str]] = field(default_factory=list)  # (time, unit)
    quarantined: list[tuple[float, str, str]] = field(default_factory=list)  # time, unit, why


def rows(quick: bool) -> list[Row]:
    wan = Shape(rtt_ms=200, rate_kb=12_500, reset_share=0.01)
    return [
        Row("LAN (proxy, no toxics)", Shape()),
        Row("1 Gbps, 50 ms RTT", Shape(rtt_ms=50, rate_kb=125_000)),
        Row("100 Mbps, 200 ms RTT, 1% resets", wan),
        Row("100 Mbps, 200 ms RTT, 1% resets, cut", wan, cut_seconds=15 if quick else 60),
        # The first row's setting once more: how far apart two runs of one setting end here.
        Row("LAN again (run-to-run spread)", Shape()),
    ]


def run_row(cfg: TrainingConfig, row: Row, max_seconds: float) -> Outcome:
    """One run of `cfg` with the away units behind a link shaped as `row` says."""
    started = time.time()
    total = cfg.total_steps or 0
    names = HOME + AWAY
    with syncer(cfg, log_level="INFO") as sy:
        port = int(sy.url.rsplit(":", 1)[1])
        with wan_link(port, row.shape) as link:
            logs = {name: sy.workdir / f"{name}.log" for name in names}
            procs = {
                name: learner_process(
                    sy.workdir / "run.yaml",
                    sy.url if name in HOME else link.url,
                    unit,
                    UNITS,
                    logs[name],
                    name=name,
                    group="home" if name in HOME else "away",
                )
                for unit, name in enumerate(names)
            }
            try:
                rec, budget_at, cut = _follow(sy, link, procs, row, total, started + max_seconds)
            finally:  # a failed or interrupted run leaves no learner behind
                for p in procs.values():
                    if p.poll() is None:
                        p.kill()
            codes = {name: p.wait() for name, p in procs.items()}
            if any(codes.values()):
                tails = {n: logs[n].read_text()[-500:] for n, c in codes.items() if c}
                raise RuntimeError(f"learners exited {codes}: {tails}")
            time.sleep(1.0)  # the proxy counts a connection's bytes once it has closed
            traffic, connections = link.bytes_received(), link.connections_opened()
        time.sleep(1.0)  # let the last pushes merge
        loss, _ = global_loss(sy.url, cfg)
        events = syncer_log_events(sy.workdir)
        texts = {name: path.read_text() for name, path in logs.items()}
        _keep(sy.workdir, row, rec)
    exits = {name: exit_fields(text) for name, text in texts.items()}
    end = budget_at if budget_at is not None else rec.samples[-1].time
    accepted = _units_of(events, "push_accepted")
    good = compute_goodput(rec.heartbeats, [], {}, end)
    out = Outcome(
        row=row,
        goodput=good.ratio,
        per_unit=good.per_unit,
        loss=loss,
        up=traffic["upstream"],
        down=traffic["downstream"],
        away_tokens=sum(int(exits[n]["tokens"]) for n in AWAY),
        seconds=_training_seconds(rec.heartbeats, end),
        steps_per_sec=statistics.fmean(_steps_per_sec(rec.heartbeats, n, end) for n in names),
        connections=connections,
        failed_requests=sum(_failed_requests(texts[n], cut) for n in AWAY),
        refused=Counter(m.group(1) for n in AWAY for m in _REFUSED.finditer(texts[n])),
        screens=_away_screens(events),
        wall=time.time() - started,
        accepted=[(t - started, unit) for t, unit in accepted],
        quarantined=_quarantines(events, started),
    )
    if cut is not None:
        out.cut = (cut[0] - started, cut[1] - started)
        home = [hb for hb in rec.heartbeats if hb.unit in HOME and cut[0] <= hb.time <= cut[1]]
        out.rest_goodput = compute_goodput(home, [], {}, cut[1]).ratio
        steps = [s.outer_step for s in rec.samples if cut[0] <= s.time <= cut[1]]
        out.merges_in_cut = steps[-1] - steps[0] if steps else 0
        for unit in AWAY:
            after = [t for t, u in accepted if u == unit and t >= cut[1]]
            out.rejoin[unit] = min(after) - cut[1] if after else None
    return out


def _follow(
    sy: SyncerProc,
    link: Link,
    procs: dict[str, subprocess.Popen[bytes]],
    row: Row,
    total_steps: int,
    deadline: float,
) -> tuple[Recorder, float | None, tuple[float, float] | None]:
    """Watch the run as the local runtime does (the syncer's status every POLL_SECONDS) while
    the learners train; cut the link once the syncer has counted CUT_AT of the budget, heal it
    `row.cut_seconds` later. Returns the recorder, when the budget was seen reached, and (cut,
    heal) wall times."""
    rec = Recorder(time.time())
    budget_at: float | None = None
    cut_at: float | None = None
    healed_at: float | None = None
    while any(p.poll() is None for p in procs.values()):
        now = time.time()
        if now > deadline:
            raise RuntimeError(f"{row.label}: the run did not finish in time")
        try:
            status = sy.status()
        except OSError:
            status = None
        if status is not None:
            rec.observe_status(now, status)
            if status.complete and budget_at is None:
                budget_at = now
            steps = status.steps or 0
            if row.cut_seconds and cut_at is None and steps >= CUT_AT * total_steps:
                cut_at = time.time()
                link.set_enabled(False)
                log(f"wan {row.label}: link cut at {steps} of {total_steps} steps")
        if cut_at is not None and healed_at is None and now >= cut_at + row.cut_seconds:
            link.set_enabled(True)
            healed_at = time.time()
            log(f"wan {row.label}: link healed")
        time.sleep(POLL_SECONDS)
    if budget_at is None and sy.status().complete:  # reached after the last look
        budget_at = time.time()
    if cut_at is not None and (healed_at is None or budget_at is None or budget_at < healed_at):
        raise RuntimeError(f"{row.label}: the budget was reached before the link healed")
    cut = (cut_at, healed_at) if cut_at is not None and healed_at is not None else None
    return rec, budget_at, cut


def _keep(workdir: Path, row: Row, rec: Recorder) -> None:
    """Copy the run's logs, and the heartbeats goodput was computed from, into
    $DILOCO_BENCH_KEEP (when set), for a look later."""
    keep = os.environ.get("DILOCO_BENCH_KEEP")
    if not keep:
        return
    kept = Path(keep) / f"wan-{time.strftime('%H%M%S')}"
    kept.mkdir(parents=True, exist_ok=True)
    for path in workdir.glob("*.log"):
        shutil.copy(path, kept / path.name)
    beats = "".join(json.dumps(dataclasses.asdict(hb)) + "\n" for hb in rec.heartbeats)
    (kept / "heartbeats.jsonl").write_text(beats)
    log(f"logs of {row.label} kept in {kept}")


def _units_of(events: list[LogEvent], name: str) -> list[tuple[float, str]]:
    """(time, unit) of the syncer's `event=NAME` lines."""
    return [(t, fields(rest).get("unit", "")) for t, event, rest, _ in events if event == name]


def _quarantines(events: list[LogEvent], started: float) -> list[tuple[float, str, str]]:
    """(seconds since `started`, unit, reason) of each quarantine the syncer logged."""
    found = []
    for t, event, rest, _ in events:
        if event == "quarantined":
            reason = _REASON.search(rest)
            found.append(
                (t - started, fields(rest).get("unit", ""), reason.group(1) if reason else "")
            )
    return found


def _away_screens(events: list[LogEvent]) -> Counter[str]:
    """Per merged away push, what the syncer's robust screens did with it: kept, clipped or
    dropped (the `screens=unit:outcome/...` field of its `event=merged` lines)."""
    found: Counter[str] = Counter()
    for _, event, rest, _ in events:
        if event != "merged":
            continue
        for item in fields(rest).get("screens", "").split(","):
            unit, _, outcome = item.partition(":")
            if unit in AWAY:
                found[outcome.split("/")[0]] += 1
    return found


def _sorted_beats(heartbeats: list[Heartbeat], unit: str, end: float) -> list[Heartbeat]:
    return sorted((hb for hb in heartbeats if hb.unit == unit and hb.time <= end), key=_time)


def _time(hb: Heartbeat) -> float:
    return hb.time


def _steps_per_sec(heartbeats: list[Heartbeat], unit: str, end: float) -> float:
    """The unit's inner steps per second between its first and last training heartbeats."""
    moving = [
        (a, b)
        for a, b in itertools.pairwise(_sorted_beats(heartbeats, unit, end))
        if b.step > a.step
    ]
    if not moving:
        return 0.0
    first, last = moving[0][0], moving[-1][1]
    return (last.step - first.step) / (last.time - first.time)


def _training_seconds(heartbeats: list[Heartbeat], end: float) -> float:
    """From the first unit's first training heartbeat to `end`."""
    starts = [
        a.time
        for unit in HOME + AWAY
        for a, b in itertools.pairwise(_sorted_beats(heartbeats, unit, end))
        if b.step > a.step
    ]
    return end - min(starts) if starts else 0.0


def _failed_requests(text: str, cut: tuple[float, float] | None) -> int:
    """A learner's requests that failed even after its client's own retry on a fresh
    connection, leaving out those the cut caused (CUT_MARGIN around it)."""
    count = 0
    for line in text.splitlines():
        m = _RETRY.match(line)
        if m is None:
            continue
        t = log_time(m.group(1))
        if cut is None or not cut[0] - CUT_MARGIN[0] <= t <= cut[1] + CUT_MARGIN[1]:
            count += 1
    return count


def _gbit(bytes_per_second: float) -> str:
    return f"{bytes_per_second * 8 / 1e9:.2f} Gbit/s"


def _rate(bytes_per_second: float) -> str:
    bits = 8 * bytes_per_second
    return f"{bits / 1e6:.1f} Mbit/s" if bits >= 1e6 else f"{bits / 1e3:.0f} kbit/s"


def _counts(counter: Counter[str], order: tuple[str, ...] = ()) -> str:
    keys = [k for k in order if k in counter] + sorted(k for k in counter if k not in order)
    return ", ".join(f"{k} {counter[k]}" for k in keys) or "0"


def _mean_pct(per_unit: dict[str, float], units: tuple[str, ...]) -> str:
    """The mean goodput of `units` (each unit's own ratio) as a percentage."""
    return f"{100 * statistics.fmean(per_unit.get(u, 0.0) for u in units):.1f}%"


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def plot(ctx: BenchContext, results: list[Outcome]) -> tuple[Path, Path | None]:
    """Goodput and loss of each row against LAN's; the cut row's accepted pushes over time."""
    base = results[0]
    fig, ax = plots.axes((8.0, 4.0))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r.goodput / base.goodput for r in results], 0.4)
    ax.bar([x + 0.2 for x in xs], [r.loss / base.loss for r in results], 0.4)
    labels = [r.row.label.replace(", ", "\n").replace(" (", "\n(") for r in results]
    ax.set_xticks(list(xs), labels, fontsize=7)
    ratios = [r.goodput / base.goodput for r in results] + [r.loss / base.loss for r in results]
    ax.set_ylim(min(0.9, *ratios) - 0.02, max(1.1, *ratios) + 0.02)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.legend(["LAN", "goodput / LAN", "eval loss / LAN"], fontsize=8)
    ax.set_ylabel("ratio to the LAN row")
    ax.set_title("WAN rows against LAN")
    ax.grid(alpha=0.3, axis="y")
    rows_png = plots.save(fig, ctx.plot_path("wan_rows.png"))
    cut = next((r for r in results if r.cut is not None), None)
    if cut is None or cut.cut is None:
        return rows_png, None
    fig, ax = plots.axes((7.0, 2.8))
    names = HOME + AWAY
    for i, unit in enumerate(names):
        ts = [t for t, u in cut.accepted if u == unit]
        ax.scatter(ts, [i] * len(ts), s=6, label=f"{unit}: accepted push")
    for t, unit, _ in cut.quarantined:
        ax.scatter([t], [names.index(unit)], marker="x", s=60, color="black")
    ax.axvspan(*cut.cut, color="red", alpha=0.15, label="link cut")
    ax.set_yticks(range(len(names)), list(names))
    ax.set_xlabel("seconds since the run started (x: quarantined)")
    ax.set_title("pushes the syncer accepted, per unit, cut row")
    ax.grid(alpha=0.3)
    cut_png = plots.save(fig, ctx.plot_path("wan_cut.png"))
    return rows_png, cut_png


def run(ctx: BenchContext) -> Section:
    steps = 400 if ctx.quick else 2000  # inner steps per learner, on average
    cfg = parity_config(steps, H, learners=UNITS)
    max_seconds = 600 if ctx.quick else 1200
    results = []
    for row in rows(ctx.quick):
        out = run_row(cfg, row, max_seconds)
        log(
            f"wan {row.label}: goodput {out.goodput:.4f} "
            f"({', '.join(f'{u} {g:.3f}' for u, g in sorted(out.per_unit.items()))}) "
            f"loss {out.loss:.4f} up {out.up} B "
            f"down {out.down} B rejoin {out.rejoin} refused {dict(out.refused)} "
            f"wall {out.wall:.0f}s"
        )
        results.append(out)
    return section(ctx, cfg, steps, results)


def section(ctx: BenchContext, cfg: TrainingConfig, steps: int, results: list[Outcome]) -> Section:
    n = n_params(cfg.model)
    tps = cfg.tokens_per_step
    base = results[0]
    dp_token = dp_bytes_per_token(n, tps)
    main_rows, link_rows = [], []
    for r in results:
        loss, ratio = loss_cells(r.loss, base.loss)
        main_rows.append(
            (
                r.row.label,
                f"{100 * r.goodput:.1f}%",
                f"{r.goodput / base.goodput:.3f}",
                f"{_mean_pct(r.per_unit, HOME)} / {_mean_pct(r.per_unit, AWAY)}",
                loss,
                ratio,
                f"{r.steps_per_sec:.1f}",
                f"{r.wall:.0f}s",
            )
        )
        link_rows.append(
            (
                r.row.label,
                f"{r.up / r.away_tokens:.0f} B",
                f"{r.down / r.away_tokens:.0f} B",
                f"{_rate(r.up / r.seconds)} / {_rate(r.down / r.seconds)}",
                _gbit(2 * n * 4 * r.steps_per_sec),
                r.connections,
                r.failed_requests,
                _counts(r.screens, ("kept", "clipped", "dropped")),
                _counts(r.refused),
            )
        )
    main = md_table(
        [
            "link",
            "goodput",
            "goodput / LAN",
            "home / away units",
            "final eval loss",
            "loss / LAN",
            "steps/s per learner",
            "wall",
        ],
        main_rows,
    )
    links = md_table(
        [
            "link",
            "WAN up / away token",
            "WAN down / away token",
            "mean WAN rate up / down",
            "data-parallel would need (per replica, each way)",
            "connections opened through the link",
            "away requests failed (outside the cut)",
            "away pushes merged, by screen",
            "away pushes refused, by reason",
        ],
        link_rows,
    )
    fast, slow, cut = results[1], results[2], results[3]
    fast_ok = fast.goodput >= 0.98 * base.goodput and fast.loss <= 1.01 * base.loss
    slow_ok = slow.goodput >= 0.95 * base.goodput
    rejoins = list(cut.rejoin.values())
    rejoin_max = max(v for v in rejoins if v is not None) if None not in rejoins else None
    rest = cut.rest_goodput or 0.0
    cut_ok = rest >= 0.95 and rejoin_max is not None and rejoin_max <= REJOIN_TARGET
    rejoin_text = ", ".join(
        f"{u} {'never' if v is None else f'{v:.1f} s'}" for u, v in cut.rejoin.items()
    )
    span = cut.cut or (0.0, 0.0)
    after_heal = [(t - span[1], u, why) for t, u, why in cut.quarantined if t >= span[1]]
    quarantine_text = (
        "; ".join(
            f"{u} was quarantined {t:.1f} s after the heal ({why})" for t, u, why in after_heal
        )
        + ", and every push it sent from then on was refused"
        if after_heal
        else "no unit was quarantined"
    )
    stayed = (
        ""
        if not after_heal
        else f"; but {len(after_heal)} of the {len(AWAY)} cut-off units were quarantined "
        f"within {max(t for t, _, _ in after_heal):.0f} s of the heal, their later pushes "
        "all refused"
    )
    rows_png, cut_png = plot(ctx, results)
    cut_plot = f"\n![accepted pushes per unit, cut row]({ctx.link(cut_png)})\n" if cut_png else ""
    shape = slow.row.shape
    body = f"""
Four units of one run, the same in every row (the parity section's model, data, seed and
settings: tiny preset, N = {n:,} parameters, batch {cfg.data.batch_size} x {cfg.model.context}
tokens, H={cfg.inner_steps}, P={cfg.fragments}, quorum {cfg.quorum}, phase-locked pushes; a
budget of {steps * UNITS:,} inner steps = {steps * UNITS * tps:,} tokens; compression as in the
parity sections: none, float32 deltas up and float32 versions down, the product's default). Every piece is a real process on this machine: one
`diloco-syncer`, four `diloco-learner`s; `home-0`, `home-1` reach the syncer directly, `away-2`,
`away-3` through an emulated WAN link: a toxiproxy {version()} proxy on 127.0.0.1 (no netem on this
kernel). Its toxics, on both directions: `latency` of half the RTT each way with
{100 * shape.jitter:.0f}% of it as jitter, and `bandwidth` (KB/s: 1 Gbps = 125,000, 100 Mbps =
12,500). Resets: a `reset_peer` toxic (timeout 0) on the responses with toxicity
{shape.reset_share:g}, drawn again for every open connection every {REDRAW_SECONDS:g} s
(toxiproxy draws once per connection when it opens, and the learners keep theirs open), so that
each response through the link has about a 1% chance of being cut off by a TCP reset (a long
one more: it meets several draws). The cut: the proxy
disabled (`enabled: false`: its listener closed, every connection through it dropped, so the
away units see refused connections rather than silence) for {cut.row.cut_seconds:g} s once the
syncer has counted {100 * CUT_AT:.0f}% of the budget, then enabled again. The budget ends each
run (the syncer reports it reached); the rows run one after another. The last row repeats the
first: the two LAN runs' losses say how far apart two runs of one setting end on this machine,
which is the yardstick for the loss ratios.

{main}

![goodput and loss per row against LAN]({ctx.link(rows_png)})

Targets:

- 1 Gbps / 50 ms: goodput >= 0.98 of LAN and final loss within 1% of LAN's (loss / LAN <= 1.01):
  {_verdict(fast_ok)} ({fast.goodput / base.goodput:.3f}, {fast.loss / base.loss:.3f}).
- 100 Mbps / 200 ms / 1% resets: goodput >= 0.95 of LAN: {_verdict(slow_ok)}
  ({slow.goodput / base.goodput:.3f}).
- {cut.row.cut_seconds:g} s cut: the rest keeps >= 95% goodput during the cut and the cut-off
  units' next accepted push comes <= {REJOIN_TARGET:g} s after the heal: {_verdict(cut_ok)}
  ({100 * rest:.1f}%, {"never" if rejoin_max is None else f"{rejoin_max:.1f} s"}){stayed}.

**Cut row.** Cut at {span[0]:.0f} s, healed at {span[1]:.0f} s. The home units' goodput during the
cut: {100 * rest:.1f}%; {cut.merges_in_cut} fragment versions were published during it (merges
of the home units' pushes). Seconds from the heal to each cut-off unit's next push the syncer
accepted (its `push_accepted` log line): {rejoin_text}. After the heal, {quarantine_text}.
{cut_plot}
**The link.**

{links}

**Goodput** is the local runtime's (docs/local.md, the goodput_real section: `compute_goodput`):
per unit, learner-seconds from its first training heartbeat to the moment the budget was seen
reached; useful are those between two consecutive heartbeats of one attempt whose step
advanced. The heartbeats and steps are those the syncer reports in `/v1/status`, polled every
{POLL_SECONDS:g} s as the runtime does, and the syncer counts a unit's steps only up to 2H past
its last accepted push (docs/design.md, "Trust no single unit"). A learner never waits on the
network once it trains, so latency, bandwidth and resets cost goodput only where they hold back
the pushes that let the syncer count the steps; a unit whose pushes are refused (quarantined)
stops advancing there, and its seconds stop being useful. The away units' heartbeats cross the
link too, so during the cut the syncer hears nothing from them; their first heartbeat after the
heal counts the cut as useful as far as the syncer counts the steps it reports. "During the cut"
counts the home units' heartbeats from the cut to the heal only.

**The away units' pushes.** "merged, by screen": in the syncer's merges (its `event=merged`
lines), the away pushes kept as they were, clipped to the reference norm, or dropped as outliers
(docs/design.md, "Trust no single unit"). A push that cannot be sent is folded into the next
push of its fragment, so the first push after a cut carries everything the unit learned during
it, against a base many versions old. "refused, by reason": pushes the syncer answered with a
4xx, which the learner drops (`stale`: a base older than maxStaleness {cfg.max_staleness}
versions; `quarantined`: the unit's attempt sent too many outliers). "requests failed": the away
learners' requests that failed even after the client's own retry on a fresh connection, left
out from {CUT_MARGIN[0]:g} s before the cut to {CUT_MARGIN[1]:g} s after the heal (its refused
connections and their backoff); a reset is mostly absorbed by that retry, and shows up as one
more connection opened through the link.

**Bytes.** What the proxy read each way (toxiproxy's `-proxy-metrics` counters, HTTP headers
included, TCP/IP overhead not): up = from the away units, down = from the syncer to them, per
token the away units trained (their exit lines): every byte that crossed the WAN, joins and
retries included, and nothing else. The mean rate is those bytes over the seconds from the first
training heartbeat to the budget. For comparison, a data-parallel ring all-reduce sends and
receives 2 x N x 4 bytes per replica per step = {dp_token:,.0f} B per token each way ((W-1)/W
rounded to 1, float32 gradients): {dp_token / (base.up / base.away_tokens):,.0f}x the LAN row's
bytes up per token, {dp_token / (base.down / base.away_tokens):,.0f}x its bytes down.

**What data-parallel would need.** For the same tokens per second as the row's learners, each
data-parallel replica (batch {cfg.data.batch_size} x {cfg.model.context}, at the learners' step
time) must move 2 x N x 4 bytes per step each way: bandwidth = 8 N / t_step bytes/s per
direction per replica, t_step = 1 / (the row's steps/s per learner, from their heartbeats); a
ring with replicas on both sides crosses the WAN link, which must carry that much each way. The
four learners share two CPU cores here, so t_step is long; an accelerator's is far shorter and
needs proportionally more.

Not measured here: a link shared by all connections (toxiproxy's bandwidth is per connection and
direction; the mean rates above are far below it), TCP's own handshake over the link (the proxy
accepts locally), packet loss and reordering below TCP, TLS and the join credential (the away
units use plain HTTP with their unit tokens; docs/multi-cluster.md has the https path). One run
per row: two runs of one setting can end more than 1% apart on this shared machine (the
processes' arrival order varies and quorum-1 merges follow it; the two LAN rows show by how much
here, chaos_loss over repeated runs), so a loss ratio inside that spread says nothing either way.
"""
    cuts = f", cut {cut.row.cut_seconds:g} s at {100 * CUT_AT:.0f}% of the budget"
    return Section(
        name="wan",
        title="One run across an emulated WAN link",
        body=body,
        command=ctx.command,
        config=f"{UNITS} units (2 home, 2 away), tiny preset, batch {cfg.data.batch_size}, "
        f"H={cfg.inner_steps}, P={cfg.fragments}, totalSteps {cfg.total_steps}, compression "
        f"none{cuts}, toxiproxy {version()}",
        quick=ctx.quick,
    )
