"""The syncer's data lease book (pure): who reads which shard, epochs, restarts, scaling."""

from __future__ import annotations

import json
import logging

import pytest
from diloco_trainer.syncer.data_leases import LeaseBook
from diloco_trainer.wire import DataLease

ALL = ("a", "b", "c", "d")  # alive units


def test_joining_units_get_the_lowest_free_shards() -> None:
    book = LeaseBook(4)
    assert book.join("a", ALL) == DataLease(0, 0, 0)
    assert book.join("b", ALL) == DataLease(0, 1, 0)
    assert book.join("a", ALL) == DataLease(0, 0, 0)  # a join again: its own lease


def test_a_finished_shard_is_followed_by_the_next_free_one() -> None:
    book = LeaseBook(4)
    a = book.join("a", ALL)
    book.join("b", ALL)
    assert book.claim("a", DataLease(0, 0, 9), ALL) == DataLease(0, 2, 0)
    assert book.finished == {a.shard}
    assert book.lease_of("a") == DataLease(0, 2, 0)


def test_a_repeated_claim_returns_the_lease_the_first_one_gave() -> None:
    book = LeaseBook(4)
    book.join("a", ALL)
    first = book.claim("a", DataLease(0, 0, 5), ALL)
    assert book.claim("a", DataLease(0, 0, 5), ALL) == first  # the answer was lost: a retry
    assert book.finished == {0}


def test_the_next_epoch_opens_when_every_shard_is_finished_or_leased() -> None:
    book = LeaseBook(2)
    book.join("a", ALL)  # shard 0
    book.join("b", ALL)  # shard 1
    # Every shard of epoch 0 is finished or leased: a's next claim opens epoch 1.
    assert book.claim("a", DataLease(0, 0, 3), ALL) == DataLease(1, 0, 0)
    assert book.epoch == 1 and book.finished == set()
    # b still reads epoch 0's shard 1; finishing it moves b to epoch 1's next free shard.
    assert book.claim("b", DataLease(0, 1, 3), ALL) == DataLease(1, 1, 0)
    assert book.claim("a", DataLease(1, 0, 3), ALL) == DataLease(2, 0, 0)


def test_a_restarted_unit_gets_its_lease_back_at_its_reported_position() -> None:
    book = LeaseBook(4)
    book.join("a", ALL)
    assert book.report("a", DataLease(0, 0, 7))
    assert book.report("a", DataLease(0, 0, 4))  # an older push retried: never backwards
    assert book.join("a", ALL) == DataLease(0, 0, 7)


def test_an_unknown_unit_claiming_gets_a_fresh_lease() -> None:
    book = LeaseBook(4)
    book.join("a", ALL)
    # The book never gave c anything (a syncer restored from before its join): shard 0 is a's,
    # so c's claim of it marks nothing finished and c gets a free shard.
    assert book.claim("c", DataLease(0, 0, 3), ALL) == DataLease(0, 1, 0)
    assert book.finished == set() and book.lease_of("a") == DataLease(0, 0, 0)


def test_a_report_for_a_shard_the_unit_no_longer_holds_is_ignored() -> None:
    book = LeaseBook(4)
    book.join("a", ALL)
    book.join("b", ALL)
    assert not book.report("a", DataLease(0, 1, 9))  # b's shard
    assert book.lease_of("a") == DataLease(0, 0, 0)
    assert book.lease_of("b") == DataLease(0, 1, 0)


def test_a_report_or_claim_of_a_free_shard_the_unit_never_held_changes_nothing() -> None:
    """Only the book hands shards out: a unit cannot take a free shard by reporting a position
    in it, nor mark free shards finished by claiming them."""
    book = LeaseBook(4)
    book.join("a", ALL)
    assert not book.report("a", DataLease(0, 2, 5))
    assert book.lease_of("a") == DataLease(0, 0, 0) and book.finished == set()
    for shard in (1, 2, 3):  # never leased to anyone
        assert book.claim("a", DataLease(0, shard, 99), ALL) == DataLease(0, 0, 0)
    assert book.finished == set() and book.lease_of("a") == DataLease(0, 0, 0)
    # The shards are still there for whoever the book gives them to.
    assert [book.join(u, ALL).shard for u in ("b", "c", "d")] == [1, 2, 3]


