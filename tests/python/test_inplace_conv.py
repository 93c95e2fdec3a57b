"""The in-place conv update of transformers' LFM2 / Qwen3.5 / Qwen3-Next modeling code, as a test double.

transformers' code could not be included or run here, so this module states its calling convention in a small
PyTorch model of our own: on a one-token cached step with recording off (``seq_len == 1 and not
cache.layers[i].record_past``, after ``cache.has_previous_state(i)``) a short-conv layer runs a fused
``causal_conv1d_update(x, conv_state, weight)`` on ``conv_state = cache.layers[i].conv_states[0]`` ([B, C, K]),
which shifts the window left by one and writes the new input in place, and never calls ``update_conv_state``;
every other step calls ``cache.update_conv_state(x, layer_idx, conv_kernel_size=K)`` and uses what it returns.
Attention layers call ``cache.update(k, v, layer_idx)``. Logits are compared with the same model run with no cache
on the whole sequence.
"""

import pytest

torch = pytest.importorskip("torch")

import rewind  # noqa: E402

D, H, HD, K, V = 8, 2, 4, 3, 13
LAYER_TYPES = ["conv", "full_attention", "conv", "full_attention"]


def causal_conv1d_update(x, conv_state, weight):
    """transformers' torch fallback, restated: shift left, write x last, in place; return the conv output."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    return (conv_state * weight).sum(-1)


class ShortConv(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.in_proj = torch.nn.Linear(D, 3 * D, bias=False)
        self.weight = torch.nn.Parameter(torch.randn(D, K) * 0.5)
        self.out_proj = torch.nn.Linear(D, D, bias=False)

    def forward(self, h, mask, cache):
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        bx = (b * x * mask[..., None]).transpose(1, 2)  # [B, D, q]; padded positions zeroed as LFM2 does
        q = bx.shape[-1]
        i = self.layer_idx
        if cache is not None and cache.has_previous_state(i) and q == 1 and not cache.layers[i].record_past:
            out = causal_conv1d_update(bx[..., 0], cache.layers[i].conv_states[0], self.weight)[..., None]
        else:
            window = cache.update_conv_state(bx, i, conv_kernel_size=K) if cache is not None else \
                torch.nn.functional.pad(bx, (K - 1, 0))
            out = torch.stack([(window[..., j:j + K] * self.weight).sum(-1) for j in range(q)], dim=-1)
        return self.out_proj(c * out.transpose(1, 2))


class Attention(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv = torch.nn.Linear(D, 3 * H * HD, bias=False)
        self.o = torch.nn.Linear(H * HD, D, bias=False)

    def forward(self, h, key_mask, start, cache):
        bsz, q, _ = h.shape
        qs, ks, vs = (t.view(bsz, q, H, HD).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        if cache is not None:
            ks, vs = cache.update(ks, vs, self.layer_idx)
        scores = qs @ ks.transpose(-1, -2) / HD ** 0.5  # [B, H, q, L]
        L = ks.shape[-2]
        causal = torch.arange(L, device=h.device)[None, :] <= (start + torch.arange(q, device=h.device))[:, None]
        # Future keys get -inf, pads a large negative number: a pad query still sees itself, in both runs.
        scores = scores.masked_fill(key_mask[:, None, None, :L] == 0, -1e9).masked_fill(~causal, float("-inf"))
        out = (scores.softmax(-1) @ vs).transpose(1, 2).reshape(bsz, q, H * HD)
        return self.o(out)


class TinyHybrid(torch.nn.Module):
    config = {"layer_types": LAYER_TYPES, "conv_L_cache": K}

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.embed = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList(
            ShortConv(i) if t == "conv" else Attention(i) for i, t in enumerate(LAYER_TYPES)
        )
        self.head = torch.nn.Linear(D, V, bias=False)

    def forward(self, ids, attention_mask, start=0, cache=None):
        """Logits of ``ids`` at positions start.. ; attention_mask covers positions 0..start+q-1."""
        h = self.embed(ids)
        own = attention_mask[:, start:start + ids.shape[1]].to(h.dtype)
        for layer in self.layers:
            if isinstance(layer, ShortConv):
                h = h + layer(h, own, cache)
            else:
                h = h + layer(h, attention_mask, start, cache)
        return self.head(h)


@pytest.fixture
def model(device):
    """The model on each device the tests run on (conftest.py's `device`): its cache takes the device from the first
    update, and the in-place write goes into state on that device."""
    with torch.no_grad():
        yield TinyHybrid().eval().to(device)


def batch(model, pads=(0, 3), length=12):
    torch.manual_seed(3)
    ids = torch.randint(1, V, (len(pads), length))
    mask = torch.ones(len(pads), length, dtype=torch.long)
    for r, p in enumerate(pads):
        ids[r, :p] = 0
        mask[r, :p] = 0
    device = model.head.weight.device
    return ids.to(device), mask.to(device)


def lengths(cache):
    return [cache.layers[i].get_seq_length() for i in range(len(LAYER_TYPES))]


@torch.no_grad()
def test_one_token_steps_written_in_place_decode_exactly(model):
    ids, mask = batch(model)
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    prompt = 5
    got = [model(ids[:, :prompt], mask, 0, cache)]
    for t in range(prompt, ids.shape[1]):
        got.append(model(ids[:, t:t + 1], mask, t, cache))
        assert lengths(cache) == [t + 1] * len(LAYER_TYPES)
    torch.testing.assert_close(torch.cat(got, dim=1), reference, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == ids.shape[1]


@torch.no_grad()
def test_reorder_and_select_after_in_place_steps(model):
    ids, mask = batch(model, pads=(0, 3, 1))
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    model(ids[:, :6], mask, 0, cache)
    for t in range(6, 9):
        model(ids[:, t:t + 1], mask, t, cache)
    order = torch.tensor([2, 0, 1], device=ids.device)
    cache.reorder_cache(order)  # refused before: the conv layers were behind the attention ones
    got = [model(ids[order, t:t + 1], mask[order], t, cache) for t in range(9, 11)]
    torch.testing.assert_close(torch.cat(got, dim=1), reference[order, 9:11], rtol=0, atol=1e-5)
    cache.batch_select_indices(torch.tensor([1], device=ids.device))
    last = model(ids[order[1:2], 11:12], mask[order[1:2]], 11, cache)
    torch.testing.assert_close(last, reference[order[1:2], 11:12], rtol=0, atol=1e-5)


@torch.no_grad()
def test_assisted_rounds_after_in_place_steps_roll_back_exactly(model):
    """Plain steps (in place), then transformers' assisted loop: record, verify several tokens, crop(-rejected)."""
    ids, mask = batch(model, pads=(0,), length=16)
    reference = model(ids, mask)
    cache = rewind.DynamicCache(config=model.config)
    model(ids[:, :4], mask, 0, cache)
    for t in range(4, 7):
        model(ids[:, t:t + 1], mask, t, cache)
    cache.activate_past_recording(4)
    draft = ids.clone()
    draft[:, 9] = (draft[:, 9] + 1) % V  # a wrong drafted token: positions 9.. rejected
    model(draft[:, 7:11], mask, 7, cache)  # verify 4 tokens
    cache.crop(-2)  # keep 7, 8
    assert lengths(cache) == [9] * len(LAYER_TYPES)
    got = model(ids[:, 9:12], mask, 9, cache)
    torch.testing.assert_close(got, reference[:, 9:12], rtol=0, atol=1e-5)
    cache.deactivate_past_recording()
    steps = [model(ids[:, t:t + 1], mask, t, cache) for t in range(12, 16)]  # in place again
    torch.testing.assert_close(torch.cat(steps, dim=1), reference[:, 12:16], rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_write_that_is_not_a_one_token_shift_is_refused_and_changes_nothing(model):
    ids, mask = batch(model, pads=(0,))
    cache = rewind.DynamicCache(config=model.config)
    model(ids[:, :5], mask, 0, cache)
    before = cache.layers[0].conv_states[0].clone()
    cache.layers[0].conv_states[0].fill_(1.0)
    with pytest.raises(rewind.StateError, match="not as a one-token shift"):
        cache.get_seq_length()
    torch.testing.assert_close(cache.layers[0].conv_states[0], before, rtol=0, atol=0)
    assert lengths(cache) == [5] * len(LAYER_TYPES)
