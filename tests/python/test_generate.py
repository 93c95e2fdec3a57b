"""rewind.generate on test doubles of transformers' model families.

transformers' modeling code is not available here, so each family is a small model of our own that follows the
calling conventions stated in issue 27 (test_inplace_conv.py has the short-conv and attention layers):

- Gated DeltaNet (Qwen3.5 / Qwen3-Next): module attributes ``chunk_gated_delta_rule`` (several tokens, or no
  previous state) and ``recurrent_gated_delta_rule`` (one token with a previous state), called with keywords
  ``g=, beta=, initial_state=cache.layers[i].recurrent_states[0], output_final_state=True``, then
  ``cache.update_recurrent_state(last_state, layer_idx)`` with only the final state; its conv written in place on
  one-token steps when not recording, as LFM2's.
- the model's forward takes ``input_ids, attention_mask, past_key_values, use_cache, cache_position,
  position_ids`` and returns an object with ``.logits``.

Expectations are computed without any cache: greedy decoding re-runs the whole sequence each step.
"""

import copy
import types

import pytest

torch = pytest.importorskip("torch")

import rewind  # noqa: E402
from test_inplace_conv import D, K, V, Attention, ShortConv, causal_conv1d_update  # noqa: E402

GH, DK, DV = 2, 4, 4
CONV_CHANNELS = 2 * GH * DK + GH * DV


def torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel=False):
    """The gated delta rule, one token after another: S <- S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q.
    Layout as transformers': q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H]; state [B, H, Dk, Dv]."""
    b, t_len, h, dk = query.shape
    state = initial_state.clone() if initial_state is not None else query.new_zeros(b, h, dk, value.shape[-1])
    outs = []
    for t in range(t_len):
        state = state * g[:, t].exp()[..., None, None]
        k_t = key[:, t]
        delta = (value[:, t] - (state * k_t[..., None]).sum(-2)) * beta[:, t][..., None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * query[:, t][..., None]).sum(-2))
    return torch.stack(outs, 1), (state if output_final_state else None)


def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False):
    """The several-token kernel: same values; gives the state after the last token only."""
    return torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state)


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.in_proj = torch.nn.Linear(D, CONV_CHANNELS + 2 * GH, bias=False)
        self.conv_weight = torch.nn.Parameter(torch.randn(CONV_CHANNELS, K) * 0.5)
        self.out_proj = torch.nn.Linear(GH * DV, D, bias=False)
        self.chunk_gated_delta_rule = torch_chunk_gated_delta_rule
        self.recurrent_gated_delta_rule = torch_recurrent_gated_delta_rule

    def forward(self, h, mask, cache):
        bsz, q, _ = h.shape
        i = self.layer_idx
        proj = self.in_proj(h)
        x = (proj[..., :CONV_CHANNELS] * mask[..., None]).transpose(1, 2)
        use_precomputed = cache is not None and cache.has_previous_state(i) and q == 1
        if use_precomputed and not cache.layers[i].record_past:
            mixed = causal_conv1d_update(x[..., 0], cache.layers[i].conv_states[0], self.conv_weight)[..., None]
        else:
            window = cache.update_conv_state(x, i, conv_kernel_size=K) if cache is not None else \
                torch.nn.functional.pad(x, (K - 1, 0))
            mixed = torch.stack([(window[..., j:j + K] * self.conv_weight).sum(-1) for j in range(q)], dim=-1)
        mixed = torch.nn.functional.silu(mixed).transpose(1, 2)
        qh = mixed[..., :GH * DK].reshape(bsz, q, GH, DK)
        kh = torch.nn.functional.normalize(mixed[..., GH * DK:2 * GH * DK].reshape(bsz, q, GH, DK), dim=-1)
        vh = mixed[..., 2 * GH * DK:].reshape(bsz, q, GH, DV)
        g = -torch.nn.functional.softplus(proj[..., CONV_CHANNELS:CONV_CHANNELS + GH])
        beta = torch.sigmoid(proj[..., CONV_CHANNELS + GH:])
        initial = cache.layers[i].recurrent_states[0] if cache is not None and cache.has_previous_state(i) else None
        kernel = self.recurrent_gated_delta_rule if use_precomputed else self.chunk_gated_delta_rule
        out, state = kernel(qh, kh, vh, g=g, beta=beta, initial_state=initial, output_final_state=cache is not None)
        if cache is not None:
            cache.update_recurrent_state(state, i)
        return self.out_proj(out.reshape(bsz, q, GH * DV))


