"""Every layer kind against a naive reference that keeps all history, recurrent rollback, batch operations."""

import random

import numpy as np
import pytest
import torch

import rewind
from conftest import STORAGE, conv_in, conv_positions, kv, positions


class Reference:
    """Naive model of one hybrid layer: every token's keys, conv inputs and recurrent states, forever."""

    def __init__(self, W, K):
        self.W, self.K = W, K
        self.keys = []  # positions
        self.states = [torch.zeros(1, 2, 3)]  # S(0), S(1), ...

    @property
    def L(self):
        return len(self.keys)

    def sliding_returned(self, q):
        L = self.L
        return list(range(max(0, L - self.W + 1), L + q))

    def conv_window(self, q):
        L = self.L
        return [p if p >= 0 else -1 for p in range(L - (self.K - 1), L + q)]


def test_random_operations_match_naive_reference():
    rng = random.Random(1234)
    W, K, R = 6, 4, 5
    layer = rewind.LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=W, conv_kernel_size=K)
    full = rewind.DynamicLayer()
    layer.activate_past_recording(R)
    full.activate_past_recording(R)
    ref = Reference(W, K)
    layer.update(kv(0, 1), kv(0, 1))
    full.update(kv(0, 1), kv(0, 1))
    layer.update_conv_state(conv_in(0, 1))
    first = torch.full((1, 2, 3), 1.5)
    layer.update_recurrent_state(first)
    ref.keys.append(0)
    ref.states.append(first)
    last_q = 1
    shown = 1  # conv columns transformers' recording cache shows (inputs since the last crop)
    for step in range(400):
        op = rng.random()
        if op < 0.55:
            q = rng.randint(1, 4)
            L = ref.L
            assert layer.get_mask_sizes(q) == (len(ref.sliding_returned(q)), ref.sliding_returned(q)[0])
            keys, _ = layer.update(kv(L, q), kv(L, q))
            assert positions(keys) == ref.sliding_returned(q)
            fk, _ = full.update(kv(L, q), kv(L, q))
            assert positions(fk) == list(range(L + q))
            window = layer.update_conv_state(conv_in(L, q))
            assert conv_positions(window) == ref.conv_window(q)
            states = torch.stack([torch.full((1, 2, 3), float(L + t + 1) + 0.5) for t in range(q)])
            got = layer.update_recurrent_state(states[-1], all_states=states)
            assert torch.equal(got, states[-1])
            ref.keys.extend(range(L, L + q))
            ref.states.extend(states[t] for t in range(q))
            last_q = q
            shown = q if L == 0 else shown + q
        else:
            k = rng.choice([0, 1, 2, 3, 5, 7, ref.L + 1])
            before = (layer.get_seq_length(), positions(layer.keys), conv_positions(layer.conv_states[0]),
                      layer.recurrent_states[0].clone())
            guaranteed = k <= min(R, last_q) or k >= ref.L
            try:
                layer.crop(-k)
                full.crop(-k)
            except rewind.RollbackError:
                assert not guaranteed, f"crop(-{k}) refused at step {step}"
                after = (layer.get_seq_length(), positions(layer.keys), conv_positions(layer.conv_states[0]),
                         layer.recurrent_states[0])
                assert before[:3] == after[:3] and torch.equal(before[3], after[3])
                continue
            new_L = max(0, ref.L - k)
            shown = max(0, shown - k) - max(0, shown - k - K) if k else min(shown, K)
            del ref.keys[new_L:]
            del ref.states[new_L + 1:]
            last_q = max(0, last_q - k) if k else 0
        L = ref.L
        assert layer.get_seq_length() == L == full.get_seq_length()
        assert positions(layer.keys) == list(range(max(0, L - (W - 1)), L))
        assert positions(full.keys) == list(range(L))
        # While recording, conv_states shows what transformers' does: the inputs since the last crop (after a
        # crop, the K before the removed ones), at most the K + R rewind retains; K zeros at L = 0.
        n = K if L == 0 else min(shown, K + R)
        assert conv_positions(layer.conv_states[0]) == [p if p >= 0 else -1 for p in range(L - n, L)]
        assert torch.equal(layer.recurrent_states[0], ref.states[L])
        assert layer.has_previous_state[0] == (L > 0)
        assert layer.max_rollback() >= min(R, last_q) or L == 0


