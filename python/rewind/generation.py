"""Speculative decoding inside transformers models, with rewind's exact rollback.

``generate`` drives any causal LM that follows transformers' cache conventions (``model(input_ids=...,
attention_mask=..., past_key_values=cache, use_cache=True, cache_position=...)`` returning ``.logits``) with a
``rewind.DynamicCache``: plain decoding, or a draft (an assistant model, or prompt lookup) verified in one forward
and rolled back exactly on every layer kind. Gated DeltaNet layers (Qwen3.5, Qwen3-Next) pass the cache only the
state after the whole forward; during verification ``generate`` wraps their kernel attributes
(``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``) to run the delta rule token by token and hands the
per-token states to ``update_recurrent_state(..., all_states=...)``, so a rejected draft rolls back exactly.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from . import _rewind as _rw

_KERNELS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule")
_MISSING = object()  # a kernel attribute the module did not hold in its own __dict__


def _bad(what: str, allowed: str, got: Any) -> Exception:
    return _rw.InvalidArgument(f"rewind.generate: {what} must be {allowed}, got {got!r}")


def _positional_names(fn: Any) -> list[str]:
    try:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return ["query", "key", "value", "g", "beta"]


def _token_by_token(original: Any, step: Any) -> Any:
    """A delta-rule kernel that runs ``step`` (the module's one-token kernel) over the tokens one at a time and
    records the state after each in ``states`` (a list the caller reads)."""
    names = _positional_names(original)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(names, args))
        bound.update(kwargs)
        q, k, v, g, beta = (bound.pop(n) for n in ("query", "key", "value", "g", "beta"))
        state = bound.pop("initial_state", None)
        bound.pop("output_final_state", None)
        bound.pop("chunk_size", None)
        import torch

        outs, states = [], []
        for t in range(q.shape[1]):  # transformers' layout: [B, T, H, D], gates [B, T, H]
            o, state = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g=g[:, t:t + 1], beta=beta[:, t:t + 1],
                            initial_state=state, output_final_state=True, **bound)
            outs.append(o)
            states.append(state)
        kernel.states = torch.stack(states, 0)
        return torch.cat(outs, dim=1), state

    kernel.states = None
    return kernel


@contextlib.contextmanager
def _per_token_states(model: Any, cache: Any):
    """While active, Gated DeltaNet modules of ``model`` give the cache the state after every token."""
    wrapped = []
    for module in model.modules() if hasattr(model, "modules") else []:
        if not all(hasattr(module, n) for n in _KERNELS) or not hasattr(module, "layer_idx"):
            continue
        step = getattr(module, "recurrent_gated_delta_rule")
        saved = {n: module.__dict__.get(n, _MISSING) for n in _KERNELS}
        kernels = {n: _token_by_token(getattr(module, n), step) for n in _KERNELS}
        for n, k in kernels.items():
            setattr(module, n, k)
        wrapped.append((module, saved, kernels))
    by_layer = {int(m.layer_idx): ks for m, _, ks in wrapped}
    original_update = cache.update_recurrent_state

    def update_recurrent_state(recurrent_states: Any, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> Any:
        kernels = by_layer.get(int(layer_idx))
        if kernels is not None and "all_states" not in kwargs:
            states = next((k.states for k in kernels.values() if k.states is not None), None)
            for k in kernels.values():
                k.states = None
            if states is not None and states.shape[0] > 1:
                kwargs["all_states"] = states
        return original_update(recurrent_states, layer_idx, state_idx, **kwargs)

    cache.update_recurrent_state = update_recurrent_state
    try:
        yield
    finally:
        del cache.update_recurrent_state  # back to the class's method
        for module, saved, _ in wrapped:
            for n, value in saved.items():
                if value is _MISSING:
                    delattr(module, n)
                else:
                    setattr(module, n, value)


class _Runner:
    """One model with its cache: feeds tokens at the cache's length, returns the logits of the fed tokens."""

    def __init__(self, model: Any, cache: Any, mask: Any) -> None:
        self.model, self.cache, self.mask = model, cache, mask
        params = inspect.signature(model.forward).parameters if hasattr(model, "forward") else {}
        self.takes_positions = "position_ids" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())

    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def feed(self, tokens: Any, per_token_states: bool = False) -> Any:
        import torch

        start = self.length()
        q = tokens.shape[1]
        if self.mask.shape[1] < start + q:
            ones = torch.ones(self.mask.shape[0], start + q - self.mask.shape[1], dtype=self.mask.dtype)
            self.mask = torch.cat([self.mask, ones], dim=1)
        mask = self.mask[:, :start + q]
        kwargs = dict(input_ids=tokens, attention_mask=mask, past_key_values=self.cache, use_cache=True,
                      cache_position=torch.arange(start, start + q))
        if self.takes_positions:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:start + q]
        ctx = _per_token_states(self.model, self.cache) if per_token_states else contextlib.nullcontext()
        with ctx:
            out = self.model(**kwargs)
        return out.logits if hasattr(out, "logits") else out[0]

    def crop_to(self, n: int) -> None:
        drop = self.length() - n
        if drop > 0:
            self.cache.crop(-drop)


