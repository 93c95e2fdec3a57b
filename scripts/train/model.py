"""The rewind hybrid decoder in PyTorch: the architecture of
runtime/model.cc, defined once for training, export and the fixtures.

Everything here must compute what the C++ runtime computes (up to f32
rounding order): tests/runtime/shipped_models_test.cc checks the shipped
models against logits produced by this file (tests/fixtures/).

  decoder     pre-norm: h = x + mixer(norm1(x)); x = h + mlp(norm2(h));
              final norm, then lm_head (or the tied embedding)
  RMSNorm     weight * (x * (1 / sqrt(mean(x^2) + eps)))
  MLP         down(silu(gate(x)) * up(x))  (SwiGLU, no biases anywhere)
  vocabulary  258 = 256 bytes + BOS (256) + EOS (257)
  layer kinds
    full_attention     GQA, rotate-half RoPE over the whole head, scale 1/sqrt(hd)
    sliding_attention  the same, query p attends to keys [p - W + 1, p]
    linear_attention   Gated DeltaNet (Qwen3-Next): in_proj_qkv -> depthwise
                       causal conv1d (no bias) + SiLU over the q, k, v channels;
                       q, k L2-normalised (eps 1e-6 inside the sqrt of the sum
                       of squares), q scaled by 1/sqrt(k_dim); beta = sigmoid(b);
                       g = -exp(A_log) * softplus(a + dt_bias); per token
                       S = S*exp(g); delta = (v - S^T k)*beta; S += k delta^T;
                       o = S^T q; value head h reads key head h / (nv / nk);
                       o = rmsnorm(o) * weight * silu(z); out_proj
    conv               LFM2 short conv: in_proj -> B, C, x (in that order);
                       y = C * causal_depthwise_conv(B * x); out_proj

Tensor names are those of docs/model-format.md (state_dict() of Model gives
exactly the tensors expected_weights() lists).
"""
import json
import math
from dataclasses import dataclass, field, asdict
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention", "conv")


@dataclass
class Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: List[str]
    vocab_size: int = 258
    sliding_window: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    linear_conv_kernel_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    conv_L_cache: int = 0
    bos_token_id: int = 256
    eos_token_id: int = 257
    model_type: str = "rewind_hybrid"
    torch_dtype: str = "float16"

    def __post_init__(self):
        assert len(self.layer_types) == self.num_hidden_layers
        assert all(t in LAYER_KINDS for t in self.layer_types), self.layer_types
        assert self.num_attention_heads % self.num_key_value_heads == 0
        if "linear_attention" in self.layer_types:
            assert self.linear_num_value_heads % self.linear_num_key_heads == 0

    @staticmethod
    def from_dict(d):
        names = Config.__dataclass_fields__.keys()
        return Config(**{k: v for k, v in d.items() if k in names})

    @staticmethod
    def load(path):
        with open(path) as f:
            return Config.from_dict(json.load(f))

    def to_dict(self):
        return asdict(self)

    def linear_conv_dim(self):
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim


def rms_norm(x, weight, eps):
    return weight * (x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_tables(seq_len, head_dim, theta, device=None):
    """cos, sin [seq_len, head_dim / 2] for positions 0..seq_len-1, computed in
    double from the position alone and rounded to f32, as kernels.cc does."""
    half = head_dim // 2
    j = torch.arange(half, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * j / head_dim)
    angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().float().to(device), angle.sin().float().to(device)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE. x: [B, H, T, D]; cos, sin: [T, D / 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: Config, sliding: bool):
        super().__init__()
        d, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.window = c.sliding_window if sliding else 0
        self.q_proj = nn.Linear(d, nh * hd, bias=False)
        self.k_proj = nn.Linear(d, nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, d, bias=False)

    def forward(self, x, rope, recurrent=False, cache=None, layer_idx=None, pos0=0):
        B, T, _ = x.shape
        cos, sin = rope
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = apply_rope(q, cos[pos0:pos0 + T], sin[pos0:pos0 + T])
        k = apply_rope(k, cos[pos0:pos0 + T], sin[pos0:pos0 + T])
        if cache is not None:
            return self._cached(q, k, v, cache, layer_idx, pos0)
        group = self.nh // self.nkv
        if group > 1:  # query head h uses kv head h / group
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd))
        i = torch.arange(T, device=x.device)
        allowed = i[None, :] <= i[:, None]  # [query, key]
        if self.window > 0:
            allowed = allowed & (i[None, :] > i[:, None] - self.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def _cached(self, q, k, v, cache, layer_idx, pos0):
        """Attention over the keys a transformers-shaped cache returns: the
        new queries at positions [pos0, pos0 + T) against keys
        [kv_offset, pos0 + T) (get_mask_sizes says which)."""
        B, _, T, _ = q.shape
        kv_length, kv_offset = cache.get_mask_sizes(T, layer_idx)
        k, v = cache.update(k, v, layer_idx)
        assert k.shape[-2] == kv_length, (k.shape, kv_length)
        group = self.nh // self.nkv
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd))
        qpos = torch.arange(pos0, pos0 + T, device=q.device)[:, None]
        kpos = torch.arange(kv_offset, kv_offset + kv_length, device=q.device)[None, :]
        allowed = kpos <= qpos
        if self.window > 0:
            allowed = allowed & (kpos > qpos - self.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


def causal_depthwise_conv(x, weight):
    """out[t, c] = sum_i weight[c, 0, i] * x[t + i - (K - 1), c] (zeros before
    the start), summed in order of i as kernels.cc does. x: [B, T, C];
    weight: [C, 1, K] (nn.Conv1d's layout, used only as a parameter: shifted
    multiply-adds are much faster than torch's depthwise conv on CPU)."""
    K, T = weight.shape[-1], x.shape[1]
    xp = F.pad(x, (0, 0, K - 1, 0))
    out = xp[:, 0:T] * weight[:, 0, 0]
    for i in range(1, K):
        out = out + xp[:, i:i + T] * weight[:, 0, i]
    return out


def window_conv(window, weight):
    """causal_depthwise_conv over a cache's conv window [B, C, K-1+T] (the
    K-1 inputs before the new ones, then the T new ones): out [B, T, C],
    summed in the same order."""
    K = weight.shape[-1]
    xp = window.transpose(1, 2)
    T = xp.shape[1] - (K - 1)
    out = xp[:, 0:T] * weight[:, 0, 0]
    for i in range(1, K):
        out = out + xp[:, i:i + T] * weight[:, 0, i]
    return out


def l2norm(x, eps=1e-6):
    return x * (1.0 / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps))


