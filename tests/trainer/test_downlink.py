"""Compressed downlink: the learner's copy follows the syncer's published copy bit for bit, and
error feedback keeps that copy within one step's rounding of the global parameters."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_trainer.downlink import Publication, apply_step, checksum, quantize_step
from diloco_trainer.quantize import dequantize, max_block_error_bound
from diloco_trainer.wire import WireError, decode_download, decode_params, encode_step

SHAPES = {"w": (24, 16), "b": (16,)}


def walk(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Global parameters along a run: a start plus small correlated outer updates."""
    rng = np.random.default_rng(seed)
    current = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    drift = {n: rng.normal(size=s).astype(np.float32) * 1e-3 for n, s in SHAPES.items()}
    out = [current]
    for _ in range(steps):
        current = {
            n: (v + drift[n] + rng.normal(size=v.shape).astype(np.float32) * 1e-3)
            for n, v in current.items()
        }
        out.append(current)
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_learner_rebuilds_the_published_copy_exactly_from_wire_steps(scheme: str) -> None:
    targets = walk(40)
    pub = Publication(0, dict(targets[0]))
    learner = dict(targets[0])
    for version, target in enumerate(targets[1:], start=1):
        before = pub.tensors
        pub = pub.advance(target, version, scheme, 32)  # type: ignore[arg-type]
        assert pub.step is not None
        got = decode_download(encode_step(pub.step, 2, version - 1, version, "e1", pub.checksum))
        assert got.step and got.from_version == version - 1 and got.versions == [version]
        assert got.fragment == 2 and got.epoch == "e1"
        learner = apply_step(learner, got.tensors)
        assert checksum(learner) == got.checksum
        for name in SHAPES:
            np.testing.assert_array_equal(learner[name], pub.tensors[name])
            # Error feedback: what the copy still owes is this step's rounding, nothing older.
            owed = np.abs(target[name] - pub.tensors[name]).ravel()
            bound = max_block_error_bound(target[name] - before[name], scheme, 32)  # type: ignore[arg-type]
            padded = np.zeros(bound.size * 32, dtype=np.float32)
            padded[: owed.size] = owed
            assert np.all(padded.reshape(-1, 32).max(axis=1) <= bound * (1 + 1e-5) + 1e-7)


def test_error_feedback_keeps_the_copy_closer_than_quantizing_each_update() -> None:
    targets = walk(60, seed=1)
    pub = Publication(0, dict(targets[0]))
    naive = dict(targets[0])
    for version in range(1, len(targets)):
        pub = pub.advance(targets[version], version, "int4", 32)
        update = {n: targets[version][n] - targets[version - 1][n] for n in SHAPES}
        step = quantize_step({n: np.zeros_like(v) for n, v in update.items()}, update, "int4", 32)
        naive = apply_step(naive, {n: dequantize(q) for n, q in step.items()})
    final = targets[-1]
    naive_lag = Publication(0, naive).lag(final)
    assert pub.lag(final) < naive_lag / 3, (pub.lag(final), naive_lag)


def test_a_publication_advances_one_version_at_a_time() -> None:
    targets = walk(2)
    pub = Publication(3, dict(targets[0]))
    with pytest.raises(ValueError, match="cannot advance to 5"):
        pub.advance(targets[1], 5, "int8", 32)


def test_a_step_is_not_parameters_and_a_bad_step_is_refused() -> None:
    pub = Publication(0, dict(walk(1)[0])).advance(walk(1)[1], 1, "int8", 32)
    assert pub.step is not None
    payload = encode_step(pub.step, 0, 0, 1, "e", pub.checksum)
    with pytest.raises(WireError, match="kind must be 'params'"):
        decode_params(payload)
    forged = payload.replace(b'"scheme":"int8"', b'"scheme":"int9"')
    assert forged != payload
    with pytest.raises(WireError, match="scheme"):
        decode_download(forged)
