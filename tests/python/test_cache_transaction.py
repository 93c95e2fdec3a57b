"""Whole-cache operations are one C++ transaction (rwd::Cache over every layer's parts): one refused at the last
layer, or at layer N, leaves every layer exactly as it was, and says so in the C++ cache's words."""

import copy
import os

import pytest
import torch

import rewind
from conftest import kv


def state(cache):
    """Everything a later forward reads from each layer: lengths, batch sizes, keys, values, conv and recurrent
    states, recording (copies)."""
    out = []
    for layer in cache.layers:
        entry = {"L": layer.get_seq_length(), "B": layer.batch_size, "R": layer.recording_capacity()}
        for name in ("keys", "values", "indexer_keys"):
            t = getattr(layer, name, None)
            entry[name] = None if t is None else t.clone()
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            entry[name] = None if states is None else {i: (None if t is None else t.clone()) for i, t in states.items()}
        out.append(entry)
    return out


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def module_sources():
    """The Python text of the package: a message it does not contain came from C++."""
    folder = os.path.dirname(rewind.__file__)
    return "".join(open(os.path.join(folder, f)).read() for f in os.listdir(folder) if f.endswith(".py"))


def small_then_big(batch=2, recording=None):
    """Two small full-attention layers and a big last one (8 heads of 64), 5 tokens, batch rows that differ."""
    c = rewind.DynamicCache()
    if recording:
        c.activate_past_recording(recording)
    for i, (heads, dim) in enumerate([(1, 2), (1, 2), (8, 64)]):
        k = kv(0, 5, heads=heads, dim=dim, batch=batch)
        c.update(k, k + 0.5, i)
    return c


def budget_for_small_layers(c):
    """A cap with room for a copy of each small layer and not for one of the big last layer."""
    small = sum(m["bytes_reserved"] for m in c.memory()["layers"][:2])
    return c.budget_reserved() + 2 * small + 1024


@pytest.mark.parametrize("operation", [
    lambda c: c.reorder_cache([1, 0]),
    lambda c: c.batch_select_indices([1]),
    lambda c: c.batch_repeat_interleave(2),
])
def test_batch_operation_refused_at_the_last_layer_changes_no_layer(operation):
    c = small_then_big()
    before = state(c)
    c.set_memory_budget(budget_for_small_layers(c))
    with pytest.raises(rewind.CapacityError, match="memory budget") as e:
        operation(c)
    assert same(state(c), before)
    message = str(e.value)
    assert "nothing was changed" in message
    c.set_memory_budget(0)
    operation(c)  # without the cap it runs, on every layer
    assert len({layer.batch_size for layer in c.layers}) == 1


def test_reorder_refused_by_the_budget_keeps_rows_of_every_layer():
    c = small_then_big()
    row1 = [layer.keys[1].clone() for layer in c.layers]
    c.set_memory_budget(budget_for_small_layers(c))
    with pytest.raises(rewind.CapacityError):
        c.reorder_cache([1, 0])
    assert all(torch.equal(layer.keys[1], r) for layer, r in zip(c.layers, row1))  # layer 0 was not reordered
    c.set_memory_budget(0)
    c.reorder_cache([1, 0])
    assert all(torch.equal(layer.keys[0], r) for layer, r in zip(c.layers, row1))


def test_index_invalid_at_layer_2_only_changes_no_layer():
    c = rewind.DynamicCache()
    for i, batch in enumerate([2, 2, 1]):  # the last layer holds one row: index 1 is valid for the others only
        k = kv(0, 4, batch=batch)
        c.update(k, k, i)
    before = state(c)
    with pytest.raises(rewind.IndexError) as e:
        c.batch_select_indices([1])
    assert same(state(c), before)
    message = str(e.value)
    assert "layer 2" in message and "[0, 1)" in message
    assert message not in module_sources()


def test_reorder_of_the_wrong_length_is_refused_in_cpp_and_changes_nothing():
    c = small_then_big(batch=3)
    before = state(c)
    with pytest.raises(rewind.InvalidArgument) as e:
        c.reorder_cache([2, 1])
    assert same(state(c), before)
    assert str(e.value) not in module_sources()


def test_crop_refused_at_the_last_layer_changes_no_layer_and_the_message_is_cpps():
    c = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention", "linear_attention"],
                            sliding_window=4, conv_kernel_size=3)
    c.activate_past_recording(2)
    for t in range(6):
        k = kv(t, 1)
        c.update(k, k, 0)
        c.update(k, k, 1)
        c.update_conv_state(torch.full((1, 2, 1), float(t)), 2)
        c.update_recurrent_state(torch.full((1, 2, 2), float(t)), 2)
    before = state(c)
    with pytest.raises(rewind.RollbackError) as e:
        c.crop(-3)  # deeper than the recording of every layer; the full-attention layer alone could crop
    assert same(state(c), before)
    assert str(e.value) not in module_sources()
    c.crop(-2)
    assert [layer.get_seq_length() for layer in c.layers] == [4, 4, 4]


