"""transformers' calling conventions, stated in small PyTorch models of our own, decoding on rewind's DynamicCache.

transformers' modeling code cannot be included here, so these models follow the conventions issue 27 states:

- a short-conv layer (LFM2) and the conv of a Gated DeltaNet layer (Qwen3.5 / Qwen3-Next), on a one-token cached
  step with recording off (``seq_len == 1 and not cache.layers[i].record_past``, after
  ``cache.has_previous_state(i)``), run a fused ``causal_conv1d_update`` on ``cache.layers[i].conv_states[0]``
  (shift left, write the new input last, in place) and never call ``update_conv_state``; every other step calls
  ``cache.update_conv_state(x, i, conv_kernel_size=K)`` and uses the window it returns;
- a Gated DeltaNet layer reads ``cache.layers[i].recurrent_states[0]`` as its initial state and stores only the
  state after the whole forward with ``cache.update_recurrent_state(final, i)``;
- attention layers take ``(kv_length, kv_offset) = cache.get_mask_sizes(q, i)`` for their mask, then
  ``cache.update(k, v, i)``; chunked attention masks chunks relative to each row's first real token.

Every decode is compared with the same model run with no cache on the whole sequence (1e-5).
"""

import copy
import io
import pickle

import pytest

torch = pytest.importorskip("torch")

import rewind  # noqa: E402
from test_inplace_conv import ShortConv as InplaceShortConv, causal_conv1d_update  # noqa: E402

D, H, HD, K, V, CHUNK = 8, 2, 4, 3, 13, 4
GDN_HEADS, GDN_DIM = 2, 3
CACHE_TYPE = {"conv": "conv", "gdn": "linear_attention", "attn": "full_attention", "chunk": "chunked_attention"}


def conv_step(layer_idx, x, weight, cache, has_previous):
    """The conv half of LFM2 / Gated DeltaNet layers: x [B, C, q] -> outputs [B, C, q]. ``has_previous`` is
    ``cache.has_previous_state(layer_idx)`` read as the layer's forward starts."""
    q = x.shape[-1]
    if has_previous and q == 1 and not cache.layers[layer_idx].record_past:
        return causal_conv1d_update(x[..., 0], cache.layers[layer_idx].conv_states[0], weight)[..., None]
    if cache is not None:
        window = cache.update_conv_state(x, layer_idx, conv_kernel_size=K)
    else:
        window = torch.nn.functional.pad(x, (K - 1, 0))
    window = window[..., -(K - 1 + q):]
    return torch.stack([(window[..., j:j + K] * weight).sum(-1) for j in range(q)], dim=-1)


# test_inplace_conv's projections and taps, built with its D and K (the same
# as this file's), under this file's forward.
class ShortConv(InplaceShortConv):
    def forward(self, h, mask, start, cache):
        has_previous = cache is not None and cache.has_previous_state(self.layer_idx)
        own = mask[:, start:start + h.shape[1]].to(h.dtype)
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        bx = (b * x * own[..., None]).transpose(1, 2)  # padded positions zeroed, as LFM2 does
        out = conv_step(self.layer_idx, bx, self.weight, cache, has_previous)
        return self.out_proj(c * out.transpose(1, 2))


class GatedDelta(torch.nn.Module):
    """Conv, then a decayed linear-attention recurrence S_t = g_t S_{t-1} + k_t^T v_t, o_t = q_t S_t."""

    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        inner = 3 * GDN_HEADS * GDN_DIM
        self.in_proj = torch.nn.Linear(D, inner, bias=False)
        self.gate = torch.nn.Linear(D, GDN_HEADS, bias=True)
        self.weight = torch.nn.Parameter(torch.randn(inner, K) * 0.5)
        self.out_proj = torch.nn.Linear(GDN_HEADS * GDN_DIM, D, bias=False)

    def forward(self, h, mask, start, cache):
        bsz, q, _ = h.shape
        has_previous = cache is not None and cache.has_previous_state(self.layer_idx)
        own = mask[:, start:start + q].to(h.dtype)
        x = (self.in_proj(h) * own[..., None]).transpose(1, 2)
        mixed = conv_step(self.layer_idx, x, self.weight, cache, has_previous).transpose(1, 2)  # [B, q, inner]
        qs, ks, vs = (t.reshape(bsz, q, GDN_HEADS, GDN_DIM) for t in mixed.chunk(3, dim=-1))
        g = torch.sigmoid(self.gate(h))  # [B, q, heads]
        if has_previous:
            state = cache.layers[self.layer_idx].recurrent_states[0].clone()
        else:
            state = torch.zeros(bsz, GDN_HEADS, GDN_DIM, GDN_DIM, device=h.device)
        outs = []
        for t in range(q):
            state = g[:, t, :, None, None] * state + ks[:, t, :, :, None] * vs[:, t, :, None, :]
            outs.append(torch.einsum("bhd,bhde->bhe", qs[:, t], state))
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)  # the final state only
        return self.out_proj(torch.stack(outs, dim=1).reshape(bsz, q, -1))