def test_recurrent_rollback_restores_exact_states_and_snapshots():
    layer = rewind.LinearAttentionLayer(conv_kernel_size=2)
    layer.activate_past_recording(4)
    states = [torch.zeros(2, 3)]
    for t in range(1, 9):
        s = torch.randn(2, 3)
        states.append(s)
        layer.update_conv_state(conv_in(t - 1, 1, channels=1, batch=2))
        layer.update_recurrent_state(s)
    assert layer.max_rollback() == 4
    assert torch.equal(layer.recurrent_snapshot(0, 6), states[6])
    layer.crop(-3)
    assert torch.equal(layer.recurrent_states[0], states[5])
    assert layer.max_rollback() == 1
    with pytest.raises(rewind.RollbackError):
        layer.crop(-2)
    assert torch.equal(layer.recurrent_states[0], states[5])


def test_final_state_only_refuses_rollback_inside_the_forward():
    layer = rewind.LinearAttentionLayer(conv_kernel_size=3)
    layer.activate_past_recording(8)
    layer.update_conv_state(conv_in(0, 5))
    final = torch.randn(1, 4)
    layer.update_recurrent_state(final)  # q = 5 inferred from the conv part
    assert layer.get_seq_length() == 5
    assert layer.max_rollback() == 0
    with pytest.raises(rewind.RollbackError, match="never received"):
        layer.crop(-2)
    layer.crop(-5)  # a full rollback is exact: S(0) is the zero state
    assert layer.get_seq_length() == 0 and not layer.has_previous_state[0]
    assert torch.count_nonzero(layer.recurrent_states[0]) == 0
    # token by token afterwards: rollbacks exact again
    for t in range(3):
        layer.update_conv_state(conv_in(t, 1))
        layer.update_recurrent_state(torch.full((1, 4), float(t)))
    layer.crop(-2)
    assert torch.equal(layer.recurrent_states[0], torch.zeros(1, 4))


def test_final_state_only_rolls_back_exactly_to_before_the_forward():
    """The rule is the C++ one (rwd::Layer::update_recurrent_state_final): a crop into the forward is refused and
    changes nothing; a crop to the length before it restores the state given there; tokens after it roll back."""
    layer = rewind.LinearAttentionLayer(conv_kernel_size=3)
    layer.activate_past_recording(8)
    states = [torch.zeros(1, 4)]
    for t in range(3):
        states.append(torch.full((1, 4), float(t + 1)))
        layer.update_conv_state(conv_in(t, 1))
        layer.update_recurrent_state(states[-1])
    final = torch.full((1, 4), 7.0)
    layer.update_conv_state(conv_in(3, 4))
    layer.update_recurrent_state(final)  # 4 tokens, only S(7) given
    window = layer.conv_states[0].clone()
    for n in (-1, -2, -3):
        with pytest.raises(rewind.RollbackError, match=f"after {7 + n} tokens, which the layer never received"):
            layer.crop(n)
        assert layer.get_seq_length() == 7 and torch.equal(layer.recurrent_states[0], final)
        assert torch.equal(layer.conv_states[0], window)
    assert layer.max_rollback() == 0
    after = torch.full((1, 4), 8.0)
    layer.update_conv_state(conv_in(7, 1))
    layer.update_recurrent_state(after)
    assert layer.max_rollback() == 1
    layer.crop(-1)
    assert torch.equal(layer.recurrent_states[0], final)
    layer.crop(-4)  # back to before the forward: S(3) was given
    assert layer.get_seq_length() == 3 and torch.equal(layer.recurrent_states[0], states[3])
    assert layer.max_rollback() == 3
    layer.crop(-2)
    assert torch.equal(layer.recurrent_states[0], states[1])