def test_a_repeated_claim_returns_what_the_first_gave() -> None:
    book = LeaseBook(4)
    first = book.join("a", ALL)
    second = book.claim("a", first, ALL)
    assert book.claim("a", first, ALL) == second and book.finished == {first.shard}


def test_a_scaled_run_of_two_then_three_units_reads_disjoint_shards() -> None:
    book = LeaseBook(8)
    held: dict[str, DataLease] = {u: book.join(u, ALL) for u in ("a", "b")}
    read: list[tuple[int, int]] = []
    for rnd in range(12):
        if rnd == 3:  # kubectl scale: a third unit joins
            held["c"] = book.join("c", ALL)
        for unit in sorted(held):
            keys = [(lease.epoch, lease.shard) for lease in held.values()]
            assert len(keys) == len(set(keys)), keys  # at any moment, pairwise disjoint
            read.append((held[unit].epoch, held[unit].shard))
            held[unit] = book.claim(unit, held[unit], ALL)
    assert len(read) == len(set(read))  # no (epoch, shard) read twice in the whole run
    assert {s for e, s in read if e == 0} == set(range(8))  # epoch 0 read whole


def test_a_unit_that_never_comes_back_hands_its_lease_on_once_free_shards_run_out() -> None:
    book = LeaseBook(3)
    book.join("a", ("a", "b", "gone"))
    book.join("gone", ("a", "b", "gone"))  # shard 1
    book.report("gone", DataLease(0, 1, 6))
    book.join("b", ("a", "b", "gone"))  # shard 2
    # a finishes shard 0; no free shard is left in epoch 0 and "gone" is no longer alive:
    # a takes over its lease where it reported, before epoch 1 opens.
    assert book.claim("a", DataLease(0, 0, 9), ("a", "b")) == DataLease(0, 1, 6)
    assert book.lease_of("gone") is None
    assert book.epoch == 0
    # While its owner is alive a lease is never taken: the next claim opens epoch 1.
    assert book.claim("b", DataLease(0, 2, 9), ("a", "b")) == DataLease(1, 0, 0)


def test_the_checkpoint_form_round_trips_and_old_checkpoints_load() -> None:
    book = LeaseBook(4)
    book.join("a", ALL)
    book.claim("a", DataLease(0, 0, 3), ALL)
    book.report("a", DataLease(0, 1, 2))
    again = LeaseBook.from_json(json.loads(json.dumps(book.to_json())), 4)
    assert again.to_json() == book.to_json()
    assert LeaseBook.from_json(None, 4).to_json() == LeaseBook(4).to_json()  # before leases


def test_a_checkpoint_of_another_shard_count_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data\.shards"):
        LeaseBook.from_json(LeaseBook(4).to_json(), 8)


def test_a_damaged_lease_is_dropped_and_the_rest_kept(caplog: pytest.LogCaptureFixture) -> None:
    raw = LeaseBook(4).to_json()
    raw["held"] = {"a": {"epoch": 0, "shard": 9, "position": 0}, "b": {"epoch": 0, "shard": 1}}
    raw["held"]["c"] = {"epoch": 0, "shard": 2, "position": 4}
    with caplog.at_level(logging.ERROR):
        book = LeaseBook.from_json(raw, 4)
    assert book.held == {"c": DataLease(0, 2, 4)}
    assert caplog.text.count("event=checkpoint_data_lease_dropped") == 2


def test_the_newest_book_is_the_one_with_later_assignments_and_further_positions() -> None:
    checkpoint = LeaseBook(4)
    checkpoint.join("a", ALL)
    journal = LeaseBook.from_json(checkpoint.to_json(), 4)  # journaled at a's join
    checkpoint.report("a", DataLease(0, 0, 8))  # positions reach only checkpoints
    assert checkpoint.newest(journal).lease_of("a") == DataLease(0, 0, 8)
    journal.claim("b", DataLease(0, 3, 0), ALL)  # a claim after the checkpoint: journaled
    merged = checkpoint.newest(journal)
    assert merged.lease_of("b") == DataLease(0, 1, 0)
    assert merged.lease_of("a") == DataLease(0, 0, 8)
