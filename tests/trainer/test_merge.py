"""Merge math on constructed vectors: weights, RDA vs plain mean, embeddings, outer step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from diloco_trainer.merge import Contribution, merge_fragment, merge_weights, rda, weighted_mean
from diloco_trainer.outer import OuterOptimizer


def test_weights_are_tokens_squared_over_steps_normalised() -> None:
    w = merge_weights([(10, 1000), (10, 2000), (20, 2000)])
    raw = np.array([1000**2 / 10, 2000**2 / 10, 2000**2 / 20])
    np.testing.assert_allclose(w, raw / raw.sum())
    np.testing.assert_allclose(w.sum(), 1.0)


def test_weights_uniform_when_off_or_degenerate() -> None:
    np.testing.assert_allclose(merge_weights([(1, 5), (9, 1)], token_weighting=False), [0.5, 0.5])
    np.testing.assert_allclose(merge_weights([(0, 0), (0, 0)]), [0.5, 0.5])
    np.testing.assert_allclose(merge_weights([(0, 0), (4, 8)]), [0.0, 1.0])


@pytest.mark.parametrize("m", [2, 4, 16])
def test_rda_keeps_norm_where_mean_of_orthogonal_deltas_shrinks(m: int) -> None:
    dim = 32
    deltas = [np.eye(dim, dtype=np.float32)[i] * 3.0 for i in range(m)]
    w = np.full(m, 1.0 / m)
    mean_norm = float(np.linalg.norm(weighted_mean(deltas, w)))
    rda_norm = float(np.linalg.norm(rda(deltas, w)))
    assert math.isclose(mean_norm, 3.0 / math.sqrt(m), rel_tol=1e-5)
    assert math.isclose(rda_norm, 3.0, rel_tol=1e-5)
    # Same direction as the mean: RDA only restores the radius here.
    direction = weighted_mean(deltas, w) / mean_norm
    np.testing.assert_allclose(rda(deltas, w) / rda_norm, direction, atol=1e-6)


def test_rda_radius_is_weighted_mean_of_norms_and_direction_of_unit_vectors() -> None:
    a = np.array([4.0, 0.0], dtype=np.float32)
    b = np.array([0.0, 1.0], dtype=np.float32)
    w = np.array([0.25, 0.75])
    out = rda([a, b], w)
    assert math.isclose(float(np.linalg.norm(out)), 0.25 * 4 + 0.75 * 1, rel_tol=1e-6)
    # Direction: 0.25*[1,0] + 0.75*[0,1] normalised (norms do not tilt it toward the big delta).
    expected_dir = np.array([0.25, 0.75]) / math.hypot(0.25, 0.75)
    np.testing.assert_allclose(out / np.linalg.norm(out), expected_dir, atol=1e-6)


def test_rda_guards_zero_and_cancelling_deltas() -> None:
    z = np.zeros(4, dtype=np.float32)
    v = np.array([1.0, 2.0, 2.0, 0.0], dtype=np.float32)
    out = rda([z, v], np.array([0.5, 0.5]))
    np.testing.assert_allclose(np.linalg.norm(out), 1.5, rtol=1e-6)  # radius counts the zero as 0
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(rda([v, -v], np.array([0.5, 0.5])), np.zeros(4))
    np.testing.assert_array_equal(rda([z, z], np.array([0.5, 0.5])), np.zeros(4))


def test_merge_fragment_averages_embeddings_plainly_and_rdas_the_rest() -> None:
    e1, e2 = np.array([[2.0, 0.0]], np.float32), np.array([[0.0, 2.0]], np.float32)
    contribs = [
        Contribution({"embed": e1, "w": e1[0]}, c_steps=1, c_tokens=10),
        Contribution({"embed": e2, "w": e2[0]}, c_steps=1, c_tokens=10),
    ]
    merged = merge_fragment(contribs, method="rda")
    np.testing.assert_allclose(merged["embed"], [[1.0, 1.0]])
    assert math.isclose(float(np.linalg.norm(merged["w"])), 2.0, rel_tol=1e-6)
    plain = merge_fragment(contribs, method="mean")
    np.testing.assert_allclose(plain["w"], [1.0, 1.0])


def test_merge_fragment_weights_contributions() -> None:
    a = {"x": np.array([1.0, 0.0], np.float32)}
    b = {"x": np.array([0.0, 1.0], np.float32)}
    merged = merge_fragment([Contribution(a, 1, 30), Contribution(b, 1, 10)], method="mean")
    np.testing.assert_allclose(merged["x"], [0.9, 0.1], rtol=1e-6)


def test_merge_fragment_rejects_mismatched_leaves() -> None:
    with pytest.raises(ValueError, match="different leaves"):
        merge_fragment(
            [Contribution({"x": np.ones(2)}, 1, 1), Contribution({"y": np.ones(2)}, 1, 1)]
        )


def test_outer_sgd_moves_toward_learners_with_nesterov_momentum() -> None:
    opt = OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True)
    theta = {"w": np.array([1.0, 1.0], np.float32)}
    state = opt.init(theta)
    delta = {"w": np.array([0.2, -0.2], np.float32)}  # learners went to theta - delta
    theta1, state = opt.step(theta, state, delta)
    # Nesterov first step: trace = g; update = -lr * (g + mu * trace) = -lr * 1.9 g
    np.testing.assert_allclose(
        theta1["w"], [1.0 - 0.5 * 1.9 * 0.2, 1.0 + 0.5 * 1.9 * 0.2], rtol=1e-6
    )
    theta2, state = opt.step(theta1, state, delta)
    # second: trace = g + 0.9 g = 1.9 g; update = -lr (g + 0.9 * 1.9 g) = -lr * 2.71 g
    np.testing.assert_allclose(theta2["w"][0], theta1["w"][0] - 0.5 * 2.71 * 0.2, rtol=1e-6)
    assert theta["w"][0] == 1.0  # inputs are never modified


def test_outer_state_round_trips_through_leaves() -> None:
    opt = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    theta = {"a": np.ones((2, 3), np.float32), "b": np.zeros(4, np.float32)}
    state = opt.init(theta)
    _, state = opt.step(
        theta, state, {"a": np.full((2, 3), 0.1, np.float32), "b": np.ones(4, np.float32)}
    )
    restored = opt.state_from_leaves(theta, opt.state_leaves(state))
    for x, y in zip(opt.state_leaves(state), opt.state_leaves(restored), strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="expected"):
        opt.state_from_leaves(theta, [])


def test_participation_share_adds_up_to_one_round() -> None:
    from diloco_trainer.merge import participation_share

    # Four learners merged one at a time contribute a quarter each: one full round in total.
    assert sum(participation_share(1, 4) for _ in range(4)) == pytest.approx(1.0)
    assert participation_share(4, 4) == 1.0
    # A learner that pushed but is not (yet) counted online never scales above 1.
    assert participation_share(3, 2) == 1.0
    with pytest.raises(ValueError):
        participation_share(0, 4)


def test_scale_delta_keeps_float32_and_direction() -> None:
    from diloco_trainer.merge import scale_delta

    delta = {"w": np.array([1.0, -2.0], dtype=np.float32)}
    out = scale_delta(delta, 0.25)
    assert out["w"].dtype == np.float32
    np.testing.assert_allclose(out["w"], [0.25, -0.5])


def test_round_momentum_with_full_shares_is_optax_nesterov() -> None:
    plain = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    rounds = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True, per_round=True)
    theta = {"w": np.array([1.0, -2.0, 0.5], np.float32)}
    a, b = theta, theta
    sa, sb = plain.init(theta), rounds.init(theta)
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = {"w": rng.normal(size=3).astype(np.float32)}
        a, sa = plain.step(a, sa, g)
        b, sb = rounds.step(b, sb, g, share=1.0)
        np.testing.assert_allclose(a["w"], b["w"], rtol=1e-5, atol=1e-6)


def test_round_momentum_applies_a_split_round_like_one_synchronous_step() -> None:
    # Round 1 arrives as four quarter-share merges, round 2 as one full merge; the momentum must
    # move once per round, so at each round's end theta equals two synchronous Nesterov steps on
    # the rounds' summed gradients.
    sync = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    rounds = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True, per_round=True)
    theta = {"w": np.array([1.0, 1.0], np.float32)}
    parts = [np.array(v, np.float32) for v in ([0.1, 0.0], [0.0, 0.2], [0.05, 0.05], [0.1, -0.1])]
    s_theta, s_state = sync.step(theta, sync.init(theta), {"w": sum(parts)})
    r_theta, r_state = theta, rounds.init(theta)
    for i, part in enumerate(parts):
        r_theta, r_state = rounds.step(r_theta, r_state, {"w": part}, share=0.25)
        if i < 3:  # mid-round: only the plain SGD part so far
            expected = theta["w"] - 0.7 * sum(parts[: i + 1])
            np.testing.assert_allclose(r_theta["w"], expected, rtol=1e-5)
    np.testing.assert_allclose(r_theta["w"], s_theta["w"], rtol=1e-5)
    second = {"w": np.array([0.3, -0.1], np.float32)}
    s_theta, _ = sync.step(s_theta, s_state, second)
    r_theta, _ = rounds.step(r_theta, r_state, second, share=1.0)
    np.testing.assert_allclose(r_theta["w"], s_theta["w"], rtol=1e-5)


def _reference_merge(
    deltas: list[dict[str, np.ndarray]], weights: np.ndarray, method: str
) -> dict[str, np.ndarray]:
    """RDA written out as in its definition, in float64: radius = sum w_i |d_i|, direction =
    sum w_i d_i / |d_i| normalised; embeddings and method "mean" plainly weighted-averaged."""
    out: dict[str, np.ndarray] = {}
    for name in deltas[0]:
        leaves = [d[name].astype(np.float64) for d in deltas]
        if method == "mean" or name.startswith("embed"):
            out[name] = sum(w * x for w, x in zip(weights, leaves, strict=True))
            continue
        norms = [float(np.linalg.norm(x)) for x in leaves]
        radius = sum(w * n for w, n in zip(weights, norms, strict=True))
        direction = sum(w * x / n for w, x, n in zip(weights, leaves, norms, strict=True) if n > 0)
        out[name] = radius * direction / np.linalg.norm(direction)
    return out


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_merge_fragment_equals_reference_on_random_deltas(method: str) -> None:
    # Leaf sizes below, at and across the accumulation block (merge.BLOCK), a 2-D matrix, an
    # embedding, and one learner whose delta of "w_big" is exactly zero.
    from diloco_trainer.merge import BLOCK

    rng = np.random.default_rng(7)
    shapes = {
        "embed": (64, 48),
        "ln": (48,),
        "w_mat": (96, 200),
        "w_block": (BLOCK,),
        "w_big": (3 * BLOCK + 123,),
    }
    deltas = [
        {
            n: (rng.standard_normal(s) * rng.uniform(1e-4, 1e-1)).astype(np.float32)
            for n, s in shapes.items()
        }
        for _ in range(5)
    ]
    deltas[2]["w_big"][:] = 0.0
    counters = [(50, 4096 * (1 + m % 3)) for m in range(5)]
    contributions = [Contribution(d, s, t) for d, (s, t) in zip(deltas, counters, strict=True)]
    merged = merge_fragment(contributions, method=method)  # type: ignore[arg-type]
    expected = _reference_merge(deltas, merge_weights(counters), method)
    assert sorted(merged) == sorted(expected)
    for name, ref in expected.items():
        got = merged[name]
        assert got.dtype == np.float32 and got.shape == ref.shape, name
        np.testing.assert_allclose(
            got, ref, rtol=2e-5, atol=1e-6 * float(np.abs(ref).max()), err_msg=name
        )
        assert got.ctypes.data % 64 == 0, f"{name}: not 64-byte aligned for the outer step"


def _random_fragment(seed: int, learners: int) -> list[dict[str, np.ndarray]]:
    from diloco_trainer.merge import BLOCK

    rng = np.random.default_rng(seed)
    shapes = {"embed": (40, 24), "ln": (24,), "w": (2 * BLOCK + 77,), "w_mat": (64, 90)}
    return [
        {
            n: (rng.standard_normal(s) * rng.uniform(1e-4, 1e-1)).astype(np.float32)
            for n, s in shapes.items()
        }
        for _ in range(learners)
    ]


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_outer_gradient_with_measured_norms_and_share_equals_reference(method: str) -> None:
    # The syncer's path: leaf norms measured at push decoding (float64) for some contributions,
    # none for a summed one, the participation share folded into the per-leaf factors.
    from diloco_trainer.merge import merge_outer_gradient
    from diloco_trainer.syncer.fragment import leaf_norms

    deltas = _random_fragment(11, 4)
    originals = [{n: v.copy() for n, v in d.items()} for d in deltas]
    counters = [(50, 4096), (25, 8192), (50, 12288), (10, 4096)]
    contributions = [
        Contribution(d, s, t, None if m == 1 else leaf_norms(d))
        for m, (d, (s, t)) in enumerate(zip(deltas, counters, strict=True))
    ]
    share = 0.375
    grad = merge_outer_gradient(contributions, method, token_weighting=True, share=share)  # type: ignore[arg-type]
    expected = _reference_merge(deltas, merge_weights(counters), method)
    dense = grad.dense()
    for name, ref in expected.items():
        got = grad.directions[name].astype(np.float64) * grad.scales[name]
        tol = 1e-6 * float(np.abs(ref).max())
        np.testing.assert_allclose(got, share * ref, rtol=2e-5, atol=tol, err_msg=name)
        np.testing.assert_allclose(dense[name], share * ref, rtol=2e-5, atol=tol, err_msg=name)
        assert grad.directions[name].ctypes.data % 64 == 0, name
        assert np.shares_memory(grad.directions[name], grad.packed), name
        assert dense[name].dtype == np.float32 and dense[name].ctypes.data % 64 == 0, name
    for before, after in zip(originals, deltas, strict=True):  # the deltas are only read
        for name in before:
            np.testing.assert_array_equal(before[name], after[name])
    # dense() leaves the directions as they were: a second call gives the same arrays.
    for name, leaf in grad.dense().items():
        np.testing.assert_array_equal(leaf, dense[name])


@pytest.mark.parametrize("per_round", [False, True])
def test_merge_and_step_equals_merge_then_scaled_outer_step(per_round: bool) -> None:
    # The fused path (factors applied inside the jitted step) against the plain one: a dense
    # reference merge, scaled by the share, then the outer step, over three merges.
    from diloco_trainer.merge import scale_delta
    from diloco_trainer.outer import merge_and_step

    opt = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True, per_round=per_round)
    rng = np.random.default_rng(3)
    first = _random_fragment(5, 3)
    theta = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in first[0].items()}
    fused, fused_state = theta, opt.init(theta)
    plain, plain_state = theta, opt.init(theta)
    for seed, share in ((5, 0.5), (6, 0.5), (7, 1.0)):
        deltas = _random_fragment(seed, 3)
        counters = [(50, 4096 * (1 + m)) for m in range(3)]
        contributions = [Contribution(d, s, t) for d, (s, t) in zip(deltas, counters, strict=True)]
        fused, fused_state = merge_and_step(
            opt, fused, fused_state, contributions, "rda", True, share
        )
        ref = _reference_merge(deltas, merge_weights(counters), "rda")
        grad = scale_delta({n: v.astype(np.float32) for n, v in ref.items()}, share)
        plain, plain_state = opt.step(plain, plain_state, grad, share)
        for name in theta:
            np.testing.assert_allclose(fused[name], plain[name], rtol=1e-5, atol=1e-6)


def test_outer_step_rejects_leaves_unlike_the_fragments() -> None:
    from diloco_trainer.merge import merge_outer_gradient

    opt = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    theta = {"w": np.ones(3, np.float32)}
    state = opt.init(theta)
    with pytest.raises(ValueError, match="shape"):
        opt.step(theta, state, {"w": np.ones(4, np.float32)})
    other = merge_outer_gradient([Contribution({"v": np.ones(3, np.float32)}, 1, 1)])
    with pytest.raises(ValueError, match="leaves differ"):
        opt.step_gradient(theta, state, other)


def test_merge_trusts_the_norms_a_contribution_carries() -> None:
    # Norms given with a contribution are used as they are (the syncer measured them when the
    # push was decoded): here a's is stated as 8 where its values give 4.
    a = {"w": np.array([4.0, 0.0], np.float32)}
    b = {"w": np.array([0.0, 1.0], np.float32)}
    merged = merge_fragment([Contribution(a, 1, 1, {"w": 8.0}), Contribution(b, 1, 1)])
    radius = 0.5 * 8.0 + 0.5 * 1.0
    direction = np.array([0.5 * 4.0 / 8.0, 0.5 * 1.0 / 1.0])
    np.testing.assert_allclose(merged["w"], radius * direction / np.linalg.norm(direction))


def test_outer_step_reuses_its_own_outputs_and_forgets_them_when_dropped() -> None:
    # The params a step returns come back as the next step's: the step reads the array behind
    # them instead of transferring them again. Same numbers as with fresh copies of them.
    import gc

    opt = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    theta = {"a": np.ones((4, 5), np.float32), "b": np.zeros(7, np.float32)}
    delta = {"a": np.full((4, 5), 0.1, np.float32), "b": np.full(7, -0.2, np.float32)}
    theta1, state1 = opt.step(theta, opt.init(theta), delta)
    known = opt._views._arrays
    assert {id(v) for v in theta1.values()} <= set(known)
    assert opt._views.on_device(theta1["a"]) is known[id(theta1["a"])][1]
    assert opt._views.on_device(theta1["a"].copy()) is not known[id(theta1["a"])][1]
    reused, _ = opt.step(theta1, state1, delta)
    fresh, _ = opt.step({k: v.copy() for k, v in theta1.items()}, state1, delta)
    for name in theta:
        np.testing.assert_array_equal(reused[name], fresh[name])
    del theta1, reused, fresh
    gc.collect()
    assert known == {}