class Attention(torch.nn.Module):
    def __init__(self, layer_idx, chunked=False):
        super().__init__()
        self.layer_idx = layer_idx
        self.chunked = chunked
        self.qkv = torch.nn.Linear(D, 3 * H * HD, bias=False)
        self.o = torch.nn.Linear(H * HD, D, bias=False)

    def forward(self, h, mask, start, cache):
        bsz, q, _ = h.shape
        qs, ks, vs = (t.view(bsz, q, H, HD).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        offset = 0
        if cache is not None:
            kv_length, offset = cache.get_mask_sizes(q, self.layer_idx)
            ks, vs = cache.update(ks, vs, self.layer_idx)
            assert ks.shape[-2] == kv_length
        key_pos = offset + torch.arange(ks.shape[-2], device=h.device)
        query_pos = start + torch.arange(q, device=h.device)
        allowed = key_pos[None, None, :] <= query_pos[None, :, None]  # [1, q, n]
        if self.chunked:
            # Chunks count from each row's first real token, as transformers' chunked masks do.
            first = (mask == 0).sum(-1)  # left padding: the pads come first
            allowed = allowed & (((key_pos[None, None, :] - first[:, None, None]) // CHUNK) ==
                                 ((query_pos[None, :, None] - first[:, None, None]) // CHUNK))
        real = mask[:, key_pos].bool()[:, None, :]
        scores = (qs @ ks.transpose(-1, -2) / HD ** 0.5)
        # Pads as keys: a large negative score; future keys (and other chunks): -inf. A pad query still sees
        # itself, in both runs.
        scores = scores.masked_fill(~real[:, None], -1e9).masked_fill(~allowed[:, None], float("-inf"))
        out = (scores.softmax(-1) @ vs).transpose(1, 2).reshape(bsz, q, H * HD)
        return self.o(out)


class Tiny(torch.nn.Module):
    """A decoder of the given layer kinds, with transformers' config fields rewind.DynamicCache(config=) reads."""

    def __init__(self, kinds, seed=7):
        super().__init__()
        torch.manual_seed(seed)
        self.config = {"layer_types": [CACHE_TYPE[k] for k in kinds], "conv_L_cache": K,
                       "linear_conv_kernel_dim": K, "attention_chunk_size": CHUNK}
        self.embed = torch.nn.Embedding(V, D)
        made = {"conv": ShortConv, "gdn": GatedDelta, "attn": Attention,
                "chunk": lambda i: Attention(i, chunked=True)}
        self.layers = torch.nn.ModuleList(made[k](i) for i, k in enumerate(kinds))
        self.head = torch.nn.Linear(D, V, bias=False)

    def forward(self, ids, mask, start=0, cache=None):
        """Logits of ``ids`` at positions start..; ``mask`` covers positions 0..start+q-1."""
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h, mask, start, cache)
        return self.head(h)


FAMILIES = {
    "lfm2": ["conv", "attn", "conv", "attn"],
    "qwen3_next": ["gdn", "gdn", "attn", "gdn"],
    "dense": ["attn", "attn"],
    "chunked": ["chunk", "attn", "chunk"],
}


def tiny(kinds, device):
    """The model on `device` (conftest.py's fixture): its cache takes that device from the first update."""
    return Tiny(kinds).eval().to(device)


def batch(pads, length, seed=3, device="cpu"):
    torch.manual_seed(seed)
    ids = torch.randint(1, V, (len(pads), length))
    mask = torch.ones(len(pads), length, dtype=torch.long)
    for r, p in enumerate(pads):
        ids[r, :p] = 0
        mask[r, :p] = 0
    return ids.to(device), mask.to(device)


def decode(model, ids, mask, prompt, cache, stop=None):
    """Prefill ``prompt`` tokens, then one token per step up to ``stop``; the logits of every position."""
    got = [model(ids[:, :prompt], mask, 0, cache)]
    for t in range(prompt, stop or ids.shape[1]):
        got.append(model(ids[:, t:t + 1], mask, t, cache))
    return torch.cat(got, dim=1)


def lengths(cache):
    return [layer.get_seq_length() for layer in cache.layers]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("pads", [(0,), (0, 3), (7, 0)])
@torch.no_grad()
def test_plain_and_left_padded_decoding_is_exact(family, pads, device):
    model = tiny(FAMILIES[family], device)
    ids, mask = batch(pads, 11, device=device)
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    got = decode(model, ids, mask, 4, cache)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == ids.shape[1]
    assert lengths(cache) == [ids.shape[1]] * len(model.layers)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_beam_operations_after_decoding_are_exact(family, device):
    """Beam-style: repeat the rows, reorder each step, then keep some; every later operation works."""
    model = tiny(FAMILIES[family], device)
    ids, mask = batch((0, 2), 12, device=device)
    cache = rewind.DynamicCache(config=model.config)
    decode(model, ids, mask, 5, cache, stop=7)
    cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
    rows = torch.tensor([0, 0, 1, 1])
    for t, order in ((7, [1, 0, 3, 2]), (8, [2, 2, 0, 1]), (9, [3, 1, 1, 0])):
        order = torch.tensor(order)
        cache.reorder_cache(order)
        rows = rows[order]
        got = model(ids[rows, t:t + 1], mask[rows], t, cache)
        torch.testing.assert_close(got, model(ids[rows], mask[rows])[:, t:t + 1], rtol=0, atol=1e-5)
    cache.batch_select_indices(torch.tensor([2, 0]))
    rows = rows[torch.tensor([2, 0])]
    got = model(ids[rows, 10:12], mask[rows], 10, cache)
    torch.testing.assert_close(got, model(ids[rows], mask[rows])[:, 10:12], rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 12 and cache.batch_size == 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_assisted_rounds_roll_back_exactly(family, device):
    """transformers' assisted loop after plain (in-place) steps: record, verify K + 1 tokens, crop(-rejected).

    Gated DeltaNet layers give only the final state of a multi-token forward: there a crop inside the verified
    tokens is refused (RollbackError, nothing changed); rewind.generate passes the per-token states instead."""
    model = tiny(FAMILIES[family], device)
    ids, mask = batch((0,), 16, device=device)
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    decode(model, ids, mask, 4, cache, stop=7)
    cache.activate_past_recording(4)
    draft = ids.clone()
    draft[:, 9] = (draft[:, 9] + 1) % V  # drafted token 9 is wrong: 9 and 10 are rejected
    verified = model(draft[:, 7:11], mask, 7, cache)
    torch.testing.assert_close(verified[:, :2], reference[:, 7:9], rtol=0, atol=1e-5)
    if "gdn" in FAMILIES[family]:
        with pytest.raises(rewind.RollbackError, match="never received"):
            cache.crop(-2)
        assert lengths(cache) == [11] * len(model.layers)
        return
    cache.crop(-2)
    assert lengths(cache) == [9] * len(model.layers)
    got = model(ids[:, 9:12], mask, 9, cache)
    torch.testing.assert_close(got, reference[:, 9:12], rtol=0, atol=1e-5)
    cache.deactivate_past_recording()
    steps = torch.cat([model(ids[:, t:t + 1], mask, t, cache) for t in range(12, 16)], dim=1)  # in place again
    torch.testing.assert_close(steps, reference[:, 12:16], rtol=0, atol=1e-5)


@torch.no_grad()
def test_gated_delta_one_token_rounds_roll_back_exactly(device):
    """With recording on, one-token steps give every state: a later crop lands on a state the cache holds."""
    model = tiny(FAMILIES["qwen3_next"], device)
    ids, mask = batch((0,), 12, device=device)
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    cache.activate_past_recording(4)
    decode(model, ids, mask, 4, cache, stop=6)
    wrong = (ids[:, 6:9] + 1) % V
    for t in range(3):
        model(wrong[:, t:t + 1], mask, 6 + t, cache)
    cache.crop(-3)
    got = torch.cat([model(ids[:, t:t + 1], mask, t, cache) for t in range(6, 12)], dim=1)
    torch.testing.assert_close(got, reference[:, 6:12], rtol=0, atol=1e-5)


@torch.no_grad()
def test_chunked_attention_with_left_padding_keeps_the_keys_transformers_keeps(device):
    """Chunk 4, 8 tokens, a row of 7 pads: transformers' cache gives get_mask_sizes(1, 0) == (4, 5) and 4 keys."""
    model = tiny(["chunk"], device)
    ids, mask = batch((7, 0), 12, device=device)
    cache = rewind.DynamicCache(config=model.config)
    model(ids[:, :8], mask, 0, cache)
    assert cache.get_mask_sizes(1, 0) == (4, 5)
    k = torch.zeros(2, H, 1, HD, device=device)
    keys, _ = copy.deepcopy(cache).update(k, k, 0)
    assert keys.shape[-2] == 4
    got = torch.cat([model(ids[:, t:t + 1], mask, t, cache) for t in range(8, 12)], dim=1)
    torch.testing.assert_close(got, model(ids, mask)[:, 8:12], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["lfm2", "qwen3_next"])
@torch.no_grad()
def test_deepcopy_is_deep_and_independent(family, device):
    """transformers' way to reuse a prompt cache, taken right after an in-place conv step."""
    model = tiny(FAMILIES[family], device)
    ids, mask = batch((0, 2), 12, device=device)
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    cache.activate_past_recording(3)
    model(ids[:, :5], mask, 0, cache)
    cache.deactivate_past_recording()
    model(ids[:, 5:6], mask, 5, cache)  # in place on the conv states, not yet taken
    copied = copy.deepcopy(cache)
    assert lengths(copied) == lengths(cache) == [6] * len(model.layers)
    # The copy diverges; the original does not see it.
    other = (ids + 5) % V
    model(other[:, 6:9], mask, 6, copied)
    got = torch.cat([model(ids[:, t:t + 1], mask, t, cache) for t in range(6, 12)], dim=1)
    torch.testing.assert_close(got, reference[:, 6:12], rtol=0, atol=1e-5)
    # A copy continues exactly as the original would from the same state.
    again = copy.deepcopy(copied)
    torch.testing.assert_close(model(other[:, 9:11], mask, 9, again), model(other[:, 9:11], mask, 9, copied),
                               rtol=0, atol=0)


@torch.no_grad()
def test_deepcopy_keeps_rollback_history(device):
    model = tiny(FAMILIES["lfm2"], device)
    ids, mask = batch((0,), 12, device=device)
    cache = rewind.DynamicCache(config=model.config)
    cache.activate_past_recording(4)
    decode(model, ids, mask, 4, cache, stop=8)
    copied = copy.deepcopy(cache)
    assert copied.max_rollback() == cache.max_rollback() == 4
    copied.crop(-4)
    assert copied.get_seq_length() == 4 and cache.get_seq_length() == 8
    torch.testing.assert_close(model(ids[:, 4:6], mask, 4, copied), model(ids, mask)[:, 4:6], rtol=0, atol=1e-5)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
@pytest.mark.parametrize("family", ["lfm2", "qwen3_next", "chunked"])
@torch.no_grad()
def test_pickle_and_torch_save_round_trip(family, how, device):
    model = tiny(FAMILIES[family], device)
    ids, mask = batch((0, 3), 12, device=device)
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    decode(model, ids, mask, 4, cache, stop=7)
    cache.set_memory_budget(1 << 30)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(cache))
    else:
        buffer = io.BytesIO()
        torch.save(cache, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
    assert type(loaded) is type(cache) and lengths(loaded) == lengths(cache)
    assert loaded.memory_budget() == 1 << 30 and loaded.budget_reserved() > 0
    for a, b in zip(cache.layers, loaded.layers):
        for name in ("keys", "values"):
            if getattr(a, name, None) is not None:
                assert torch.equal(getattr(a, name), getattr(b, name))
        for name in ("conv_states", "recurrent_states"):
            for i, t in getattr(a, name, {}).items():
                assert (t is None) == (getattr(b, name)[i] is None)
                if t is not None:
                    assert torch.equal(t, getattr(b, name)[i])
    got = torch.cat([model(ids[:, t:t + 1], mask, t, loaded) for t in range(7, 12)], dim=1)
    torch.testing.assert_close(got, reference[:, 7:12], rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 7  # the original is untouched


def test_unpickled_cache_keeps_recording_without_history():
    cache = rewind.DynamicCache(layer_types=["full_attention", "conv"], conv_kernel_size=K)
    cache.activate_past_recording(4)
    for t in range(10):
        cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2), 0)
        cache.update_conv_state(torch.randn(1, 2, 1), 1)
    loaded = pickle.loads(pickle.dumps(cache))
    assert loaded.is_recording() and loaded.max_rollback() == 0 and cache.max_rollback() == 4
    with pytest.raises(rewind.RollbackError):
        loaded.crop(-1)
    loaded.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2), 0)
    loaded.update_conv_state(torch.randn(1, 2, 1), 1)
    loaded.crop(-1)
    assert loaded.get_seq_length() == 10


def test_conv_states_while_recording_show_what_transformers_shows():
    """transformers keeps every conv input from the recorded prefill until a crop, then the K before the removed."""
    layer = rewind.LinearAttentionLayer(conv_kernel_size=4)
    layer.activate_past_recording(8)
    x = torch.arange(1.0, 4.0).view(1, 1, 3)
    layer.update_conv_state(x)  # a prefill of 3 < K: unpadded
    assert layer.conv_states[0].flatten().tolist() == [1, 2, 3]
    for v in (4.0, 5.0, 6.0):
        layer.update_conv_state(torch.tensor([[[v]]]))
    assert layer.conv_states[0].flatten().tolist() == [1, 2, 3, 4, 5, 6]
    layer.crop(-2)
    assert layer.conv_states[0].flatten().tolist() == [1, 2, 3, 4]
    layer.update_conv_state(torch.tensor([[[7.0]]]))
    assert layer.conv_states[0].flatten().tolist() == [1, 2, 3, 4, 7]
    layer.crop(0)
    assert layer.conv_states[0].flatten().tolist() == [2, 3, 4, 7]
    layer.deactivate_past_recording()
    layer.update_conv_state(torch.tensor([[[8.0]]]))
    assert layer.conv_states[0].flatten().tolist() == [3, 4, 7, 8]


def test_returned_keys_and_windows_keep_requires_grad():
    keys = torch.randn(1, 2, 3, 4, requires_grad=True)
    cache = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention", "conv"], sliding_window=2,
                                conv_kernel_size=K)
    k, v = cache.update(keys, keys.detach(), 0)
    assert k.requires_grad and not v.requires_grad
    k.sum().backward()
    assert torch.equal(keys.grad, torch.ones_like(keys))
    k2, _ = cache.update(keys, keys, 1)
    assert k2.requires_grad
    x = torch.randn(1, 2, 3, requires_grad=True)
    window = cache.update_conv_state(x, 2)
    assert window.requires_grad and window.shape == (1, 2, K - 1 + 3)
    with torch.no_grad():
        k3, _ = cache.update(keys, keys, 0)
    assert not k3.requires_grad
    torch.testing.assert_close(k3[:, :, -3:], keys.detach(), rtol=0, atol=0)