def gated_delta_step(S, q, k, v, g, beta, t):
    """Token t of the recurrence of kernels.cc from state S [B, H, Dk, Dv]:
    (the state after it, its output [B, H, Dv])."""
    S = S * g[:, t].exp()[..., None, None]
    kv = (S * k[:, t, :, :, None]).sum(-2)
    delta = (v[:, t] - kv) * beta[:, t, :, None]
    S = S + k[:, t, :, :, None] * delta[:, :, None, :]
    return S, (S * q[:, t, :, :, None]).sum(-2)


def recurrent_gated_delta_rule(q, k, v, g, beta):
    """The per-token recurrence of kernels.cc (the reference the chunked form
    is tested against). q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g, beta:
    [B, T, H]. Returns o [B, T, H, Dv]."""
    B, T, H, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    out = []
    for t in range(T):
        S, o = gated_delta_step(S, q, k, v, g, beta, t)
        out.append(o)
    return torch.stack(out, 1)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk=64):
    """The same recurrence in chunks (WY form), differentiable and fast.

    Within a chunk, with G_t = cumsum(g) and D[t, s] = exp(G_t - G_s) for
    s <= t (0 above the diagonal), the state before the chunk S0 and
    u_t = delta_t the per-token update vectors:
        (I + A) U = beta*V - diag(beta * exp(G)) K S0,
        A[t, s] = beta_t D[t, s] (k_t . k_s) for s < t,
        O = diag(exp(G)) Q S0 + (Q K^T * D) U,
        S_end = exp(G_C) S0 + (K * exp(G_C - G))^T U.
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))          # [B, H, T, D]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)          # [B, H, T]
    if pad:  # beta = 0 and g = 0 after the end: the padding changes nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, N, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, N, chunk), beta.reshape(B, H, N, chunk)
    G = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * D).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    W, Kc = sol[..., :Dv], sol[..., Dv:]
    QK = (q @ k.transpose(-1, -2)) * D
    Gexp = G.exp()
    tail = (G[..., -1:] - G).exp()  # exp(G_C - G_t)
    S = q.new_zeros(B, H, Dk, Dv)
    outs = []
    for n in range(N):
        U = W[:, :, n] - Kc[:, :, n] @ S
        outs.append((q[:, :, n] * Gexp[:, :, n, :, None]) @ S + QK[:, :, n] @ U)
        S = S * Gexp[:, :, n, -1, None, None] + (k[:, :, n] * tail[:, :, n, :, None]).transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, H, N * chunk, Dv)[:, :, :T]
    return o.transpose(1, 2)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        d = c.hidden_size
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.kd, self.vd = c.linear_key_head_dim, c.linear_value_head_dim
        self.K = c.linear_conv_kernel_dim
        self.eps = c.rms_norm_eps
        channels = c.linear_conv_dim()
        self.in_proj_qkv = nn.Linear(d, channels, bias=False)
        self.in_proj_z = nn.Linear(d, self.nv * self.vd, bias=False)
        self.in_proj_b = nn.Linear(d, self.nv, bias=False)
        self.in_proj_a = nn.Linear(d, self.nv, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, self.K, groups=channels, bias=False, padding=self.K - 1)
        # Mamba-style initialisation: A in [1, 16], dt in [1e-3, 1e-1].
        self.A_log = nn.Parameter(torch.empty(self.nv).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(self.nv).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.norm = RMSNorm(self.vd, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.vd, d, bias=False)

    def forward(self, x, rope=None, recurrent=False, cache=None, layer_idx=None, pos0=0):
        B, T, _ = x.shape
        qk = self.nk * self.kd
        if cache is not None:
            window = cache.update_conv_state(self.in_proj_qkv(x).transpose(1, 2), layer_idx)
            mixed = F.silu(window_conv(window, self.conv1d.weight))
        else:
            mixed = F.silu(causal_depthwise_conv(self.in_proj_qkv(x), self.conv1d.weight))
        q = mixed[..., :qk].reshape(B, T, self.nk, self.kd)
        k = mixed[..., qk:2 * qk].reshape(B, T, self.nk, self.kd)
        v = mixed[..., 2 * qk:].reshape(B, T, self.nv, self.vd)
        q = l2norm(q) * (1.0 / math.sqrt(self.kd))
        k = l2norm(k)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)
        ratio = self.nv // self.nk
        if ratio > 1:  # value head h reads key head h / ratio
            q = q.repeat_interleave(ratio, dim=2)
            k = k.repeat_interleave(ratio, dim=2)
        if cache is not None:
            o = self._cached_rule(q, k, v, g, beta, cache, layer_idx)
        else:
            rule = recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
            o = rule(q, k, v, g, beta)
        z = self.in_proj_z(x).reshape(B, T, self.nv, self.vd)
        o = self.norm(o) * F.silu(z)
        return self.out_proj(o.reshape(B, T, self.nv * self.vd))


    def _cached_rule(self, q, k, v, g, beta, cache, layer_idx):
        """The per-token recurrence from the cache's state S(L), writing
        S(L+1) .. S(L+T) straight into the slots the cache hands out, so that
        a later crop can return to any of them."""
        B, T, H, Dk = k.shape
        shape = (B, H, Dk, v.shape[-1])
        update = cache.begin_recurrent_update(T, layer_idx, like=q.new_zeros(shape))
        S = update.previous().clone()
        out = []
        for t in range(T):
            S, o = gated_delta_step(S, q, k, v, g, beta, t)
            out.append(o)
            update.next(t + 1).copy_(S)
        update.commit()
        return torch.stack(out, 1)


class ShortConv(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        d = c.hidden_size
        self.in_proj = nn.Linear(d, 3 * d, bias=False)
        self.conv = nn.Conv1d(d, d, c.conv_L_cache, groups=d, bias=False, padding=c.conv_L_cache - 1)
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, rope=None, recurrent=False, cache=None, layer_idx=None, pos0=0):
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)
        if cache is not None:
            conv = window_conv(cache.update_conv_state((b * xx).transpose(1, 2), layer_idx), self.conv.weight)
        else:
            conv = causal_depthwise_conv(b * xx, self.conv.weight)
        return self.out_proj(c * conv)


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config, kind: str):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if kind in ("full_attention", "sliding_attention"):
            self.self_attn = Attention(c, sliding=kind == "sliding_attention")
        elif kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.conv = ShortConv(c)
        self.mlp = MLP(c)

    def mixer(self):
        return {"full_attention": "self_attn", "sliding_attention": "self_attn",
                "linear_attention": "linear_attn", "conv": "conv"}[self.kind]

    def forward(self, x, rope, recurrent=False, cache=None, layer_idx=None, pos0=0):
        h = self.input_layernorm(x)
        m = getattr(self, self.mixer())
        if cache is not None:
            x = x + m(h, rope, recurrent, cache=cache, layer_idx=layer_idx, pos0=pos0)
        else:
            x = x + m(h, rope, recurrent)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c, t) for t in c.layer_types])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.config = c
        self.model = Backbone(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self._rope = None
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 style: N(0, 0.02) for matrices, residual outputs scaled by
        1/sqrt(2 * layers); convolutions, norms and GDN gates keep their own."""
        n = self.config.num_hidden_layers
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                    std = 0.02 / math.sqrt(2 * n)
                nn.init.normal_(p, 0.0, std)

    def rope(self, T, device):
        c = self.config
        if self._rope is None or self._rope[0].shape[0] < T or self._rope[0].device != device:
            self._rope = rope_tables(max(T, 1024), c.head_dim, c.rope_theta, device)
        return self._rope

    def forward(self, tokens, recurrent=False, past_key_values=None):
        """tokens: [B, T] int64 at positions 0..T-1. Returns logits [B, T, V].

        With `past_key_values` (a transformers-shaped cache, e.g.
        rewind.DynamicCache(layer_types=config.layer_types, ...)), the
        tokens sit at positions [L, L + T), L = the cache's length; the
        cache receives their keys, values, conv inputs and recurrent states
        (computed token by token), and every earlier token comes from it."""
        x = self.model.embed_tokens(tokens)
        pos0 = past_key_values.get_seq_length() if past_key_values is not None else 0
        rope = self.rope(pos0 + tokens.shape[1], tokens.device)
        for i, layer in enumerate(self.model.layers):
            if past_key_values is not None:
                x = layer(x, rope, recurrent, cache=past_key_values, layer_idx=i, pos0=pos0)
            else:
                x = layer(x, rope, recurrent)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return x @ w.t()

    def parameter_count(self):
        return sum(p.numel() for p in self.state_dict().values())