FAMILIES = {
    "lfm2": (["conv", "full_attention", "conv", "full_attention"], {"conv_L_cache": K}),
    "qwen3_5": (["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                {"linear_conv_kernel_dim": K}),
    "qwen3_next": (["linear_attention", "full_attention", "linear_attention", "full_attention"],
                   {"linear_conv_kernel_dim": K}),
    "dense": (["full_attention", "full_attention"], {}),
}


class CausalLM(torch.nn.Module):
    def __init__(self, family, seed=11):
        super().__init__()
        types_, extra = FAMILIES[family]
        self.config = dict(layer_types=types_, **extra)
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(V, D)
        make = {"conv": ShortConv, "full_attention": Attention, "linear_attention": GatedDeltaNet}
        self.layers = torch.nn.ModuleList(make[t](i) for i, t in enumerate(types_))
        self.head = torch.nn.Linear(D, V, bias=False)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, cache_position=None,
                position_ids=None, **kwargs):
        q = input_ids.shape[1]
        start = int(cache_position[0]) if past_key_values is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape[0], start + q, dtype=torch.long)
        h = self.embed(input_ids)
        own = attention_mask[:, start:start + q].to(h.dtype)
        for layer in self.layers:
            if isinstance(layer, Attention):
                h = h + layer(h, attention_mask, start, past_key_values)
            else:
                h = h + layer(h, own, past_key_values)
        return types.SimpleNamespace(logits=self.head(h), past_key_values=past_key_values)


def greedy_without_cache(model, ids, n):
    seq = ids.clone()
    for _ in range(n):
        nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def counting_cache(model):
    cache = rewind.DynamicCache(config=model.config)
    crops = []
    original = cache.crop

    def crop(n):
        crops.append(n)
        return original(n)

    cache.crop = crop
    return cache, crops


def noisy_copy(model, scale, seed=5):
    draft = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        draft.head.weight.add_(torch.randn_like(draft.head.weight) * scale)
    return draft


PROMPT = torch.tensor([[3, 5, 7, 2, 3, 5, 7, 2, 3, 5]])


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_greedy_speculation_equals_greedy_decoding(family):
    model = CausalLM(family).eval()
    n = 24
    expected = greedy_without_cache(model, PROMPT, n)
    assert torch.equal(rewind.generate(model, PROMPT, max_new_tokens=n), expected)

    cache, crops = counting_cache(model)
    got = rewind.generate(model, PROMPT, max_new_tokens=n, assistant_model=noisy_copy(model, 0.6),
                          num_assistant_tokens=3, past_key_values=cache)
    assert torch.equal(got, expected)
    assert crops, "the noisy draft was never rejected: the rollback path went untested"
    assert any(c > -3 for c in crops), "no draft token was ever accepted in a rejected round"

    cache, lookup_crops = counting_cache(model)
    got = rewind.generate(model, PROMPT, max_new_tokens=n, prompt_lookup_num_tokens=3, past_key_values=cache)
    assert torch.equal(got, expected)
    assert lookup_crops, "prompt lookup was never rejected"
    # every new token is in the cache but possibly the last one (a bonus token is fed with the next round)
    assert cache.get_seq_length() in (PROMPT.shape[1] + n - 1, PROMPT.shape[1] + n)


