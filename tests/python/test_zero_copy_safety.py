"""Zero-copy results and lifetime safety: a returned tensor shares the cache's memory, and no Python code can make
it read freed memory (old views of moved buffers, views that outlive their cache)."""

import gc

import numpy as np
import pytest
import torch

import rewind
from conftest import conv_in, kv, positions


@pytest.mark.zero_copy
def test_returned_tensors_share_the_cache_memory():
    layer = rewind.DynamicLayer()
    keys, values = layer.update(kv(0, 4), kv(0, 4))
    assert keys.data_ptr() == layer.keys.data_ptr()
    assert values.data_ptr() == layer.values.data_ptr()
    # writing through the view is seen by the cache: the same memory, not a copy
    keys[0, 0, 0, 0] = -7.0
    assert layer.keys[0, 0, 0, 0].item() == -7.0
    conv = rewind.LinearAttentionLayer(conv_kernel_size=3)
    conv.update_conv_state(conv_in(0, 5))
    state = conv.conv_states[0]
    assert state.data_ptr() == conv.conv_states[0].data_ptr()
    rec = rewind.LinearAttentionLayer()
    got = rec.update_recurrent_state(torch.ones(1, 3))
    assert got.data_ptr() == rec.recurrent_states[0].data_ptr()


@pytest.mark.zero_copy
def test_crop_moves_no_data(device):
    layer = rewind.DynamicLayer()
    layer.update(kv(0, 10, device=device), kv(0, 10, device=device))
    before = layer.keys.data_ptr()
    layer.crop(-4)
    assert layer.keys.data_ptr() == before and positions(layer.keys) == list(range(6))


@pytest.mark.zero_copy
def test_old_views_survive_growth_and_stay_readable(device):
    gc.collect()
    baseline = rewind.pin_stats()["zombie_blocks"]
    layer = rewind.DynamicLayer()
    first, _ = layer.update(kv(0, 3, device=device), kv(0, 3, device=device))
    expected = first.clone()
    views = [first]
    for step in range(300):  # many reallocations while old views live
        keys, _ = layer.update(kv(3 + step, 1, device=device), kv(3 + step, 1, device=device))
        if step % 50 == 0:
            views.append(keys)
    stats = rewind.pin_stats()
    assert stats["zombie_blocks"] > baseline  # buffers the layer freed, kept for the views
    assert torch.equal(views[0], expected)  # the old buffer is intact: it was never handed back
    for v in views:
        float(v.sum())  # every view readable
    del views, first, keys, v
    gc.collect()
    assert rewind.pin_stats()["zombie_blocks"] <= baseline  # released with the last view


@pytest.mark.zero_copy
def test_view_outlives_its_cache(device):
    gc.collect()
    baseline = rewind.pin_stats()["zombie_blocks"]
    c = rewind.DynamicCache(layer_types=["full_attention", "conv"], conv_kernel_size=4)
    keys, values = c.update(kv(0, 8, device=device), kv(0, 8, device=device), 0)
    window = c.update_conv_state(conv_in(0, 8, device=device), 1)
    expected = keys.clone(), window.clone()
    del c
    gc.collect()
    assert torch.equal(keys, expected[0]) and torch.equal(window, expected[1])
    assert rewind.pin_stats()["zombie_blocks"] > baseline
    del keys, values, window
    gc.collect()
    assert rewind.pin_stats()["zombie_blocks"] <= baseline


@pytest.mark.zero_copy
def test_numpy_views_pin_too():
    gc.collect()
    baseline = rewind.pin_stats()["zombie_blocks"]
    layer = rewind.DynamicLayer()
    keys, _ = layer.update(np.ones((1, 1, 2, 4), np.float32), np.ones((1, 1, 2, 4), np.float32))
    for _ in range(200):
        layer.update(np.zeros((1, 1, 1, 4), np.float32), np.zeros((1, 1, 1, 4), np.float32))
    del layer
    gc.collect()
    np.testing.assert_array_equal(keys, np.ones((1, 1, 2, 4)))
    del keys
    gc.collect()
    assert rewind.pin_stats()["zombie_blocks"] <= baseline


