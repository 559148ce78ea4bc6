"""Layer id semantics and their mapping to vLLM's aux ids."""

import pytest

from speculators_v016.layers import LayerIdError, LayerPlan, default_layer_ids


def test_default_is_upstreams():
    """Default ids are upstream's [2, n//2, n-3, n-1]."""
    assert default_layer_ids(32) == [2, 16, 29, 31]
    assert LayerPlan.build(61, None).layer_ids == (2, 30, 58, 60)


def test_default_merges_duplicates_for_tiny_models():
    """Tiny models whose default ids coincide get each layer once, in order."""
    assert default_layer_ids(6) == [2, 3, 5]


def test_vllm_ids_are_one_higher():
    """Our id L (output of layer L) is vLLM's aux id L+1 (input of layer L+1)."""
    plan = LayerPlan.build(32, [2, 16, 29, 31])
    assert plan.vllm_ids == (3, 17, 30, 32)
    assert plan.serving_ids == [3, 17, 30]


def test_request_order_is_kept():
    """Unsorted ids come back in request order; capture runs ascending."""
    plan = LayerPlan.build(8, [5, 1, 7])
    assert plan.capture_ids == (2, 6, 8)
    assert plan.capture_order == (1, 0, 2)


@pytest.mark.parametrize(
    "ids, message",
    [
        ([8], "out of range"),
        ([-1], "out of range"),
        ([1, 1], "more than once"),
        ([], "empty"),
        ([1.5], "integers"),
    ],
)
def test_invalid_ids_are_refused(ids, message):
    """Out-of-range, duplicate, empty and non-integer ids raise LayerIdError."""
    with pytest.raises(LayerIdError, match=message):
        LayerPlan.build(8, ids)


def test_describe_records_both_conventions():
    """The recorded mapping names our ids, vLLM's ids and the serving ids."""
    info = LayerPlan.build(8, [2, 4, 5, 7]).describe()
    assert info["vllm_aux_hidden_state_ids"] == [3, 5, 6, 8]
    assert info["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
    assert info["num_hidden_layers"] == 8