def test_transformers_attributes_and_defaults():
    cache = rewind.DynamicCache(layer_types=["full_attention", "sliding_attention"], sliding_window=5)
    k = torch.randn(3, 1, 4, 2)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    assert cache.get_query_offset() == cache.get_seq_length() == 4
    assert cache.max_batch_size == 3
    assert cache.max_cache_len == 5
    cache.offload(0)
    cache.prefetch(1)
    assert cache.get_seq_length() == 4 and torch.equal(cache.layers[0].keys, k)


def test_recording_changes_are_all_or_nothing():
    """A recording change the budget refuses for a later recurrent layer leaves every layer as it was."""
    cache = rewind.DynamicCache(layer_types=["full_attention", "linear_attention", "linear_attention"],
                                conv_kernel_size=K)
    cache.activate_past_recording(2)

    def step(q):
        k = torch.randn(1, 1, q, 2)
        cache.update(k, k, 0)
        for i in (1, 2):
            cache.update_conv_state(torch.randn(1, 2, q), i)
            states = torch.randn(q, 1, 4, 4, 4)
            cache.update_recurrent_state(states[-1], i, all_states=states)

    for _ in range(2):
        step(1)
    at_2 = [layer.recurrent_states[0].clone() for layer in cache.layers[1:]]
    step(1)
    step(1)
    cache.set_memory_budget(cache.budget_reserved() + 4096)  # room for the first layer's new slots only
    with pytest.raises(rewind.CapacityError, match="memory budget"):
        cache.activate_past_recording(40)
    assert [layer.recording_capacity() for layer in cache.layers] == [2, 2, 2]
    assert cache.max_rollback() == 2
    cache.crop(-2)  # the history the refused change would have replaced is all there
    for layer, state in zip(cache.layers[1:], at_2):
        assert torch.equal(layer.recurrent_states[0], state)
    cache.set_memory_budget(0)
    cache.deactivate_past_recording()
    assert not any(layer.is_recording() for layer in cache.layers)
    cache.set_memory_budget(cache.budget_reserved() + 4096)
    with pytest.raises(rewind.CapacityError):
        cache.activate_past_recording(40)
    assert not any(layer.is_recording() for layer in cache.layers) and not cache.is_recording()