def test_recording_refused_by_the_budget_at_the_last_layer_changes_no_layer():
    c = rewind.DynamicCache(layer_types=["linear_attention", "linear_attention"], conv_kernel_size=2)
    for i, size in enumerate([2, 32]):  # the last layer's states are much bigger
        c.update_conv_state(torch.randn(1, 2, 1), i)
        c.update_recurrent_state(torch.randn(1, size, size), i)
    before = state(c)
    c.set_memory_budget(c.budget_reserved() + 4096)  # snapshot slots for the first layer only
    with pytest.raises(rewind.CapacityError, match="memory budget"):
        c.activate_past_recording(8)
    assert same(state(c), before)
    assert [layer.is_recording() for layer in c.layers] == [False, False] and c.max_rollback() == 0


def test_out_of_step_layers_are_named_by_the_cpp_cache():
    c = rewind.DynamicCache()
    for i in range(3):
        c.update(kv(0, 3), kv(0, 3), i)
    c.update(kv(3, 1), kv(3, 1), 0)  # a forward that stopped after layer 0
    before = state(c)
    for operation in (lambda: c.reorder_cache([0]), lambda: c.activate_past_recording(2), lambda: c.crop(-1)):
        with pytest.raises(rewind.StateError, match=r"out of step \(layer 0: 4, layer 1: 3, layer 2: 3\)"):
            operation()
        assert same(state(c), before)
    c.reset()  # the way back, on every layer at once
    assert [layer.get_seq_length() for layer in c.layers] == [0, 0, 0]


def test_parts_of_one_layer_are_one_transaction():
    """A hybrid layer's parts (attention, conv, recurrent) change together or not at all."""
    layer = rewind.LinearAttentionAndFullAttentionLayer(conv_kernel_size=2)
    for t in range(3):
        layer.update(kv(t, 1), kv(t, 1))
        layer.update_conv_state(torch.full((1, 2, 1), float(t)))
        layer.update_recurrent_state(torch.full((1, 2, 2), float(t)))
    layer.update(kv(3, 1), kv(3, 1))  # the attention part alone moved on
    with pytest.raises(rewind.StateError, match="out of step"):
        layer.reorder_cache([0])
    with pytest.raises(rewind.StateError, match="out of step"):
        layer.activate_past_recording(2)
    assert not layer.is_recording()
    assert [layer.conv_states[0].shape[-1], layer.get_seq_length()] == [2, 4]


def test_encoder_decoder_batch_operation_refused_on_the_cross_part_changes_neither():
    self_part, cross_part = rewind.DynamicCache(), rewind.DynamicCache()
    k = kv(0, 3, batch=2)
    self_part.update(k, k, 0)
    big = kv(0, 16, heads=8, dim=64, batch=2)
    cross_part.update(big, big, 0)
    c = rewind.EncoderDecoderCache(self_part, cross_part)
    before = (state(self_part), state(cross_part))
    small = c.memory()["self_attention"]["bytes_reserved"]
    c.set_memory_budget(self_part.budget_reserved() + 2 * small + 1024)  # both parts count in this one cap
    with pytest.raises(rewind.CapacityError, match="memory budget"):
        c.reorder_cache([1, 0])
    assert same((state(self_part), state(cross_part)), before)
    c.set_memory_budget(0)
    c.reorder_cache([1, 0])
    assert torch.equal(self_part.layers[0].keys[0], before[0][0]["keys"][1])
    assert torch.equal(cross_part.layers[0].keys[0], before[1][0]["keys"][1])


def test_deepcopy_keeps_the_copy_in_its_own_budget():
    c = small_then_big(recording=2)
    d = copy.deepcopy(c)
    d.set_memory_budget(budget_for_small_layers(d))
    with pytest.raises(rewind.CapacityError):
        d.reorder_cache([1, 0])
    c.reorder_cache([1, 0])  # the original's budget has no cap
    assert d.budget_reserved() > 0 and c.budget_reserved() > 0


def test_a_warning_handler_that_reads_the_cache_mid_crop_gets_state_error_not_a_crash():
    c = rewind.DynamicCache(layer_types=["full_attention", "full_attention"])
    for i in range(2):
        c.update(kv(0, 6), kv(0, 6), i)
    seen = []

    def handler(message):
        try:
            seen.append(c.layers[1].keys.shape)
        except rewind.StateError as e:
            seen.append(str(e))

    rewind.reset_one_time_warnings()
    rewind.set_warning_handler(handler)
    try:
        c.crop(4)  # positive (deprecated): warns once, from inside the C++ crop
    finally:
        rewind.set_warning_handler(rewind._warn)  # the module's default: FutureWarning
    assert len(seen) == 1 and "in the middle of a whole-cache operation" in seen[0]
    assert [layer.get_seq_length() for layer in c.layers] == [4, 4]