def _probs(logits: Any, temperature: float, top_k: int | None, top_p: float | None) -> Any:
    """Sampling distribution of one row of logits after temperature, top-k and top-p (as transformers orders
    them)."""
    import torch

    x = logits.float() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, dim=-1)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return x.softmax(-1)


def _lookup(sequence: list[int], k: int, max_ngram: int = 2) -> list[int]:
    """Prompt lookup (transformers' PromptLookupCandidateGenerator): the k tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, n from max_ngram down to 1; [] when none matches."""
    for n in range(min(max_ngram, len(sequence) - 1), 0, -1):
        tail = sequence[-n:]
        for start in range(len(sequence) - n - 1, -1, -1):
            if sequence[start:start + n] == tail:
                follow = sequence[start + n:start + n + k]
                if follow:
                    return follow
    return []


def generate(model: Any, input_ids: Any, *, max_new_tokens: int, assistant_model: Any = None,
             prompt_lookup_num_tokens: int | None = None, num_assistant_tokens: int = 4, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             attention_mask: Any = None, eos_token_id: Any = None, past_key_values: Any = None) -> Any:
    """Decodes up to ``max_new_tokens`` after ``input_ids`` [B, T] and returns the prompt followed by the new ids
    (a LongTensor, as ``model.generate`` does by default).

    With ``assistant_model`` (``num_assistant_tokens`` drafts per round) or ``prompt_lookup_num_tokens`` (that
    many drafted tokens from the context), each round verifies the drafts in one forward of ``model`` and crops the
    rejected ones from every layer of its rewind cache, recurrent states included. Greedy output equals greedy
    decoding without speculation; with ``do_sample`` the drafts are accepted by speculative rejection sampling,
    so the output has the distribution of plain sampling, reproducible with ``seed``. Speculation takes one
    sequence (B = 1). ``past_key_values``: a rewind cache holding nothing or exactly a prefix of ``input_ids``
    (the rest is fed); default a fresh ``rewind.DynamicCache(config=model.config)``.
    """
    import torch

    from .cache_utils import DynamicCache

    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise _bad("max_new_tokens", "an int >= 0", max_new_tokens)
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise _bad("input_ids", "a [batch, tokens] LongTensor with at least one token",
                   getattr(input_ids, "shape", input_ids))
    if assistant_model is not None and prompt_lookup_num_tokens is not None:
        raise _rw.InvalidArgument("rewind.generate: give assistant_model or prompt_lookup_num_tokens, not both")
    speculative = assistant_model is not None or prompt_lookup_num_tokens is not None
    k = int(prompt_lookup_num_tokens if prompt_lookup_num_tokens is not None else num_assistant_tokens)
    if speculative and k < 1:
        raise _bad("the number of drafted tokens", ">= 1", k)
    if speculative and input_ids.shape[0] != 1:
        raise _rw.InvalidArgument(
            f"rewind.generate: speculative decoding takes one sequence (batch 1), got batch {input_ids.shape[0]}; "
            f"decode a batch without assistant_model / prompt_lookup_num_tokens"
        )
    if do_sample and not temperature > 0:
        raise _bad("temperature", "> 0 with do_sample", temperature)
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise _bad("top_k", "an int >= 1 or None", top_k)
    if top_p is not None and not 0 < top_p <= 1:
        raise _bad("top_p", "in (0, 1] or None", top_p)
    eos = set() if eos_token_id is None else set(
        [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(x) for x in eos_token_id])
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    cache = past_key_values if past_key_values is not None else DynamicCache(config=model.config)
    target = _Runner(model, cache, mask)
    if target.length() >= input_ids.shape[1]:
        raise _rw.InvalidArgument(
            f"rewind.generate: past_key_values holds {target.length()} tokens; it must hold fewer than the "
            f"{input_ids.shape[1]} of input_ids (a prefix of them)"
        )

    if max_new_tokens == 0:  # no forward: the cache stays as given
        return input_ids.clone()

    def pick(logits: Any) -> Any:  # [B, V] -> [B]
        if not do_sample:
            return logits.argmax(-1)
        return torch.multinomial(_probs(logits, temperature, top_k, top_p), 1, generator=generator)[:, 0]

    with torch.no_grad():
        logits = target.feed(input_ids[:, target.length():])[:, -1]
        if not speculative:
            out = []
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            for i in range(max_new_tokens):
                token = pick(logits)
                if eos:
                    pad = next(iter(eos))
                    token = torch.where(done, torch.full_like(token, pad), token)
                    done |= torch.tensor([int(t) in eos for t in token])
                out.append(token)
                if bool(done.all()) or i + 1 == max_new_tokens:
                    break
                logits = target.feed(token[:, None])[:, -1]
            new = torch.stack(out, 1) if out else input_ids[:, :0]
            return torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)
        return _speculate(target, input_ids, logits, max_new_tokens, k, assistant_model, do_sample, pick,
                          lambda x: _probs(x, temperature, top_k, top_p), generator, eos)


