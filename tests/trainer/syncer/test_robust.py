"""The robust screens on a round of four deltas: three honest (a shared direction plus their
own noise) and one bad unit sending its delta 9.9x long, noise of the usual norm, or its delta
with the sign flipped."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_trainer.config import RobustConfig
from diloco_trainer.merge import Contribution, merge_fragment
from diloco_trainer.syncer import robust
from diloco_trainer.syncer.quarantine import QuarantineBook
from diloco_trainer.syncer.registry import LearnerRegistry

UNITS = ["a", "b", "c", "bad"]
SHAPES = {"w": (64, 32), "v": (256,)}


def honest(seed: int, signal: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        k: (v + rng.normal(scale=1.0, size=v.shape)).astype(np.float32) for k, v in signal.items()
    }


def round_of(bad: str) -> tuple[list[Contribution], list[Contribution]]:
    rng = np.random.default_rng(0)
    signal = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    deltas = [honest(seed, signal) for seed in (1, 2, 3, 4)]
    own = deltas[3]
    if bad == "scaled":
        deltas[3] = {k: v * 9.9 for k, v in own.items()}
    elif bad == "noise":
        norm = np.sqrt(sum(float(np.sum(v * v)) for v in own.values()))
        noise = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in own.items()}
        scale = norm / np.sqrt(sum(float(np.sum(v * v)) for v in noise.values()))
        deltas[3] = {k: (v * scale).astype(np.float32) for k, v in noise.items()}
    elif bad == "flipped":
        deltas[3] = {k: -v for k, v in own.items()}
    contributions = [Contribution(d, 10, 640) for d in deltas]
    # What a screened merge should come close to: the honest deltas it keeps (a clipped one
    # keeps its own, honest direction).
    kept = [*deltas[:3], own] if bad in ("scaled", "none") else deltas[:3]
    return contributions, [Contribution(d, 10, 640) for d in kept]


def cosine(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    dot = sum(float(np.sum(a[k] * b[k])) for k in a)
    na = np.sqrt(sum(float(np.sum(v * v)) for v in a.values()))
    nb = np.sqrt(sum(float(np.sum(v * v)) for v in b.values()))
    return dot / (na * nb)


@pytest.mark.parametrize(
    ("bad", "action"), [("scaled", "clipped"), ("noise", "dropped"), ("flipped", "dropped")]
)
def test_one_bad_delta_is_clipped_or_left_out_and_the_merge_stays_the_honest_ones(
    bad: str, action: str
) -> None:
    everyone, the_honest = round_of(bad)
    screened = robust.screen(RobustConfig())(robust.start(UNITS, everyone, None), True)
    assert {u: v.action for u, v in screened.verdicts.items()} == {
        "a": "kept",
        "b": "kept",
        "c": "kept",
        "bad": action,
    }
    merged = merge_fragment(screened.contributions)
    plain = merge_fragment(everyone)
    reference = merge_fragment(the_honest)
    assert cosine(merged, reference) > 0.97
    ratio = np.linalg.norm(merged["w"]) / np.linalg.norm(reference["w"])
    assert 0.9 < ratio < 1.3
    if bad == "scaled":  # unscreened, RDA takes the long delta's norm into its radius
        assert np.linalg.norm(plain["w"]) / np.linalg.norm(reference["w"]) > 2.5


def test_an_honest_round_keeps_everything_and_is_merged_unchanged() -> None:
    everyone, _ = round_of("none")
    screened = robust.screen(RobustConfig())(robust.start(UNITS, everyone, None), True)
    assert all(v.action == "kept" for v in screened.verdicts.values())
    assert all(v.cosine is not None and v.cosine > 0.3 for v in screened.verdicts.values())
    for got, given in zip(screened.contributions, everyone, strict=True):
        assert got is given


def test_a_nearly_orthogonal_round_drops_nobody_and_two_units_are_clipped_by_history() -> None:
    rng = np.random.default_rng(7)
    noisy = [
        Contribution({k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}, 5, 50)
        for _ in UNITS
    ]
    screened = robust.screen(RobustConfig())(robust.start(UNITS, noisy, None), True)
    assert all(v.action == "kept" for v in screened.verdicts.values())  # nobody stands out
    # Two contributions have no median of their own: the fragment's typical norm decides.
    long = Contribution({k: v * 10 for k, v in noisy[0].delta.items()}, 5, 50)
    pair = robust.start(["a", "bad"], [noisy[1], long], typical=robust.delta_norm(noisy[1]))
    out = robust.screen(RobustConfig())(pair, True)
    assert out.verdicts["bad"].action == "clipped" and out.verdicts["a"].action == "kept"
    assert robust.delta_norm(out.contributions[1]) == pytest.approx(
        2.0 * robust.delta_norm(noisy[1]), rel=1e-5
    )


def test_others_cosines_match_a_direct_computation() -> None:
    everyone, _ = round_of("flipped")
    got = robust.others_cosines(everyone, token_weighting=False)
    units = [
        {
            k: v / np.sqrt(sum(float(np.sum(x * x)) for x in c.delta.values()))
            for k, v in c.delta.items()
        }
        for c in everyone
    ]
    for i, unit in enumerate(units):
        rest = {k: sum(u[k] for j, u in enumerate(units) if j != i) for k in unit}
        assert got[i] == pytest.approx(cosine(unit, rest), abs=1e-5)


def test_an_attempt_sending_outliers_again_and_again_is_quarantined_until_it_restarts() -> None:
    book = QuarantineBook(after=3, window=6)
    outlier, fine = robust.Verdict("bad", "dropped", 1.0, -0.4, True), robust.Verdict("bad")
    mild = robust.Verdict("bad", "clipped", 2.5, 0.4, False)  # scaled, not counted
    assert book.record("bad", 0, mild) is None and not mild.outlier
    for verdict in (outlier, fine, outlier):
        assert book.record("bad", 0, verdict) is None
    reason = book.record("bad", 0, outlier)
    assert reason is not None and "3 of attempt 0's last 5" in reason and "dropped" in reason
    assert book.reason("bad", 0) == reason and book.reason("bad", 1) is None
    assert book.record("bad", 1, fine) is None  # the restarted attempt starts clean
    restored = QuarantineBook(3, 6)
    restored.load_json(book.to_json())
    assert restored.reason("bad", 0) == reason
    # A restarted attempt's first two merged pushes (fresh AdamW moments) are not counted: the
    # "fine" above and this outlier; the three after it are, and quarantine it.
    assert book.record("bad", 1, outlier) is None and book.reason("bad", 1) is None
    for _ in range(2):
        assert book.record("bad", 1, outlier) is None
    assert book.record("bad", 1, outlier) is not None


def test_a_unit_back_from_a_silence_gets_its_first_pushes_uncounted_again() -> None:
    outlier = robust.Verdict("away", "dropped", 1.0, -0.1, True)
    # Without a silence an attempt 0 that keeps sending outliers is quarantined on the third.
    plain = QuarantineBook(after=3, window=6)
    assert [plain.record("away", 0, outlier) is None for _ in range(3)] == [True, True, False]
    # Heard again after a silence (the registry's count went 0 -> 1): the two pushes that fold
    # what it learned while unheard are screened but not counted; later ones count again.
    book = QuarantineBook(after=3, window=6)
    assert book.record("away", 0, outlier) is None  # counted: 1 of 3
    for _ in range(2):
        assert book.record("away", 0, outlier, silences=1) is None  # grace
    assert book.record("away", 0, outlier, silences=1) is None  # counted: 2 of 3
    assert book.record("away", 0, outlier, silences=1) is not None  # 3 of 3: quarantined
    # Each silence buys the grace once: the same count again gives nothing more.
    again = QuarantineBook(after=3, window=6)
    for _ in range(2):
        assert again.record("away", 0, outlier, silences=1) is None
    assert again.record("away", 0, outlier, silences=1) is None
    assert again.record("away", 0, outlier, silences=1) is None
    assert again.record("away", 0, outlier, silences=1) is not None


def test_the_registry_counts_a_silence_longer_than_offline_after() -> None:
    reg = LearnerRegistry(offline_after=10.0)
    for t in (0.0, 1.0, 9.0):  # heartbeats a few seconds apart: no silence
        reg.seen("away", 0, "away", t)
    assert reg.get("away").silences == 0
    reg.seen("away", 0, "away", 30.0)  # 21 s unheard: a cut link
    reg.seen("away", 0, "away", 31.0)
    assert reg.get("away").silences == 1
