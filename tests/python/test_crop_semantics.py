"""The contract's crop semantics (docs/semantics.md sections 3, 4, 7, 8) through the Python classes."""

import pytest
import torch

import rewind
from conftest import conv_in, conv_positions, kv, positions


def worked_cache(R=3):
    c = rewind.DynamicCache(
        layer_types=["full_attention", "sliding_attention", "conv", "deepseek_sparse_attention"],
        sliding_window=12,
        conv_kernel_size=4,
    )
    c.activate_past_recording(R)
    k = kv(0, 45)
    c.update(k, k, 0)
    c.update(k, k, 1)
    c.update_conv_state(conv_in(0, 45), 2)
    c.update(k, k, 3)
    c.update_indexer(torch.arange(45, dtype=torch.float32).view(1, 45, 1).expand(1, 45, 2).contiguous(), 3)
    return c


def test_worked_example_crop_minus_3():
    c = worked_cache()
    c.crop(-3)
    assert positions(c.layers[0].keys) == list(range(0, 42))
    assert positions(c.layers[1].keys) == list(range(31, 42))
    assert conv_positions(c.layers[2].conv_states[0]) == [38, 39, 40, 41]
    assert [int(x) for x in c.layers[3].indexer_keys[0, :, 0].tolist()] == list(range(42))
    assert positions(c.layers[3].keys) == list(range(42))
    assert all(c.get_seq_length(i) == 42 for i in range(4))


def test_worked_example_crop_0():
    c = worked_cache()
    c.crop(0)
    assert positions(c.layers[0].keys) == list(range(45))
    assert positions(c.layers[1].keys) == list(range(34, 45))
    assert conv_positions(c.layers[2].conv_states[0]) == [41, 42, 43, 44]
    assert c.get_seq_length() == 45


def test_worked_example_full_rollback(device):
    c = worked_cache()
    c.crop(-46)
    assert c.get_seq_length() == 0
    for i in (0, 1, 3):
        assert c.layers[i].keys.shape[-2] == 0
    assert c.layers[3].indexer_keys.shape[1] == 0
    assert conv_positions(c.layers[2].conv_states[0]) == [-1, -1, -1, -1]
    assert c.has_previous_state(2) is False
    # appending afterwards behaves like a new cache
    k = kv(0, 2, device=device)
    keys, _ = c.update(k, k, 1)
    assert positions(keys) == [0, 1]


def test_sliding_recording_example(device):
    layer = rewind.DynamicSlidingWindowLayer(sliding_window=8)
    layer.activate_past_recording(2)
    k = kv(0, 12, device=device)
    layer.update(k, k)
    layer.crop(0)
    assert positions(layer.keys) == list(range(5, 12))
    assert layer.get_mask_sizes(4) == (11, 5)
    keys, values = layer.update(kv(12, 4, device=device), kv(12, 4, device=device))
    assert positions(keys) == list(range(5, 16))
    assert positions(values) == list(range(5, 16))
    layer.crop(-2)
    assert positions(layer.keys) == list(range(7, 14))
    assert layer.get_seq_length() == 14