def _speculate(target: _Runner, input_ids: Any, logits: Any, max_new_tokens: int, k: int, assistant_model: Any,
               do_sample: bool, pick: Any, probs: Any, generator: Any, eos: set) -> Any:
    import torch

    from .cache_utils import DynamicCache

    sequence = [int(t) for t in input_ids[0]]
    new: list[int] = []
    target.cache.activate_past_recording(max(k, 1))
    draft = None
    if assistant_model is not None:
        draft = _Runner(assistant_model, DynamicCache(config=assistant_model.config), torch.ones(1, 0, dtype=torch.long))
        draft.cache.activate_past_recording(max(k, 1))
    pending = int(pick(logits)[0])  # sampled from the target; not yet in the target's cache
    while True:
        new.append(pending)
        sequence.append(pending)
        if pending in eos or len(new) >= max_new_tokens:
            break
        budget = max_new_tokens - len(new)
        drafts, q_rows = _draft(draft, sequence, min(k, budget), do_sample, pick, probs)
        fed = torch.tensor([[pending] + drafts])
        rows = target.feed(fed, per_token_states=True)[0]  # [1 + len(drafts), V]
        accepted, bonus = _verify(drafts, q_rows, rows, do_sample, probs, generator)
        target.crop_to(len(sequence) + accepted)
        if draft is not None:
            draft.crop_to(min(draft.length(), len(sequence) + accepted))
        for t in drafts[:accepted]:
            new.append(t)
            sequence.append(t)
            if t in eos or len(new) >= max_new_tokens:
                return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype)], dim=1)
        pending = bonus
    return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype)], dim=1)


def _draft(draft: _Runner | None, sequence: list[int], k: int, do_sample: bool, pick: Any, probs: Any) -> tuple:
    """Up to k drafted tokens after ``sequence`` and, for a draft model, the distribution each was drawn from."""
    import torch

    if draft is None:
        return _lookup(sequence, k), None
    tokens, q_rows = [], []
    logits = draft.feed(torch.tensor([sequence[draft.length():]]))[:, -1]
    for i in range(k):
        token = int(pick(logits)[0])
        tokens.append(token)
        q_rows.append(probs(logits[0]) if do_sample else None)
        if i + 1 < k:
            logits = draft.feed(torch.tensor([[token]]))[:, -1]
    return tokens, q_rows


def _verify(drafts: list[int], q_rows: Any, rows: Any, do_sample: bool, probs: Any, generator: Any) -> tuple:
    """(accepted drafts, the token after them) from the target's logits ``rows`` over [pending] + drafts."""
    import torch

    for i, t in enumerate(drafts):
        if not do_sample:
            best = int(rows[i].argmax())
            if best != t:
                return i, best
            continue
        p = probs(rows[i])
        q = q_rows[i] if q_rows is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([t]), 1.0)
        ratio = float(p[t]) / float(q[t]) if float(q[t]) > 0 else 0.0
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            continue
        residual = (p - q).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p
        return i, int(torch.multinomial(dist, 1, generator=generator)[0])
    last = rows[len(drafts)]
    if not do_sample:
        return len(drafts), int(last.argmax())
    return len(drafts), int(torch.multinomial(probs(last), 1, generator=generator)[0])