def test_aliasing_input_is_safe(device):
    layer = rewind.DynamicLayer()
    keys, values = layer.update(kv(0, 3, device=device), kv(0, 3, device=device))
    for _ in range(6):  # append the cache's own (growing) view back into it
        keys, values = layer.update(keys, values)
    assert layer.get_seq_length() == 3 * 2**6
    assert positions(layer.keys) == [0, 1, 2] * 2**6


def test_recurrent_handle_keeps_its_layer_alive():
    layer = rewind.LinearAttentionLayer()
    layer.update_recurrent_state(torch.ones(1, 2))
    handle = layer.begin_recurrent_update(1)
    del layer
    gc.collect()
    handle.next(1).fill_(3.0)  # the layer is still alive: no dangling slot
    handle.commit()


def test_stale_view_after_mutation_reads_old_or_new_values_never_freed_memory(device):
    layer = rewind.DynamicSlidingWindowLayer(sliding_window=4)
    layer.activate_past_recording(3)
    keys, _ = layer.update(kv(0, 4, device=device), kv(0, 4, device=device))
    for t in range(4, 400):
        layer.update(kv(t, 1, device=device), kv(t, 1, device=device))
        layer.crop(0) if t % 7 == 0 else None
    values = keys.flatten().tolist()  # stale but readable
    assert len(values) == keys.numel()


def test_memory_budget_refuses_and_changes_nothing():
    c = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention", "linear_attention"],
                            sliding_window=8, conv_kernel_size=4)
    c.activate_past_recording(4)
    assert c.memory_budget() == 0
    k = kv(0, 5, dim=16)
    c.update(k, k, 0)
    c.update(k, k, 1)
    c.update_conv_state(conv_in(0, 5), 2)
    c.update_recurrent_state(torch.ones(1, 3, 3), 2, all_states=torch.ones(5, 1, 3, 3))
    reserved = c.budget_reserved()
    assert reserved >= c.memory()["bytes_reserved"] > 0
    with pytest.raises(rewind.CapacityError, match="already reserves"):
        c.set_memory_budget(reserved - 1)
    assert c.memory_budget() == 0
    c.set_memory_budget(reserved + 4096)
    refused = None
    for t in range(5, 1000):
        before = [c.get_seq_length(i) for i in range(3)], positions(c.layers[0].keys)
        try:
            kk = kv(t, 1, dim=16)
            c.update(kk, kk, 0)
        except rewind.CapacityError as e:
            refused = str(e)
            assert ([c.get_seq_length(i) for i in range(3)], positions(c.layers[0].keys)) == before
            break
        c.update(kk, kk, 1)
        c.update_conv_state(conv_in(t, 1), 2)
        c.update_recurrent_state(torch.ones(1, 3, 3), 2)
        assert c.budget_reserved() <= reserved + 4096
    assert refused is not None and refused.startswith("memory budget of") and "layer 0" in refused
    assert "nothing was changed" in refused
    c.set_memory_budget(0)  # no cap: the same update goes through
    c.update(kk, kk, 0)


def test_budget_refuses_the_first_update_of_a_layer(device):
    c = rewind.DynamicCache(layer_types=["full_attention"])
    c.set_memory_budget(64)
    with pytest.raises(rewind.CapacityError, match="memory budget"):
        c.update(kv(0, 40, dim=16, device=device), kv(0, 40, dim=16, device=device), 0)
    assert c.get_seq_length() == 0 and c.layers[0].keys.shape[-2] == 0
    c.set_memory_budget(0)
    c.update(kv(0, 40, dim=16, device=device), kv(0, 40, dim=16, device=device), 0)
    assert positions(c.layers[0].keys) == list(range(40))


def test_inputs_are_read_in_place():
    base = torch.randn(1, 4, 2, 8)
    view = base.transpose(1, 2)  # [1, 2, 4, 8], not contiguous: no .contiguous() copy is made
    assert rewind._rewind.input_data_ptr(view) == view.data_ptr()
    arr = np.zeros((1, 2, 3, 4), np.float32)[:, :, ::-1]  # negative strides
    assert rewind._rewind.input_data_ptr(arr) == arr.__array_interface__["data"][0]
    layer = rewind.DynamicLayer()
    keys, _ = layer.update(view, view)
    assert torch.equal(keys, view)
    np_layer = rewind.DynamicLayer()
    got, _ = np_layer.update(arr, arr)
    np.testing.assert_array_equal(got, arr)