def test_begin_recurrent_update_writes_in_place():
    c = rewind.DynamicCache(layer_types=["linear_attention"], conv_kernel_size=2)
    c.activate_past_recording(4)
    c.update_conv_state(conv_in(0, 3), 0)
    u = c.begin_recurrent_update(3, 0, like=torch.zeros(1, 2))
    assert torch.count_nonzero(u.previous()) == 0
    for t in range(1, 4):
        slot = u.next(t)
        slot.copy_(torch.full((1, 2), float(t)))
    u.commit()
    assert torch.equal(c.layers[0].recurrent_states[0], torch.full((1, 2), 3.0))
    c.crop(-2)
    assert torch.equal(c.layers[0].recurrent_states[0], torch.full((1, 2), 1.0))
    # an uncommitted update changes nothing
    c.update_conv_state(conv_in(1, 1), 0)
    u = c.begin_recurrent_update(1, 0)
    u.next(1).fill_(99.0)
    del u
    assert torch.equal(c.layers[0].recurrent_states[0], torch.full((1, 2), 1.0))


def batch_kv(start, n, batch):
    return kv(start, n, batch=batch)


def test_batch_operations_apply_to_every_part():
    c = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention", "linear_attention",
                                         "deepseek_sparse_attention"], sliding_window=3, conv_kernel_size=2)
    B = 3
    k = batch_kv(0, 5, B)
    for i in (0, 1, 3):
        c.update(k, k, i)
    x = conv_in(0, 5, batch=B) + (torch.arange(B).view(B, 1, 1) * 1000)
    c.update_conv_state(x, 2)
    rec = torch.arange(B, dtype=torch.float32).view(B, 1).expand(B, 2).contiguous()
    c.update_recurrent_state(rec, 2, num_tokens=5)
    idx = torch.tensor([2, 0, 2])
    c.reorder_cache(idx)

    def rows(t):
        return [int(v) // 1000 for v in t.reshape(t.shape[0], -1)[:, -1].tolist()]

    assert rows(c.layers[0].keys) == [2, 0, 2]
    assert rows(c.layers[1].keys) == [2, 0, 2]
    assert rows(c.layers[2].conv_states[0]) == [2, 0, 2]
    assert c.layers[2].recurrent_states[0][:, 0].tolist() == [2.0, 0.0, 2.0]
    c.batch_select_indices([1])
    assert c.batch_size == 1 and rows(c.layers[3].keys) == [0]
    c.batch_repeat_interleave(2)
    assert c.batch_size == 2 and rows(c.layers[0].keys) == [0, 0]
    with pytest.raises(IndexError) as e:
        c.batch_select_indices([0, 5])
    assert isinstance(e.value, rewind.IndexError)
    assert c.batch_size == 2  # unchanged
    with pytest.raises(ValueError):
        c.reorder_cache([0])  # wrong length


def test_reset_keeps_configuration_and_recording():
    c = rewind.DynamicCache(layer_types=["full_attention", "conv"], conv_kernel_size=3)
    c.activate_past_recording(2)
    c.update(kv(0, 4), kv(0, 4), 0)
    c.update_conv_state(conv_in(0, 4), 1)
    c.reset()
    assert c.get_seq_length() == 0 and c.layers[0].keys.shape[-2] == 0
    assert conv_positions(c.layers[1].conv_states[0]) == [-1, -1, -1]
    assert c.is_recording()
    keys, _ = c.update(kv(0, 2), kv(0, 2), 0)
    assert positions(keys) == [0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_round_trip_bit_for_bit(dtype):
    layer = rewind.DynamicLayer()
    k = torch.randn(2, 3, 5, 8).to(dtype)
    v = torch.randn(2, 3, 5, 4).to(dtype)
    keys, values = layer.update(k, v)
    assert keys.dtype == dtype and values.dtype == dtype
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert values.shape == (2, 3, 5, 4)


def test_numpy_in_numpy_out():
    layer = rewind.DynamicSlidingWindowLayer(sliding_window=4)
    k = np.arange(2 * 6 * 3, dtype=np.float32).reshape(1, 2, 6, 3)
    keys, values = layer.update(k, k)
    assert isinstance(keys, np.ndarray)
    np.testing.assert_array_equal(keys, k)
    kept = layer.keys
    assert np.shares_memory(kept, keys) == (STORAGE == "host")  # host copies on the guarded storage
    np.testing.assert_array_equal(kept, k[:, :, 3:])
    conv = rewind.LinearAttentionLayer(conv_kernel_size=2)
    w = conv.update_conv_state(np.ones((1, 2, 3), dtype=np.float16))
    assert w.dtype == np.float16 and w.shape == (1, 2, 4)
    np.testing.assert_array_equal(w[0, 0], [0, 1, 1, 1])


def test_input_errors_are_value_errors_with_cpp_messages():
    layer = rewind.DynamicLayer()
    layer.update(kv(0, 2), kv(0, 2))
    with pytest.raises(ValueError) as e:
        layer.update(kv(0, 2, heads=3), kv(0, 2, heads=3))
    assert isinstance(e.value, rewind.InvalidArgument)
    with pytest.raises(ValueError, match="dtype"):
        layer.update(kv(0, 1).double(), kv(0, 1).double())
    with pytest.raises(ValueError):
        layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="tensor"):
        layer.update([1, 2], [1, 2])
    with pytest.raises(ValueError, match="negated"):
        neg = torch._neg_view(kv(2, 1))
        layer.update(neg, neg)
    with pytest.raises(ValueError, match="int64"):
        layer.update(torch.zeros(1, 2, 1, 4, dtype=torch.int64), torch.zeros(1, 2, 1, 4, dtype=torch.int64))
    assert layer.get_seq_length() == 2
    with pytest.raises(rewind.IndexError):
        rewind.DynamicCache(layer_types=["full_attention"]).update(kv(0, 1), kv(0, 1), 3)
    with pytest.raises(rewind.InvalidArgument, match="unknown layer type"):
        rewind.DynamicCache(layer_types=["fancy_attention"])


def test_stateless_placeholders_and_linear_mask_sizes():
    c = rewind.DynamicCache(layer_types=["mlp", "linear_attention", "full_attention", "moe"], conv_kernel_size=2)
    c.activate_past_recording(4)
    c.update_conv_state(conv_in(0, 3), 1)
    c.update_recurrent_state(torch.ones(1, 2), 1, all_states=torch.ones(3, 1, 2))
    c.update(kv(0, 3), kv(0, 3), 2)
    assert c.layers[0].get_seq_length() == 0 and c.layers[3].get_seq_length() == 0
    assert c.get_seq_length() == 3  # layer 0 holds nothing: the first layer with state answers
    assert c.get_mask_sizes(2, 2) == (5, 0)
    with pytest.raises(ValueError, match="LinearAttention layer"):
        c.get_mask_sizes(2, 1)
    assert c.has_previous_state() is True
    with pytest.raises(ValueError, match="Attention layer"):
        c.has_previous_state(2)
    c.crop(-2)
    assert c.get_seq_length(1) == 1 and c.get_seq_length(2) == 1 and c.max_rollback() == 1
    c.reorder_cache([0])


def test_bfloat16_recurrent_and_conv_states():
    layer = rewind.LinearAttentionLayer(conv_kernel_size=2)
    layer.activate_past_recording(2)
    x = torch.randn(1, 4, 3).to(torch.bfloat16)
    w = layer.update_conv_state(x)
    assert w.dtype == torch.bfloat16 and torch.equal(w[:, :, 1:], x)
    states = torch.randn(3, 1, 2, 2).to(torch.bfloat16)
    layer.update_recurrent_state(states[-1], all_states=states)
    layer.crop(-1)
    assert torch.equal(layer.recurrent_states[0], states[1])
