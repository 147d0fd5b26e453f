"""The soak bench's reading of syncer logs (bench/faults/soak_logs.py): versions lost per syncer kill
and pushes of superseded attempts, on log lines written as the syncer writes them."""

from __future__ import annotations

from pathlib import Path

from bench.faults.soak_logs import kill_loss, stale_pushes
from bench.lib.syncer_logs import syncer_log_events

PREFIX = "level=INFO logger=diloco.syncer"


def write_log(path: Path, lines: list[tuple[str, str]]) -> None:
    path.write_text("".join(f"2026-12-01 10:00:{sec} {PREFIX} {text}\n" for sec, text in lines))


def test_a_standby_that_serves_every_published_version_loses_nothing(tmp_path: Path) -> None:
    write_log(
        tmp_path / "syncer.log",
        [
            ("01,000", "event=listening host=127.0.0.1 port=1 run=r fragments=2"),
            ("02,000", "event=merged fragment=0 version=1 contributions=1 share=1 units=a"),
            ("03,000", "event=merged fragment=1 version=1 contributions=1 share=1 units=a"),
            ("04,000", "event=merged fragment=0 version=2 contributions=1 share=1 units=a"),
        ],
    )
    write_log(
        tmp_path / "syncer-standby-1.log",
        [
            ("01,500", "event=standby_ready lock=x versions=[0, 0]"),
            ("05,200", "event=took_over seconds=0.1 versions=[2, 1]"),
            ("05,300", "event=listening host=127.0.0.1 port=1 run=r fragments=2"),
        ],
    )
    events = syncer_log_events(tmp_path)
    kill = [when for when, event, _, _ in events if event == "merged"][-1] + 0.5
    loss = kill_loss(kill, events)
    assert loss is not None
    assert (loss.published, loss.served, loss.lost) == ((2, 1), (2, 1), 0)
    assert loss.killed_log == "syncer.log" and loss.successor_log == "syncer-standby-1.log"
    assert loss.serving_after is not None and abs(loss.serving_after - 0.8) < 1e-6
    assert loss.successor_warm


def test_a_standby_killed_as_it_takes_over_hands_on_to_the_next_without_loss(
    tmp_path: Path,
) -> None:
    """Two syncer kills 0.2 s apart (the soak drew them): the second hits standby 1 between its
    took_over and its listening. It is the syncer killed then, standby 2 (cold, restored from
    the checkpoint) its successor, and nothing was lost; before, the second kill was read as
    syncer.log -> standby 1 with nothing served."""
    write_log(
        tmp_path / "syncer.log",
        [
            ("01,000", "event=listening host=127.0.0.1 port=1 run=r fragments=2"),
            ("02,000", "event=merged fragment=0 version=3 contributions=1 share=1 units=a"),
        ],
    )
    write_log(
        tmp_path / "syncer-standby-1.log",
        [
            ("01,500", "event=restored seq=1 versions=[2, 0] outer_step=2"),
            ("01,600", "event=standby_ready lock=x versions=[2, 0]"),
            ("05,000", "event=took_over seconds=0.1 versions=[3, 0]"),
            ("05,100", "event=listening host=127.0.0.1 port=1 run=r fragments=2"),
        ],
    )
    write_log(
        tmp_path / "syncer-standby-2.log",
        [
            ("07,000", "event=restored seq=2 versions=[3, 0] outer_step=3"),
            ("07,200", "event=listening host=127.0.0.1 port=1 run=r fragments=2"),
        ],
    )
    events = syncer_log_events(tmp_path)
    took_over = next(when for when, event, _, _ in events if event == "took_over")
    first, second = kill_loss(took_over - 0.2, events), kill_loss(took_over + 0.05, events)
    assert first is not None and second is not None
    assert (first.killed_log, first.successor_log) == ("syncer.log", "syncer-standby-1.log")
    assert (first.published, first.served, first.lost) == (
        (3, 0),
        (3, 0),
        0,
    ) and first.successor_warm
    assert (second.killed_log, second.successor_log) == (
        "syncer-standby-1.log",
        "syncer-standby-2.log",
    )
    assert (second.published, second.served, second.lost) == ((3, 0), (3, 0), 0)
    assert not second.successor_warm
    assert second.serving_after is not None and abs(second.serving_after - 2.15) < 1e-6


def test_a_cold_restart_from_an_older_checkpoint_counts_the_renumbered_versions_lost(
    tmp_path: Path,
) -> None:
    """The restarted syncer appends to the same log; it restored versions [1, 1] and had to
    renumber fragment 0 (published 3): two versions of fragment 0 are lost."""
    write_log(
        tmp_path / "syncer.log",
        [
            ("01,000", "event=listening host=127.0.0.1 port=1 run=r fragments=2"),
            ("02,000", "event=merged fragment=0 version=3 contributions=1 share=1 units=a"),
            ("03,000", "event=merged fragment=1 version=1 contributions=1 share=1 units=a"),
            ("09,000", "event=restored seq=4 versions=[1, 1] outer_step=2"),
            ("09,100", "event=versions_lost fragment=0 checkpointed=1 published=3 resume=4"),
            ("09,200", "event=listening host=127.0.0.1 port=1 run=r fragments=2"),
        ],
    )
    events = syncer_log_events(tmp_path)
    loss = kill_loss([when for when, event, _, _ in events if event == "merged"][-1] + 1, events)
    assert loss is not None
    assert (loss.published, loss.served, loss.lost) == ((3, 1), (1, 1), 2)
    assert not loss.successor_warm  # a cold restart


def test_a_kill_with_no_successor_before_the_logs_end_is_reported_as_such(
    tmp_path: Path,
) -> None:
    write_log(
        tmp_path / "syncer.log",
        [("01,000", "event=listening host=127.0.0.1 port=1 run=r fragments=1")],
    )
    events = syncer_log_events(tmp_path)
    loss = kill_loss(events[0][0] + 1.0, events)
    assert loss is not None and loss.successor_log is None and loss.serving_after is None
    assert kill_loss(events[0][0] - 1.0, events) is None  # no syncer served yet


def test_a_push_of_an_older_attempt_after_a_newer_one_joined_is_stale(tmp_path: Path) -> None:
    push = "event=push_accepted fragment=0 unit={} attempt={} base=0 version=0 c_steps=1"
    write_log(
        tmp_path / "syncer.log",
        [
            ("01,000", "event=join unit=u0 attempt=0 group=default versions=[0] resume_step=0"),
            ("02,000", push.format("u0", 0)),
            ("03,000", "event=join unit=u0 attempt=1 group=default versions=[0] resume_step=0"),
            ("04,000", push.format("u1", 0)),  # another unit's attempt 0: not stale
            ("05,000", push.format("u0", 1)),
            ("06,000", push.format("u0", 0)),  # the zombie
        ],
    )
    stale = stale_pushes(syncer_log_events(tmp_path))
    assert len(stale) == 1 and stale[0].startswith("u0 attempt 0 after attempt 1")
