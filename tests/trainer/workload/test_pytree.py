from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import pytest
from diloco_trainer.config import ModelConfig
from diloco_trainer.models.gpt import init_params
from diloco_trainer.workload.pytree import LeafNameError, flatten, leaf_names, nest, unflatten


def _flax_style() -> dict[str, dict[str, dict[str, np.ndarray]]]:
    return {
        "params": {
            "Dense_0": {"kernel": np.ones((3, 4), np.float32), "bias": np.zeros(4, np.float32)},
            "Dense_1": {"kernel": np.full((4, 2), 2.0, np.float32)},
        }
    }


def test_a_flax_style_nested_dict_flattens_to_dotted_path_names_and_back() -> None:
    tree = _flax_style()
    flat = flatten(tree)
    assert sorted(flat) == ["params.Dense_0.bias", "params.Dense_0.kernel", "params.Dense_1.kernel"]
    assert flat["params.Dense_0.kernel"] is tree["params"]["Dense_0"]["kernel"]
    doubled = {name: leaf * 2 for name, leaf in flat.items()}
    back = unflatten(tree, doubled)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    np.testing.assert_array_equal(back["params"]["Dense_1"]["kernel"], np.full((4, 2), 4.0))
    nested = nest(flat)
    assert jax.tree_util.tree_structure(nested) == jax.tree_util.tree_structure(tree)


class Layer(NamedTuple):
    w: np.ndarray
    b: np.ndarray


def test_sequence_indices_and_attribute_names_join_into_the_name() -> None:
    tree = {"layers": [Layer(np.ones(2), np.zeros(2)), Layer(np.ones(3), np.zeros(3))]}
    assert leaf_names(tree) == ["layers.0.w", "layers.0.b", "layers.1.w", "layers.1.b"]
    back = unflatten(tree, {name: np.asarray(i) for i, name in enumerate(leaf_names(tree))})
    assert isinstance(back["layers"][1], Layer) and int(back["layers"][1].b) == 3


def test_a_flat_dict_keeps_its_dotted_keys_and_their_order() -> None:
    params = init_params(
        ModelConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, seq_len=4), seed=0
    )
    flat = flatten(params)
    assert list(flat) == list(params)  # same names, same (not sorted) order
    back = unflatten(params, flat)
    assert set(back) == set(params)
    assert all(back[name] is params[name] for name in params)


def test_a_nested_key_holding_the_separator_is_refused() -> None:
    with pytest.raises(LeafNameError, match=r"'Dense\.0' .*contains '\.'"):
        flatten({"params": {"Dense.0": np.ones(2)}})


def test_two_leaves_with_the_same_name_are_refused() -> None:
    with pytest.raises(LeafNameError, match=r"both named 'a\.b'"):
        flatten({"a.b": np.ones(1), "a": {"b": np.ones(1)}})
    with pytest.raises(LeafNameError, match=r"both named 'layers\.1'"):
        flatten({"layers.1": np.ones(1), "layers": [np.ones(1), np.ones(1)]})


def test_unflatten_names_the_missing_and_unexpected_leaves() -> None:
    with pytest.raises(
        LeafNameError, match=r"missing \['params.Dense_1.kernel'\].*unexpected \['x'\]"
    ):
        flat = flatten(_flax_style())
        del flat["params.Dense_1.kernel"]
        unflatten(_flax_style(), flat | {"x": np.ones(1)})


def test_nest_refuses_a_name_that_is_both_a_leaf_and_a_subtree() -> None:
    with pytest.raises(LeafNameError):
        nest({"a": np.ones(1), "a.b": np.ones(1)})
