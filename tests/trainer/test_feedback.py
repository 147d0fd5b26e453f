"""Error feedback on quantized pushes (feedback.py): over many pushes the syncer receives the
learner's whole update, short only of what is owed at the end."""

from __future__ import annotations

import numpy as np
from diloco_trainer.feedback import PushFeedback, push_feedback
from diloco_trainer.quantize import dequantize, quantize


def _applied(sent: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: dequantize(quantize(v, "int2", 32)) for n, v in sent.items()}


def test_what_reaches_the_syncer_sums_to_the_updates_minus_the_debt() -> None:
    rng = np.random.default_rng(0)
    fb = PushFeedback()
    updates = [{"w": rng.normal(size=(16, 8)).astype(np.float32)} for _ in range(50)]
    received = np.zeros((16, 8))
    for delta in updates:
        sent = fb.compensated(3, delta)
        applied = _applied(sent)
        fb.settle(3, sent, applied)
        received += applied["w"]
    total = sum(u["w"].astype(np.float64) for u in updates)
    debt = fb.compensated(3, {"w": np.zeros((16, 8), np.float32)})["w"]
    np.testing.assert_allclose(received + debt, total, atol=1e-4)
    # The debt stays bounded by one push's error, not the sum of fifty of them.
    assert fb.owed_norm(3) < 0.6 * np.linalg.norm(updates[-1]["w"])
    assert fb.owed_norm(3) == np.linalg.norm(debt)


def test_without_feedback_the_errors_add_up() -> None:
    rng = np.random.default_rng(0)
    updates = [{"w": rng.normal(size=(16, 8)).astype(np.float32)} for _ in range(50)]
    received = sum(_applied(u)["w"].astype(np.float64) for u in updates)
    total = sum(u["w"].astype(np.float64) for u in updates)
    # What error feedback bounds by one push's error, dropping it lets grow with the pushes.
    assert np.linalg.norm(received - total) > 2 * np.linalg.norm(updates[-1]["w"])


def test_fragments_owe_separately_and_a_refused_push_changes_nothing() -> None:
    fb = PushFeedback()
    delta = {"a": np.array([0.3, -1.0, 0.2, 0.1], np.float32)}
    sent = fb.compensated(0, delta)
    fb.settle(0, sent, _applied(sent))
    assert fb.owed_norm(0) > 0 and fb.owed_norm(1) == 0.0
    np.testing.assert_array_equal(fb.compensated(1, delta)["a"], delta["a"])
    before = fb.compensated(0, delta)["a"]
    fb.compensated(0, {"a": np.ones(4, np.float32)})  # computed, never settled: refused
    np.testing.assert_array_equal(fb.compensated(0, delta)["a"], before)


def test_feedback_only_where_asked_for_and_something_is_lost() -> None:
    assert isinstance(push_feedback("int2", True), PushFeedback)
    assert push_feedback("int2", False) is None
    assert push_feedback("none", True) is None  # float32 pushes lose nothing to owe
