"""The reference runtime: load a model directory, forward tokens to logits, generate.

``Model.load(dir)`` reads DIR/config.json and DIR/model.safetensors (docs/model-format.md). ``forward`` returns
numpy float32 logits (``torch.from_numpy`` shares them); ``generate`` runs greedy or sampled decoding, speculative
with a draft model (``draft=``) or prompt lookup (``lookup=``), with the CLI's options.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _rewind as _rw

ModelCache = _rw.ModelCache


class Model:
    """A loaded model of the reference runtime (runtime/model.h)."""

    def __init__(self, core: Any) -> None:
        self._core = core

    @classmethod
    def load(cls, directory: str, weights: Optional[str] = None, pack: bool = True) -> "Model":
        """Loads a model directory (config.json + model.safetensors). ``weights="q8"`` quantizes the linear weights
        at load, as the CLI's ``--weights q8``; ``None`` loads them as the checkpoint holds them (a Q8 checkpoint
        written by ``rewind quantize`` as q8, any other as stored; docs/quantization.md). A current pack file of
        those weights in the directory (``rewind pack``) is mapped instead of packing unless ``pack=False``
        (docs/model-format.md). Raises FormatError for malformed files, InvalidArgument for another ``weights`` and
        for ``"as-stored"`` with a Q8 checkpoint."""
        return cls(_rw.Model.load(str(directory), weights, pack))

    @property
    def pack_path(self) -> str:
        """The pack file the matrices are mapped from, or "" (packed at load)."""
        return self._core.pack_path

    @property
    def pack_note(self) -> str:
        """Why a pack file in the directory was not used, or ""."""
        return self._core.pack_note

    @property
    def weights(self) -> str:
        """How the linear weights are held: "as-stored" or "q8"."""
        return self._core.weights

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    @property
    def parameter_count(self) -> int:
        return self._core.parameter_count

    @property
    def layer_types(self) -> list:
        return self._core.layer_types

    def make_cache(self) -> Any:
        """An empty rewind cache for one sequence of this model (crop, max_rollback, activate_past_recording)."""
        return self._core.make_cache()

    @property
    def tokenizer(self) -> str:
        """The tokenizer in use: the directory's tokenizer.json, or the byte-level scheme (BOS + bytes)."""
        return self._core.tokenizer

    def encode(self, text: str) -> list:
        """The tokens of ``text`` with the model's tokenizer, BOS / template tokens first (byte-level: BOS followed by
        the bytes of ``text``). Raises ValueError for text a BPE tokenizer cannot take (invalid UTF-8)."""
        return self._core.encode(text)

    def decode(self, tokens: Any) -> bytes:
        """The bytes of ``tokens`` with the model's tokenizer (special tokens skipped); may end inside a UTF-8
        character."""
        return self._core.decode(tokens)

    def forward(self, tokens: Any, cache: Any, all_logits: bool = True, as_torch: bool = False) -> Any:
        """Runs ``tokens`` at positions [L, L+n) and appends them to ``cache``; returns float32 logits [n, vocab]
        (or [vocab] for the last token), numpy or, with ``as_torch``, a torch tensor sharing the same memory."""
        logits = self._core.forward(tokens, cache, all_logits)
        if as_torch:
            import torch

            return torch.from_numpy(logits)
        return logits

    def generate(self, prompt: Any, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True, draft: "Model | None" = None,
                 num_draft: int = 4, lookup: int = 0, adaptive: bool = False,
                 max_prefill_rows: int = 2048) -> tuple:
        """Generates after ``prompt`` (token ids, or a str encoded with ``encode``): greedy (temperature 0) or
        sampled (temperature, top_k, top_p, seed); speculative with ``draft`` (K = ``num_draft``, ``adaptive``)
        or prompt lookup (``lookup`` = largest n-gram). The prompt goes in forwards of at most
        ``max_prefill_rows`` tokens (target and draft; the same tokens, bounded memory; >= 1). Returns
        ``(new_tokens, stats)``; greedy speculative decoding returns exactly the tokens of plain greedy
        decoding."""
        if isinstance(prompt, str):
            prompt = self.encode(prompt)
        return self._core.generate(
            prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos,
            draft._core if draft is not None else None, num_draft, lookup, adaptive, max_prefill_rows,
        )

    def generate_batch(self, prompts: Any, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True, draft: "Model | None" = None,
                       num_draft: int = 4, lookup: int = 0, adaptive: bool = False, max_batch: int = 0,
                       max_prefill_rows: int = 2048) -> tuple:
        """Many prompts in one batched cache (the CLI's ``--prompts`` / ``--max-batch``): every round one forward
        of every unfinished sequence; sequence i equals ``generate`` of its prompt alone with seed + i. Joining
        prompts share at most ``max_prefill_rows`` prompt tokens a forward. Returns ``(list of new tokens per
        prompt, stats)``."""
        if isinstance(prompts, (str, bytes, bytearray)):
            raise TypeError(f"generate_batch: prompts must be a list of prompts (each a str or a list of token ids); "
                            f"got a {type(prompts).__name__} (for one prompt, pass [prompt])")
        prompts = [self.encode(p) if isinstance(p, str) else p for p in prompts]
        return self._core.generate_batch(
            prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos,
            draft._core if draft is not None else None, num_draft, lookup, adaptive, max_batch, max_prefill_rows,
        )


def set_num_threads(n: int) -> None:
    """OpenMP threads of the runtime's forwards (the CLI's ``--threads``); shared with torch's OpenMP."""
    _rw.set_num_threads(int(n))


def get_num_threads() -> int:
    return _rw.get_num_threads()