@pytest.mark.parametrize("L,q", [(0, 3), (5, 2), (7, 1), (20, 4)])
def test_mask_sizes_match_what_update_returns(L, q, device):
    W, C = 8, 6
    layers = [rewind.DynamicLayer(), rewind.DynamicSlidingWindowLayer(sliding_window=W), rewind.DynamicChunkedLayer(chunk_size=C)]
    for layer in layers:
        if L:
            layer.update(kv(0, L, device=device), kv(0, L, device=device))
        kv_length, kv_offset = layer.get_mask_sizes(q)
        keys, _ = layer.update(kv(L, q, device=device), kv(L, q, device=device))
        assert positions(keys) == list(range(kv_offset, kv_offset + kv_length))
        assert kv_offset + kv_length == L + q
    # the table of section 5
    assert layers[0].get_mask_sizes(1) == (L + q + 1, 0)
    n = L + q
    assert layers[1].get_mask_sizes(1) == (min(n, W - 1) + 1, max(0, n - W + 1))
    assert layers[2].get_mask_sizes(1) == (n - (n // C) * C + 1, (n // C) * C)


def test_full_attention_crop_transformers_bug_47433(device):
    # transformers kept the whole cache on crop(0) and 1 stale token on crop(-5) of 3 tokens
    layer = rewind.DynamicLayer()
    layer.update(kv(0, 3, device=device), kv(0, 3, device=device))
    layer.crop(0)
    assert layer.get_seq_length() == 3
    layer.crop(-5)
    assert layer.get_seq_length() == 0 and layer.keys.shape[-2] == 0


def test_positive_crop_keeps_prefix_and_warns_once(device):
    rewind.reset_one_time_warnings()
    layer = rewind.DynamicLayer()
    layer.update(kv(0, 10, device=device), kv(0, 10, device=device))
    with pytest.warns(FutureWarning):
        layer.crop(6)
    assert positions(layer.keys) == list(range(6))
    layer.crop(20)  # n >= L is a no-op
    assert layer.get_seq_length() == 6


NOT_RECORDING = (
    "`crop` was called, but the current layer does not track past states. Call `activate_past_recording` before "
    "`crop` to be able to rollback the cache."
)
SLIDING_NOT_RECORDING = (
    "`crop` was called, but the current layer does not track past states, and the sliding window size was already "
    "reached. Call `activate_past_recording` before `crop` to be able to rollback the cache."
)
LINEAR_POSITIVE = (
    "Linear attention layers can only be cropped by passing a negative int, to specify how many tokens to remove"
)
SLIDING_POSITIVE = (
    "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be cropped by passing a "
    "negative int, to specify how many tokens to remove"
)


def test_sliding_without_recording_refuses_past_window(device):
    layer = rewind.DynamicSlidingWindowLayer(sliding_window=8)
    layer.update(kv(0, 12, device=device), kv(0, 12, device=device))
    for n in (-2, 0, 2):
        with pytest.raises(RuntimeError) as e:
            layer.crop(n)
        assert str(e.value).startswith(SLIDING_NOT_RECORDING)
        assert isinstance(e.value, rewind.RollbackError)
    assert layer.get_seq_length() == 12 and positions(layer.keys) == list(range(5, 12))


def test_sliding_before_window_crops_without_recording(device):
    layer = rewind.DynamicSlidingWindowLayer(sliding_window=8)
    layer.update(kv(0, 6, device=device), kv(0, 6, device=device))
    layer.crop(-2)
    assert positions(layer.keys) == [0, 1, 2, 3]


def test_sliding_positive_crop_past_window_with_recording(device):
    layer = rewind.DynamicSlidingWindowLayer(sliding_window=8)
    layer.activate_past_recording(4)
    layer.update(kv(0, 12, device=device), kv(0, 12, device=device))
    with pytest.raises(RuntimeError, match="negative int") as e:
        layer.crop(2)
    assert str(e.value).startswith(SLIDING_POSITIVE)
    layer.crop(-3)
    assert layer.get_seq_length() == 9
    assert layer.keys.shape[-2] == 7


def test_linear_layer_errors(device):
    layer = rewind.LinearAttentionLayer(conv_kernel_size=4)
    with pytest.raises(RuntimeError) as e:
        layer.crop(-1)
    assert str(e.value).startswith(NOT_RECORDING)
    layer.update_conv_state(conv_in(0, 5, device=device))
    with pytest.raises(RuntimeError) as e:
        layer.crop(0)
    assert str(e.value).startswith(NOT_RECORDING)
    layer.activate_past_recording(2)
    with pytest.raises(RuntimeError) as e:
        layer.crop(1)
    assert str(e.value).startswith(LINEAR_POSITIVE)


def test_cache_method_errors_use_transformers_messages(device):
    c = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    with pytest.raises(ValueError, match="^Cannot call `update_conv_state` on a non-LinearAttention layer!$"):
        c.update_conv_state(conv_in(0, 1, device=device), 0)
    with pytest.raises(ValueError) as e:
        c.has_previous_state()
    assert str(e.value) == (
        "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem to only "
        "contain Attention layers."
    )


def test_too_deep_crop_names_layer_and_changes_nothing(device):
    c = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    c.activate_past_recording(2)
    for layer in range(2):
        c.update(kv(0, 10, device=device), kv(0, 10, device=device), layer)
    assert c.max_rollback() == 2
    with pytest.raises(rewind.RollbackError) as e:
        c.crop(-3)
    assert "layer 1" in str(e.value) and "3" in str(e.value)
    # transactional: layer 0 (which could crop) was not cropped either
    assert c.get_seq_length(0) == 10 and c.get_seq_length(1) == 10
    assert positions(c.layers[0].keys) == list(range(10))
    c.check_crop(-2)
    c.crop(-2)
    assert c.get_seq_length(0) == 8 and positions(c.layers[1].keys) == [5, 6, 7]


def test_out_of_step_layers_refuse_whole_cache_operations(device):
    c = rewind.DynamicCache(layer_types=["full_attention", "full_attention"])
    c.update(kv(0, 5, device=device), kv(0, 5, device=device), 0)
    c.update(kv(0, 5, device=device), kv(0, 5, device=device), 1)
    c.update(kv(5, 1, device=device), kv(5, 1, device=device), 0)  # a forward that stopped after layer 0
    with pytest.raises(rewind.StateError, match=r"out of step \(layer 0: 6, layer 1: 5\)"):
        c.crop(-1)
    c.update(kv(5, 1, device=device), kv(5, 1, device=device), 1)
    c.crop(-1)
    assert c.get_seq_length(1) == 5


def test_chunked_layer_keeps_current_chunk(device):
    layer = rewind.DynamicChunkedLayer(chunk_size=4)
    keys, _ = layer.update(kv(0, 6, device=device), kv(0, 6, device=device))
    assert positions(keys) == list(range(6))
    assert positions(layer.keys) == [4, 5]
    keys, _ = layer.update(kv(6, 3, device=device), kv(6, 3, device=device))
    assert positions(keys) == [4, 5, 6, 7, 8]
    assert positions(layer.keys) == [8]
    # without recording it can roll back within its chunk only
    layer.crop(-1)
    assert layer.get_seq_length() == 8
    with pytest.raises(rewind.RollbackError):
        layer.crop(-1)


def test_config_object_and_dict_build_the_same_layers():
    class Config:
        layer_types = ["full_attention", "sliding_attention", "linear_attention", "hybrid", "hybrid_sliding",
                       "chunked_attention", "deepseek_sparse_attention", "conv", "mlp"]
        sliding_window = 5
        attention_chunk_size = 3
        linear_conv_kernel_dim = 4

    c = rewind.DynamicCache(config=Config())
    kinds = [type(x).__name__ for x in c.layers]
    assert kinds == ["DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer",
                     "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer",
                     "DynamicSlidingWindowLayer", "DynamicIndexedLayer", "LinearAttentionLayer", "StatelessLayer"]
    assert c.layers[5].sliding_window == 3  # chunked layers run as windows of the chunk size, as in transformers
    assert c.is_sliding == [False, True, False, False, True, True, False, False, False]
    assert c.is_linear == [False, False, True, False, True, False, False, True, False]
    assert c.layers[2].conv_kernel_size[0] == 4
    assert isinstance(c.layers[3], rewind.DynamicLayer) and isinstance(c.layers[3], rewind.LinearAttentionLayer)
    d = rewind.DynamicCache(config={"num_hidden_layers": 3, "sliding_window": 7})
    assert [x.sliding_window for x in d.layers] == [7, 7, 7]


def test_chunked_layers_of_a_config_keep_what_transformers_keeps(device):
    """transformers' numbers: chunk 4, 8 tokens (a batch row of 7 pads among them): get_mask_sizes(1, 0) is
    (4, 5) and the decode step gets 4 keys, positions 5..8 (the mask, not the cache, applies the chunks)."""
    c = rewind.DynamicCache(config={"layer_types": ["chunked_attention"], "attention_chunk_size": 4})
    c.update(kv(0, 8, batch=2, device=device), kv(0, 8, batch=2, device=device), 0)
    assert c.get_mask_sizes(1, 0) == (4, 5)
    keys, _ = c.update(kv(8, 1, batch=2, device=device), kv(8, 1, batch=2, device=device), 0)
    assert tuple(keys.shape)[2] == 4
    assert positions(keys) == [5, 6, 7, 8]
    assert [int(x) for x in keys[1, 0, :, 0].tolist()] == [1005, 1006, 1007, 1008]  # the padded row keeps as many


def test_transformers_attributes_with_their_defaults(device):
    c = rewind.DynamicCache(config={"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 5})
    assert c.max_cache_len == 5 and c.max_batch_size == -1
    c.update(kv(0, 3, batch=2, device=device), kv(0, 3, batch=2, device=device), 0)
    c.update(kv(0, 3, batch=2, device=device), kv(0, 3, batch=2, device=device), 1)
    assert c.get_query_offset() == 3 and c.max_batch_size == 2
    c.offload(1)
    c.prefetch(1)
    assert positions(c.layers[1].keys) == [0, 1, 2]  # nothing moved or changed
    with pytest.raises(rewind.IndexError):
        c.offload(2)
    assert rewind.DynamicCache(config={"num_hidden_layers": 2}).max_cache_len == -1


def test_default_cache_grows_lazily_and_records(device):
    c = rewind.DynamicCache()
    assert len(c) == 0 and c.get_seq_length() == 0
    assert c.get_mask_sizes(3, 0) == (3, 0)
    c.activate_past_recording()
    c.update(kv(0, 4, device=device), kv(0, 4, device=device), 2)
    assert len(c) == 3 and c.get_seq_length(2) == 4
    assert c.layers[2].is_recording() and c.layers[2].recording_capacity() == rewind.DEFAULT_MAX_ROLLBACK


def test_ddp_cache_data_fills_layers():
    data = [(kv(0, 3), kv(0, 3)), (kv(0, 3), kv(0, 3), torch.tensor([2]))]
    c = rewind.DynamicCache(data)
    assert type(c.layers[1]).__name__ == "DynamicSlidingWindowLayer"
    assert positions(c.layers[0].keys) == [0, 1, 2]
    assert positions(c.layers[1].keys) == [2]


def test_hybrid_layer_crops_both_parts_together():
    layer = rewind.LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=4, conv_kernel_size=3)
    layer.activate_past_recording(3)
    states = []
    for t in range(6):
        layer.update(kv(t, 1), kv(t, 1))
        layer.update_conv_state(conv_in(t, 1))
        s = torch.full((1, 2, 2), float(t + 1))
        states.append(s)
        layer.update_recurrent_state(s)
    layer.crop(-2)
    assert layer.get_seq_length() == 4
    assert positions(layer.keys) == [1, 2, 3]
    assert conv_positions(layer.conv_states[0]) == [1, 2, 3]
    assert torch.equal(layer.recurrent_states[0], states[3])
    assert layer.get_mask_sizes(1) == (4, 1)


def test_encoder_decoder_cache_crops_self_attention_only(device):
    self_attn = rewind.DynamicCache(layer_types=["full_attention"])
    cross = rewind.DynamicCache(layer_types=["full_attention"])
    c = rewind.EncoderDecoderCache(self_attn, cross)
    assert c.is_updated == {0: False}
    cross.update(kv(100, 6, batch=2, device=device), kv(100, 6, batch=2, device=device), 0)
    c.is_updated[0] = True
    c.update(kv(0, 5, batch=2, device=device), kv(0, 5, batch=2, device=device), 0)
    c.crop(-2)
    assert c.get_seq_length() == 3 and cross.get_seq_length(0) == 6
    c.reorder_cache([1, 0])
    assert c.batch_size == 2 and int(cross.layers[0].keys[0, 0, 0, 0]) == 1100
    with pytest.raises(IndexError):
        c.batch_select_indices([3])
    assert int(self_attn.layers[0].keys[0, 0, 0, 0]) == 1000  # nothing changed in either part
    c.reset()
    assert c.is_updated == {0: False} and cross.get_seq_length(0) == 0


def test_iteration_gives_ddp_data_that_rebuilds_the_cache(device):
    c = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention"], sliding_window=3)
    for i in range(2):
        c.update(kv(0, 5, device=device), kv(0, 5, device=device), i)
    d = rewind.DynamicCache(list(c))
    assert type(d.layers[1]).__name__ == "DynamicSlidingWindowLayer" and d.layers[1].sliding_window == 3
    assert positions(d.layers[0].keys) == list(range(5)) and positions(d.layers[1].keys) == [3, 4]


def test_linear_crop_takes_transformers_argument_name(device):
    layer = rewind.LinearAttentionLayer(conv_kernel_size=2)
    layer.activate_past_recording(3)
    layer.update_conv_state(conv_in(0, 4, device=device))
    layer.crop(tokens_to_remove=-1)
    assert layer.get_seq_length() == 3 and conv_positions(layer.conv_states[0]) == [1, 2]


def test_two_layers_grow_independently_and_legacy_format_round_trips():
    prefill = torch.tensor([1.0, 2.0])[None, None, :, None]
    c = rewind.DynamicCache()
    c.update(prefill, prefill, 0)
    c.update(prefill * 10, prefill * 10, 1)
    for v in (3.0, 4.0):
        c.update(torch.tensor(v)[None, None, None, None], torch.tensor(v)[None, None, None, None], 0)
        c.update(torch.tensor(v * 10)[None, None, None, None], torch.tensor(v * 10)[None, None, None, None], 1)
    assert c.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert c.layers[1].keys[0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert c[1][0][0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0]
    with pytest.raises(KeyError):
        c[2]
    legacy = c.to_legacy_cache()
    d = rewind.DynamicCache.from_legacy_cache(legacy)
    assert len(d) == 2 and torch.equal(d[0][1], c[0][1]) and d.get_seq_length() == 4


def test_early_initialization_fixes_shapes_before_the_first_update():
    c = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention", "linear_attention"], sliding_window=4,
                            conv_kernel_size=2)
    c.early_initialization(batch_size=2, num_heads=[3, 1, 1], head_dim=8, dtype=torch.bfloat16)
    assert c.layers[0].keys.shape == (2, 3, 0, 8) and c.layers[0].keys.dtype == torch.bfloat16
    assert c.is_initialized and c.get_seq_length() == 0
    with pytest.raises(ValueError):
        c.update(torch.zeros(2, 2, 1, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 1, 8, dtype=torch.bfloat16), 0)
    keys, _ = c.update(torch.ones(2, 1, 3, 8, dtype=torch.bfloat16), torch.ones(2, 1, 3, 8, dtype=torch.bfloat16), 1)
    assert keys.shape == (2, 1, 3, 8)