@torch.no_grad()
def test_gated_deltanet_rollback_needs_the_per_token_states():
    """Without generate's kernel wrapping, transformers' convention gives only the final state: the crop after a
    rejected draft is refused (exactly what the wrapping fixes)."""
    model = CausalLM("qwen3_next").eval()
    cache = rewind.DynamicCache(config=model.config)
    model(PROMPT, past_key_values=cache, cache_position=torch.arange(PROMPT.shape[1]))
    cache.activate_past_recording(4)
    model(PROMPT[:, :3], past_key_values=cache, cache_position=torch.arange(10, 13))
    with pytest.raises(rewind.RollbackError):
        cache.crop(-2)


@torch.no_grad()
def test_eos_stops_and_left_padded_batches_decode_as_alone():
    model = CausalLM("lfm2").eval()
    expected = greedy_without_cache(model, PROMPT, 12)
    eos = int(expected[0, PROMPT.shape[1] + 4])
    first = next(i for i in range(12) if int(expected[0, PROMPT.shape[1] + i]) == eos)
    got = rewind.generate(model, PROMPT, max_new_tokens=12, eos_token_id=eos, prompt_lookup_num_tokens=2)
    assert torch.equal(got, expected[:, :PROMPT.shape[1] + first + 1])
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT[:, :7]], dim=1)
    ids = torch.cat([PROMPT, padded], dim=0)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    got = rewind.generate(model, ids, max_new_tokens=6, attention_mask=mask)
    assert torch.equal(got[0], expected[0, :PROMPT.shape[1] + 6])


@torch.no_grad()
def test_sampling_is_reproducible_and_speculation_keeps_the_distribution():
    model = CausalLM("qwen3_next").eval()
    draft = noisy_copy(model, 1.0)
    kw = dict(max_new_tokens=6, do_sample=True, temperature=1.5, top_k=8)
    a = rewind.generate(model, PROMPT, seed=3, assistant_model=draft, **kw)
    assert torch.equal(a, rewind.generate(model, PROMPT, seed=3, assistant_model=draft, **kw))
    # The second new token goes through verification (the first is drawn from the target directly): its law is
    # sum_x1 p(x1) p(x2 | x1), computed without a cache.
    p1 = rewind.generation._probs(model(PROMPT).logits[0, -1], 1.5, 8, None)
    law = torch.zeros(V)
    for x1 in range(V):
        if p1[x1] > 0:
            seq = torch.cat([PROMPT, torch.tensor([[x1]])], dim=1)
            law += p1[x1] * rewind.generation._probs(model(seq).logits[0, -1], 1.5, 8, None)
    runs = 600
    counts = torch.zeros(V)
    for seed in range(runs):
        out = rewind.generate(model, PROMPT, max_new_tokens=2, do_sample=True, temperature=1.5, top_k=8, seed=seed,
                              assistant_model=draft, num_assistant_tokens=2)
        counts[int(out[0, -1])] += 1
    assert counts[law == 0].sum() == 0  # top-k's excluded tokens never appear
    expected = law * runs
    keep = expected > 0
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < 40.0, (chi2, counts.tolist(), expected.tolist())  # 12 degrees of freedom: p < 1e-4 past 40


def test_bad_arguments_are_refused_before_any_forward():
    model = CausalLM("dense").eval()
    with pytest.raises(rewind.InvalidArgument, match="max_new_tokens"):
        rewind.generate(model, PROMPT, max_new_tokens=-1)
    with pytest.raises(rewind.InvalidArgument, match="batch 1"):
        rewind.generate(model, torch.cat([PROMPT, PROMPT]), max_new_tokens=2, prompt_lookup_num_tokens=2)
    with pytest.raises(rewind.InvalidArgument, match="not both"):
        rewind.generate(model, PROMPT, max_new_tokens=2, prompt_lookup_num_tokens=2, assistant_model=model)
    for kw in ({}, {"prompt_lookup_num_tokens": 2}, {"assistant_model": model}):
        cache = rewind.DynamicCache(config=model.config)
        assert torch.equal(rewind.generate(model, PROMPT, max_new_tokens=0, past_key_values=cache, **kw), PROMPT)
        assert cache.get_seq_length() == 0
    with pytest.raises(rewind.InvalidArgument, match="temperature"):
        rewind.generate(model, PROMPT, max_new_tokens=2, do_sample=True, temperature=0)
