"""Transformers-shaped cache classes over rewind's C++ layers.

The classes, methods, argument orders and return types follow transformers'
``cache_utils.py`` (``DynamicCache``, ``DynamicLayer``,
``DynamicSlidingWindowLayer``, ``DynamicIndexedLayer``,
``LinearAttentionLayer`` and the hybrid layers), so a model written against
transformers' cache interface runs on rewind by changing the constructor.
What they do follows rewind's contract (docs/semantics.md): every crop is
exact or raises and changes nothing, ``crop(0)`` shrinks to the minimal
working state, recurrent states roll back, and recording keeps at most ``R``
tokens of history. docs/python.md lists where this differs from
transformers.

Each Python layer owns one rewind ``_Layer`` per part (attention keys and
values, indexer keys, each conv state, each recurrent state), created lazily
from the first tensor that part receives, as transformers' lazy
initialization does. Every whole-layer and whole-cache operation (crop,
recording, batch operations, reset) is one call of rewind's C++ ``Cache``
over those parts (``_rw._Cache``): it checks every part of every layer before
it changes any, and its errors are the C++ ones. What stays here is what the
C++ layers cannot know: parts not created yet, transformers' own messages
for them, and how ``conv_states`` shows its inputs. A recurrent state given
only after a whole multi-token forward goes to the C++
``update_recurrent_state_final``, which refuses crops into that forward
itself. Results are views of rewind's storage (no copy): they stay valid
until the next call that changes the same layer; a stale view can be read
(it may show replaced values) but never dangles.
"""

from __future__ import annotations

from typing import Any, Iterable

from . import _rewind as _rw

# Rollback capacity `activate_past_recording()` uses when given no number.
# transformers records until the next crop without a bound; rewind keeps a
# bounded history (a recurrent state costs a whole state per token), so the
# default must be finite. Pass max_tokens to choose another.
DEFAULT_MAX_ROLLBACK = 32

_NOT_RECORDING = (
    "`crop` was called, but the current layer does not track past states. Call `activate_past_recording` "
    "before `crop` to be able to rollback the cache."
)
_LINEAR_POSITIVE = (
    "Linear attention layers can only be cropped by passing a negative int, to specify how many tokens to remove"
)
_NOT_LINEAR_CONV = "Cannot call `update_conv_state` on a non-LinearAttention layer!"
_NO_LINEAR_LAYER = (
    "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem to only "
    "contain Attention layers."
)


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _dtype_name(t: Any) -> str:
    name = str(t.dtype)
    if "bfloat16" in name:
        return "bf16"
    if "float16" in name:
        return "f16"
    if "float32" in name:
        return "f32"
    if getattr(t.dtype, "byteorder", "=") == ">" and getattr(t.dtype, "kind", "") == "f":
        raise _rw.InvalidArgument(
            f"dtype {name} has the other byte order than this machine's (big-endian); pass a native-order copy "
            f"(a.astype(a.dtype.newbyteorder('=')))"
        )
    raise _rw.InvalidArgument(f"dtype {name} is not supported (float32, float16, bfloat16)")


def _same_values(a: Any, b: Any) -> bool:
    """Whether tensors / arrays ``a`` and ``b`` (same shape) hold the same values, NaN equal to NaN."""
    if _is_torch(a) or _is_torch(b):
        import torch

        a = a if _is_torch(a) else torch.from_numpy(a)
        b = b if _is_torch(b) else torch.from_numpy(b)
        b = b.to(a.dtype)
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    import numpy as np

    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


def _query_length(query_length: Any) -> int:
    # Older transformers passed `cache_position` (a tensor of q positions).
    if hasattr(query_length, "shape") and len(query_length.shape) >= 1:
        return int(query_length.shape[0])
    return int(query_length)


def _with_grad(out: Any, new: Any, dim: int) -> Any:
    """``out`` (a view of rewind's storage whose last ``new.shape[dim]`` entries along ``dim`` are ``new``) as
    transformers returns it: ``torch.cat([cached, new])``, which carries ``new``'s autograd history. rewind's storage
    has none, so when ``new`` requires grad (and grad mode is on) the result is that concatenation, a copy; else
    the view itself."""
    if not (_is_torch(new) and new.requires_grad):
        return out
    import torch

    if not torch.is_grad_enabled():
        return out
    q = int(new.shape[dim])
    return torch.cat([out.narrow(dim, 0, int(out.shape[dim]) - q), new.to(out.dtype)], dim=dim)


def _zeros_broadcast(like: Any, shape: tuple) -> Any:
    """A read-only zero tensor of `shape` on ``like``'s device that costs one element (stride 0)."""
    if _is_torch(like):
        import torch

        return torch.zeros(1, dtype=like.dtype, device=like.device).expand(*shape)
    import numpy as np

    return np.broadcast_to(np.zeros(1, dtype=like.dtype), shape)


class _DeviceSlot:
    """The device a layer's (or a whole cache's) parts live on: None until ``device=`` or the first tensor fixes it,
    then a ``_rw._Device`` that every later part uses and every later tensor must be on. A cache and its layers
    share one slot."""

    __slots__ = ("dev",)

    def __init__(self, device: Any = None) -> None:
        self.dev = None if device is None else _rw._Device(device)

    def __deepcopy__(self, memo: dict) -> "_DeviceSlot":
        out = _DeviceSlot()
        out.dev = self.dev
        return out

    def __getstate__(self) -> tuple:
        return (self.dev,)  # a tuple: pickle skips __setstate__ for a None state

    def __setstate__(self, state: tuple) -> None:
        self.dev = state[0]

    def for_tensor(self, like: Any, what: str) -> Any:
        """The device a part created from ``like`` goes on: the fixed one (``like`` must be on it), else
        ``like``'s. Raises InvalidArgument, changing nothing, for a mismatch or a device rewind cannot use."""
        if self.dev is not None:
            self.dev.check(like, what)
            return self.dev
        return _rw._Device.of(like, what)


def _torch_device(dev: Any) -> Any:
    """``dev`` (a _Device) as transformers' ``layer.device`` holds it: a torch.device, or its name without torch."""
    try:
        import torch
    except ImportError:
        return dev.name
    return torch.device(dev.name)


class _RewindLayerBase:
    """What every rewind layer shares: parts, recording, crop, batch operations.

    Subclasses say which parts the layer has: an attention part (``full``,
    ``sliding`` or ``chunked``), an indexer part, linear parts (conv and
    recurrent states, ``number_of_states`` of each).
    """

    is_compileable = False
    is_sliding = False
    supports_early_init = True
    _kind_name = "full_attention"

    def _setup(
        self,
        attention: str | None = None,
        sliding_window: int | None = None,
        chunk_size: int | None = None,
        indexed: bool = False,
        linear: bool = False,
        number_of_states: int = 1,
        conv_kernel_size: int | None = None,
        device: Any = None,
    ) -> None:
        # Fixed by device= now (a bad one raises before anything is set) or by the first tensor.
        self._dev_slot = _DeviceSlot(device)
        self._attention = attention
        self._sliding_window = sliding_window
        self._chunk_size = chunk_size
        self._indexed = indexed
        self._linear = linear
        self._kv = None  # the attention part
        self._indexer = None
        self._convs: dict[int, Any] = {}
        self._recs: dict[int, Any] = {}
        # Per conv state: the torch tensors `conv_states` handed out since the
        # cache last changed, with a copy of what each held and its version
        # counter (see _commit_conv_writes).
        self._conv_handouts: dict[int, list] = {}
        # Per conv state, while recording: the columns transformers' conv_states would show (its recorded inputs
        # since the last crop); absent means K (conv_states property).
        self._conv_shown: dict[int, int] = {}
        self._recording: int | None = None
        self._index = -1
        # Bytes of this layer's buffers; counted in its cache's budget too.
        self._budget = _rw._Budget()
        self._default_conv_kernel_size = conv_kernel_size
        if linear:
            self.number_of_states = number_of_states
            self.conv_kernel_size: dict[int, int | None] = dict.fromkeys(range(number_of_states), conv_kernel_size)
        self.is_initialized = False
        self.dtype = None
        self.device = None if self._dev_slot.dev is None else _torch_device(self._dev_slot.dev)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}"

    # ---- copies (copy.deepcopy, pickle, torch.save) ----
    def __getstate__(self) -> dict:
        """The layer's attributes; a pending in-place conv write is taken first, and the tensors handed out stay
        with this layer. deepcopy copies each part with rwd::Layer::clone (history included); pickle stores what each
        part needs to continue (_Layer's pickle: no rollback history)."""
        self._commit_conv_writes()
        state = self.__dict__.copy()
        state["_conv_handouts"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # ---- parts ----
    def _parts(self) -> list:
        self._commit_conv_writes()
        parts = []
        if self._kv is not None:
            parts.append(self._kv)
        if self._indexer is not None:
            parts.append(self._indexer)
        parts.extend(self._convs[i] for i in sorted(self._convs))
        parts.extend(self._recs[i] for i in sorted(self._recs))
        return parts

    def _commit_conv_writes(self) -> None:
        """Takes an in-place write into a handed-out ``conv_states`` tensor as the conv input it stands for.

        transformers' LFM2, Qwen3.5 and Qwen3-Next, on a one-token cached step with recording off, run a fused
        ``causal_conv1d_update`` on ``layer.conv_states[0]``: it shifts the window left by one and writes the new
        input into the last column, and ``update_conv_state`` is never called. transformers' cache sees it because
        that tensor is its storage. rewind's tensor is a view of its storage too; at the next call that reads or
        changes this layer, the written window is put back and its new column appended through the C++ layer, so
        lengths, recording and rollback bounds stay exact.
        A write that is not such a shift cannot be taken (rewind stores inputs, not arbitrary windows): it is
        refused with StateError and the layer keeps its state."""
        handouts = getattr(self, "_conv_handouts", None)
        if not handouts:
            return
        self._conv_handouts = {}
        for i, entries in handouts.items():
            written = [(t, orig) for t, orig, version in entries if t._version != version]
            if not written:
                continue
            import torch

            part = self._convs[i]
            t = written[-1][0].clone()
            orig = written[-1][1]
            # The views alias the layer's storage (all of them: a write through one shows in every one): put
            # back what the layer holds before appending through it.
            for view, before in written:
                view.copy_(before)
            if t.shape != orig.shape or not torch.equal(t[..., :-1], orig[..., 1:]):
                raise _rw.StateError(
                    f"conv state {i} was written in place, but not as a one-token shift (columns 0..K-2 must be "
                    f"the old 1..K-1, the new input in column K-1, as causal_conv1d_update does); rewind cannot "
                    f"take an arbitrary window: call update_conv_state(x) instead {self._where_parts()}"
                )
            part.update_conv_state(t[..., -1:].contiguous())
            if i in self._conv_shown:
                self._conv_shown[i] += 1

    def _txn(self) -> Any:
        """The C++ cache over this layer's parts (rwd::Cache): one transactional call per operation."""
        return _rw._Cache(self._parts(), self._budget)

    def _rehome(self, budget: Any) -> None:
        """Counts this layer's buffers in ``budget`` (its cache's): those held so far move there, and later ones are
        allocated in it, so a whole-cache operation (run in that budget) keeps every count exact."""
        if budget is self._budget:
            return
        self._budget.set_parent(budget)
        self._budget = budget
        for p in self._parts():
            p._set_budget(budget)

    def _label(self) -> str:
        return f"layer {self._index} ({self._kind_name})" if self._index >= 0 else f"{self._kind_name} layer"

    def _where_parts(self) -> str:
        """Where, for messages raised while the parts may be out of step (no length read)."""
        return f"[{self._label()}]"

    def _new_part(self, kind: str, like: Any, what: str = "key_states", **options: Any):
        """A part built from its first tensor ``like``, on the layer's device (the first part fixes it from ``like``
        unless ``device=`` did). Raises, creating nothing, when ``like`` is on another device."""
        dev = self._dev_slot.for_tensor(like, what)
        part = _rw._Layer(kind, dtype=_dtype_name(like), index=self._index, as_torch=_is_torch(like),
                          budget=self._budget, device=dev, **options)
        if self._recording is not None:
            part.activate_past_recording(self._recording)
        if self._dev_slot.dev is None:
            self._dev_slot.dev = dev
        if self.dtype is None:
            self.dtype = like.dtype
            self.device = getattr(like, "device", None)
        return part

    def _share_device(self, slot: _DeviceSlot) -> None:
        """Puts this layer on ``slot`` (its cache's): the cache's device if fixed, else this layer's fixes it.
        Raises InvalidArgument, changing nothing, when both are fixed and differ."""
        if slot is self._dev_slot:
            return
        mine, theirs = self._dev_slot.dev, slot.dev
        if mine is not None and theirs is not None and mine.name != theirs.name:
            raise _rw.InvalidArgument(
                f"{self._label()} is on {mine.name}, but its cache is on {theirs.name}: a cache keeps one device"
            )
        if theirs is None:
            slot.dev = mine
        self._dev_slot = slot
        if self.device is None and slot.dev is not None:
            self.device = _torch_device(slot.dev)

    def _set_index(self, index: int) -> None:
        self._index = index
        for p in self._parts():
            p.set_index(index)

    def _where(self, n: int | None = None) -> str:
        return f"[{self._label()}: L={self.get_seq_length()}" + (f", crop({n})]" if n is not None else "]")

    def get_seq_length(self) -> int:
        """Tokens seen (the position of the next token); counted on every layer kind."""
        self._commit_conv_writes()
        if self._kv is not None:
            return self._kv.get_seq_length()
        lengths = [p.get_seq_length() for p in self._parts()]
        return max(lengths) if lengths else 0

    # ---- rollback ----
    def _check_crop_here(self, n: int) -> None:
        """What only this module can refuse in crop(n), before the C++ cache checks the parts: a lazy part that
        does not exist yet (transformers' messages for a layer without state)."""
        parts = self._parts()
        if not parts:
            if self._linear and self._recording is None:
                raise _rw.RollbackError(f"{_NOT_RECORDING} {self._where(n)}")
            if self._linear and n > 0:
                raise _rw.RollbackError(f"{_LINEAR_POSITIVE} {self._where(n)}")
            return

    def check_crop(self, max_length: int) -> None:
        """Raises exactly what ``crop(max_length)`` would raise; changes nothing."""
        n = int(max_length)
        self._check_crop_here(n)
        self._txn().check_crop(n)

    def crop(self, max_length: int | None = None, *, tokens_to_remove: int | None = None) -> None:
        """Removes ``-max_length`` tokens (negative), shrinks to the minimal working state (0), or keeps the first
        ``max_length`` tokens (positive, deprecated; attention only). Exact or raises, changing nothing.
        ``tokens_to_remove`` is the name transformers' linear-attention layers give the same argument."""
        if (max_length is None) == (tokens_to_remove is None):
            raise _rw.InvalidArgument("crop takes one argument: max_length (or tokens_to_remove)")
        n = int(max_length if max_length is not None else tokens_to_remove)
        self._check_crop_here(n)
        self._txn().crop(n)
        self._after_crop(n)

    def _after_crop(self, n: int) -> None:
        """This module's bookkeeping once the C++ cache cropped the parts."""
        # transformers keeps the K columns before the removed ones (fewer when fewer precede them).
        for i, shown in list(self._conv_shown.items()):
            k = self.conv_kernel_size[i]
            self._conv_shown[i] = max(0, shown + n) - max(0, shown + n - k) if n < 0 else min(shown, k)

    def max_rollback(self) -> int:
        """Largest k such that every ``crop(-j)``, j <= k, is exact now (the layer's length means any depth)."""
        return self._txn().max_rollback()

    def activate_past_recording(self, max_tokens: int | None = None) -> None:
        """Keeps enough history to remove up to ``max_tokens`` tokens exactly (default DEFAULT_MAX_ROLLBACK).
        All or nothing over the layer's parts."""
        r = DEFAULT_MAX_ROLLBACK if max_tokens is None else int(max_tokens)
        self._txn().activate_past_recording(r)
        self._set_recording(r)

    def deactivate_past_recording(self) -> None:
        """Stops recording and drops the history (all or nothing over the layer's parts)."""
        self._txn().deactivate_past_recording()
        self._set_recording(None)

    def _set_recording(self, r: int | None) -> None:
        """Bookkeeping once the C++ cache changed the parts' recording (R, None: off)."""
        self._recording = r
        if r is None:
            self._conv_shown = {}

    @property
    def record_past(self) -> bool:
        """True while the layer records past states (transformers' attribute)."""
        return self._recording is not None

    def is_recording(self) -> bool:
        """True while the layer records past states."""
        return self._recording is not None

    def recording_capacity(self) -> int:
        """R of activate_past_recording(R), 0 when not recording."""
        return self._recording or 0

    # ---- batch and reset ----
    def batch_select_indices(self, indices: Any) -> None:
        """Keeps batch rows ``indices`` of every stored tensor."""
        self._txn().batch_select_indices(_index_list(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats every batch row ``repeats`` times (beam expansion)."""
        self._txn().batch_repeat_interleave(int(repeats))

    def reorder_cache(self, beam_idx: Any) -> None:
        """Row i becomes old row ``beam_idx[i]`` in every stored tensor."""
        self._txn().reorder_cache(_index_list(beam_idx))

    def reset(self) -> None:
        """Back to an empty layer (L = 0, zero states, no history); shapes and recording stay."""
        self._txn().reset()
        self._after_reset()

    def _after_reset(self) -> None:
        self._conv_shown = {}

    def memory(self) -> dict:
        """Bytes reserved and used by this layer's parts."""
        reserved = used = 0
        for p in self._parts():
            m = p.memory()
            reserved += m["bytes_reserved"]
            used += m["bytes_used"]
        return {"kind": self._kind_name, "bytes_reserved": reserved, "bytes_used": used}

    def shrink_to_fit(self) -> None:
        """Releases the slack of grown buffers now; changes no content."""
        self._txn().shrink_to_fit()

    def offload(self) -> None:
        """rewind keeps its state in CPU memory already: nothing to move."""

    def prefetch(self) -> None:
        """rewind keeps its state in CPU memory already: nothing to move."""

    def get_max_length(self) -> int:
        """The window (sliding) or chunk size (chunked); -1 when the layer has no maximum."""
        if self._attention == "sliding":
            return int(self._sliding_window)
        if self._attention == "chunked":
            return int(self._chunk_size)
        return -1

    def get_max_cache_shape(self) -> int:
        """Deprecated transformers name of get_max_length."""
        return self.get_max_length()

    @property
    def batch_size(self) -> int:
        """Batch size of the stored tensors; -1 before the first update."""
        parts = self._parts()
        return parts[0].batch_size() if parts else -1


def _index_list(indices: Any) -> list[int]:
    if hasattr(indices, "tolist"):
        indices = indices.tolist()
    if isinstance(indices, int):
        indices = [indices]
    return [int(i) for i in indices]


class CacheLayerMixin(_RewindLayerBase):
    """Base of the attention layers (transformers' ``CacheLayerMixin``)."""

    # ---- attention ----
    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        """Builds the attention part from the first keys [B, H, q, Dk] and values [B, H, q, Dv]."""
        if len(key_states.shape) != 4 or len(value_states.shape) != 4:
            raise _rw.InvalidArgument(
                f"update: keys and values must be [batch, heads, tokens, head_dim], got {tuple(key_states.shape)} and "
                f"{tuple(value_states.shape)} {self._where()}"
            )
        b, h, _, dk = (int(x) for x in key_states.shape)
        dv = int(value_states.shape[-1])
        kind = {"full": "full_attention", "sliding": "sliding_attention", "chunked": "chunked_attention"}[self._attention]
        self._kv = self._new_part(
            kind,
            key_states,
            batch_size=b,
            num_kv_heads=h,
            key_dim=dk,
            value_dim=dv,
            sliding_window=int(self._sliding_window or 0),
            chunk_size=int(self._chunk_size or 0),
        )
        self.is_initialized = True

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple:
        """Appends q tokens and returns ``(keys, values)``: every key / value the new queries attend to
        (full: positions [0, L+q); sliding: [max(0, L-W+1), L+q); chunked: [floor(L/C)*C, L+q)), as views."""
        if self._kv is None:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._kv.update(key_states, value_states)
        return _with_grad(keys, key_states, -2), _with_grad(values, value_states, -2)

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple:
        """``(kv_length, kv_offset)`` of the keys the next update of ``query_length`` tokens returns."""
        q = _query_length(query_length)
        if self._kv is None:
            if q < 1:
                raise _rw.InvalidArgument(f"get_mask_sizes: query_length must be >= 1, got {q} {self._where()}")
            return q, 0
        return tuple(self._kv.get_mask_sizes(q))

    def _kept(self) -> tuple[int, int]:
        """Positions [first, end) of the minimal working state the attention part holds: from the first key the
        next token attends to (the C++ layer's kv_offset for one token)."""
        first, end = self._kv.stored_range()
        return max(first, int(self._kv.get_mask_sizes(1)[1])), end

    @property
    def keys(self) -> Any:
        """The keys the layer keeps for the next forward [B, H, n, Dk] (sliding: the last W-1, chunked: the current
        chunk); None before the first update. A view: valid until the next change of this layer."""
        if self._kv is None:
            return None
        k, _ = self._kv.keys_values()
        first, end = self._kept()
        stored_first, _ = self._kv.stored_range()
        return k[:, :, first - stored_first:]

    @property
    def values(self) -> Any:
        """The values matching ``keys``."""
        if self._kv is None:
            return None
        _, v = self._kv.keys_values()
        first, end = self._kept()
        stored_first, _ = self._kv.stored_range()
        return v[:, :, first - stored_first:]

    def stored_range(self) -> tuple:
        """Positions [first, end) the attention part retains (recording keeps more than ``keys`` shows)."""
        if self._kv is None:
            return (0, 0)
        return tuple(self._kv.stored_range())

    @property
    def cumulative_length(self) -> int:
        """Tokens seen (transformers' sliding-layer attribute; equals get_seq_length())."""
        return self.get_seq_length()


class DynamicLayer(CacheLayerMixin):
    """Full attention that grows with the sequence (transformers' ``DynamicLayer``): keys [B, H, L, Dk]."""

    is_sliding = False
    _kind_name = "full_attention"

    def __init__(self, **kwargs: Any) -> None:
        self._setup(attention="full", device=kwargs.get("device"))


class DynamicSlidingWindowLayer(DynamicLayer):
    """Sliding-window attention of window ``sliding_window`` (W): keeps the last W-1 tokens (W-1+R while
    recording R), returns the last min(L, W-1) + q keys from ``update``."""

    is_sliding = True
    _kind_name = "sliding_attention"

    def __init__(self, sliding_window: int, **kwargs: Any) -> None:
        if sliding_window is None or int(sliding_window) < 1:
            raise _rw.InvalidArgument(f"DynamicSlidingWindowLayer: sliding_window must be >= 1, got {sliding_window}")
        self._setup(attention="sliding", sliding_window=int(sliding_window), device=kwargs.get("device"))
        self.sliding_window = int(sliding_window)


class DynamicChunkedLayer(DynamicLayer):
    """Chunked local attention of chunk ``chunk_size`` (C), rewind's ``chunked_attention``: a query at p attends to
    [floor(p/C)*C, p]. (transformers runs chunked layers as sliding windows.)"""

    is_sliding = True
    _kind_name = "chunked_attention"

    def __init__(self, chunk_size: int | None = None, sliding_window: int | None = None, **kwargs: Any) -> None:
        size = chunk_size if chunk_size is not None else sliding_window
        if size is None or int(size) < 1:
            raise _rw.InvalidArgument(f"DynamicChunkedLayer: chunk_size must be >= 1, got {size}")
        self._setup(attention="chunked", chunk_size=int(size), device=kwargs.get("device"))
        self.chunk_size = int(size)


class DynamicIndexedLayer(DynamicLayer):
    """Full attention plus per-token indexer keys [B, L, D] (DeepSeek-V3.2 / GLM DSA), which every crop, reset and
    batch operation applies to as well."""

    _kind_name = "deepseek_sparse_attention"

    def __init__(self, **kwargs: Any) -> None:
        self._setup(attention="full", indexed=True, device=kwargs.get("device"))
        self.is_indexer_initialized = False

    def update_indexer(self, indexer_key_states: Any) -> Any:
        """Appends indexer keys [B, q, D] and returns those of every position the keys cover, [B, n, D]."""
        shape = tuple(int(x) for x in indexer_key_states.shape)
        if len(shape) != 3:
            raise _rw.InvalidArgument(
                f"update_indexer: indexer keys must be [batch, tokens, dim], got {shape} {self._where()}"
            )
        b, q, d = shape
        if self._indexer is None:
            # Stored as a one-head attention part whose values take one element
            # per token (fed from a stride-0 zero tensor).
            self._indexer = self._new_part(
                "full_attention", indexer_key_states, "indexer_key_states", batch_size=b, num_kv_heads=1, key_dim=d, value_dim=1
            )
            self.is_indexer_initialized = True
        keys = indexer_key_states.unsqueeze(1) if _is_torch(indexer_key_states) else indexer_key_states[:, None]
        out, _ = self._indexer.update(keys, _zeros_broadcast(indexer_key_states, (b, 1, q, 1)))
        return _with_grad(out[:, 0], indexer_key_states, -2)

    @property
    def indexer_keys(self) -> Any:
        """The indexer keys kept [B, L, D]; None before the first ``update_indexer``."""
        if self._indexer is None:
            return None
        k, _ = self._indexer.keys_values()
        return k[:, 0]


class LinearAttentionCacheLayerMixin(_RewindLayerBase):
    """Base of the layers with conv and recurrent states (transformers' ``LinearAttentionCacheLayerMixin``)."""

    is_compileable = False
    supports_early_init = False

    def lazy_initialization(self, conv_states: Any = None, recurrent_states: Any = None, state_idx: int = 0,
                            conv_kernel_size: int | None = None) -> None:
        """Builds the conv part of ``state_idx`` from its first input [B, C, q] (kernel size: ``conv_kernel_size``,
        the layer's, or as transformers infers it, the input's last dimension) and / or its recurrent part from a
        state [B, ...]."""
        if conv_states is not None and state_idx not in self._convs:
            shape = tuple(int(x) for x in conv_states.shape)
            if len(shape) != 3:
                raise _rw.InvalidArgument(
                    f"update_conv_state: inputs must be [batch, channels, tokens], got {shape} {self._where()}"
                )
            k = conv_kernel_size or self.conv_kernel_size.get(state_idx) or self._default_conv_kernel_size or shape[-1]
            self.conv_kernel_size[state_idx] = int(k)
            self._convs[state_idx] = self._new_part(
                "conv", conv_states, "conv_states", batch_size=shape[0], conv_kernel_size=int(k),
                conv_channels=[shape[1]]
            )
        if recurrent_states is not None and state_idx not in self._recs:
            shape = tuple(int(x) for x in recurrent_states.shape)
            if not 2 <= len(shape) <= 4:
                raise _rw.InvalidArgument(
                    f"update_recurrent_state: a state must be [batch, d1 (, d2 (, d3))], got {shape} {self._where()}"
                )
            dev = self._dev_slot.for_tensor(recurrent_states, "recurrent_states")
            part = _rw._Layer(
                "linear_attention",
                dtype=_dtype_name(recurrent_states),
                batch_size=shape[0],
                recurrent_shapes=[list(shape[1:])],
                recurrent_dtype=_dtype_name(recurrent_states),
                index=self._index,
                as_torch=_is_torch(recurrent_states),
                budget=self._budget,
                device=dev,
            )
            if self._recording is not None:
                part.activate_past_recording(self._recording)
            if self._dev_slot.dev is None:
                self._dev_slot.dev = dev
            if self.dtype is None:
                self.dtype = recurrent_states.dtype
                self.device = getattr(recurrent_states, "device", None)
            self._recs[state_idx] = part
        self.is_initialized = True

    def _check_state_idx(self, state_idx: int) -> None:
        if not 0 <= state_idx < self.number_of_states:
            raise _rw.IndexError(
                f"state_idx {state_idx} is outside [0, {self.number_of_states}) (number_of_states) {self._where()}"
            )

    def update_conv_state(self, conv_states: Any, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs: Any) -> Any:
        """Appends conv inputs [B, C, q] and returns the window [B, C, K-1+q]: the K-1 inputs before them (zeros
        before position 0) then the q new ones, so output j = sum_i w[i] * window[..., j+i]."""
        self._check_state_idx(state_idx)
        self._commit_conv_writes()
        if state_idx not in self._convs:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size)
        part = self._convs[state_idx]
        fresh = part.get_seq_length() == 0
        window = part.update_conv_state(conv_states)
        if self._recording is not None:
            q = int(conv_states.shape[-1])
            self._conv_shown[state_idx] = q if fresh else self._conv_shown.get(state_idx, self.conv_kernel_size[state_idx]) + q
        return _with_grad(window, conv_states, -1)

    def _rec_part(self, state_idx: int, like: Any) -> Any:
        self._check_state_idx(state_idx)
        self._commit_conv_writes()
        if state_idx not in self._recs:
            self.lazy_initialization(recurrent_states=like, state_idx=state_idx)
        return self._recs[state_idx]

    def _pending_tokens(self, state_idx: int) -> int:
        """Tokens the other parts of this layer are ahead of recurrent state ``state_idx`` (at least 1)."""
        rec = self._recs[state_idx].get_seq_length()
        others = [p.get_seq_length() for p in self._parts() if p is not self._recs[state_idx]]
        ahead = max(others) - rec if others else 0
        return ahead if ahead > 0 else 1

    def _check_all_states(self, final: Any, all_states: Any, state_idx: int) -> None:
        """Refuses (InvalidArgument, a ValueError; nothing stored) ``all_states`` whose last state is not ``final``,
        or whose length q differs from the tokens this layer's conv part (else its attention part) is ahead of
        the recurrent state in this step: storing it would put the layer's parts out of step."""
        q = int(all_states.shape[0])
        if q < 1:
            raise _rw.InvalidArgument(f"update_recurrent_state: all_states holds no state; give [q, B, ...] with q >= 1 "
                                      f"{self._where()}")
        last = all_states[q - 1]
        same_shape = tuple(int(x) for x in last.shape) == tuple(int(x) for x in final.shape)
        if not same_shape or not _same_values(last, final):
            what = (f"shape {tuple(int(x) for x in final.shape)} against all_states[-1]'s "
                    f"{tuple(int(x) for x in last.shape)}" if not same_shape else "different values")
            raise _rw.InvalidArgument(
                f"update_recurrent_state: recurrent_states (the final state) differs from all_states[-1] ({what}); "
                f"the final state must be the state after the last token, all_states[-1] {self._where()}"
            )
        rec = self._recs[state_idx].get_seq_length() if state_idx in self._recs else 0
        if state_idx in self._convs:
            ref, name = self._convs[state_idx].get_seq_length(), "conv part"
        else:
            others = [p.get_seq_length() for p in self._parts() if all(p is not r for r in self._recs.values())]
            ref, name = (max(others), "attention part") if others else (None, "")
        if ref is not None and ref - rec != q:
            raise _rw.InvalidArgument(
                f"update_recurrent_state: all_states holds {q} states but this layer's {name} received "
                f"{ref - rec} token(s) since the recurrent state's last update (it holds {ref}, the recurrent state "
                f"{rec}); give one state per token of this step {self._where()}"
            )

    def update_recurrent_state(self, recurrent_states: Any, state_idx: int = 0, *, num_tokens: int | None = None,
                               all_states: Any = None, **kwargs: Any) -> Any:
        """Stores the state after this forward's tokens and returns it (a view of the cache's copy).

        ``recurrent_states`` [B, ...] is the state after the forward's last token. The forward's token count q is
        ``num_tokens``, else how far this layer's conv / attention parts are ahead, else 1. With q > 1, pass
        ``all_states`` [q, B, ...] (the state after each token) to make rollbacks inside the forward exact;
        without it, a crop that would land inside the forward raises ``RollbackError``. With ``all_states``,
        ``recurrent_states`` must equal ``all_states[-1]`` and q must be the tokens the layer's conv part (else
        its attention part) received in this step; otherwise InvalidArgument (a ValueError) and nothing is stored.
        """
        like = all_states[0] if all_states is not None else recurrent_states
        if all_states is not None:
            self._check_state_idx(state_idx)
            q = int(all_states.shape[0])
            if num_tokens is not None and int(num_tokens) != q:
                raise _rw.InvalidArgument(
                    f"update_recurrent_state: num_tokens={num_tokens} but all_states holds {q} states {self._where()}"
                )
            self._check_all_states(recurrent_states, all_states, state_idx)
        part = self._rec_part(state_idx, like)
        if all_states is not None:
            update = part.begin_recurrent_update(q)
            for t in range(q):
                update.next(t + 1)[...] = all_states[t]
            update.commit()
        else:
            q = int(num_tokens) if num_tokens is not None else self._pending_tokens(state_idx)
            part.update_recurrent_state_final(recurrent_states, q)
        return part.get_recurrent_state()

    def begin_recurrent_update(self, num_tokens: int, state_idx: int = 0, like: Any = None) -> Any:
        """Zero-copy recurrent update (rewind): returns a handle whose ``previous()`` is S(L) and whose ``next(t)``
        is the cache slot to write S(L+t) into, t = 1..num_tokens; ``commit()`` keeps them. The recurrent part must
        exist (a first ``update_recurrent_state``) or ``like`` (a state [B, ...]) gives its shape."""
        self._check_state_idx(state_idx)
        if state_idx not in self._recs:
            if like is None:
                raise _rw.StateError(
                    f"begin_recurrent_update: recurrent state {state_idx} has no shape yet; pass like=<a state "
                    f"[B, ...]> {self._where()}"
                )
            self.lazy_initialization(recurrent_states=like, state_idx=state_idx)
        return self._recs[state_idx].begin_recurrent_update(int(num_tokens))

    def recurrent_snapshot(self, state_idx: int, position: int) -> Any:
        """S(position) for a snapshot still held (rewind)."""
        self._check_state_idx(state_idx)
        if state_idx not in self._recs:
            raise _rw.IndexError(f"recurrent state {state_idx} holds no snapshot yet {self._where()}")
        return self._recs[state_idx].recurrent_snapshot(0, int(position))

    @property
    def conv_states(self) -> dict:
        """Per state index: the last K conv inputs [B, C, K] (zeros before position 0), or None before the first
        update. While recording, the inputs transformers' cache shows then: every input since the last crop (all
        of a prefill made while recording, unpadded), after a crop the K before the removed ones (fewer when fewer
        precede them); at most what rewind retains (K + R); K zeros at L = 0. A torch tensor may be written in place as transformers' ``causal_conv1d_update``
        does (shift left, new input last): that write is this layer's update (_commit_conv_writes)."""
        self._commit_conv_writes()
        out = {}
        for i in range(self.number_of_states):
            if i not in self._convs:
                out[i] = None
                continue
            shown = self._conv_shown.get(i, self.conv_kernel_size[i])
            # At L = 0 (new, or rolled back entirely) the K zeros of a new layer.
            if shown == self.conv_kernel_size[i] or self._convs[i].get_seq_length() == 0:
                view = self._convs[i].get_conv_state()
            else:
                inputs = self._convs[i].conv_inputs()
                n = int(inputs.shape[-1])
                view = inputs[..., n - min(shown, n):]
            if _is_torch(view):
                self._conv_handouts.setdefault(i, []).append((view, view.clone(), view._version))
            out[i] = view
        return out

    @property
    def recurrent_states(self) -> dict:
        """Per state index: the recurrent state S(L) [B, ...], or None before the first update."""
        return {i: (self._recs[i].get_recurrent_state() if i in self._recs else None) for i in range(self.number_of_states)}

    @property
    def is_conv_states_initialized(self) -> dict:
        """Per state index: whether its conv part exists (received an input)."""
        return {i: i in self._convs for i in range(self.number_of_states)}

    @property
    def is_recurrent_states_initialized(self) -> dict:
        """Per state index: whether its recurrent part exists."""
        return {i: i in self._recs for i in range(self.number_of_states)}

    @property
    def has_previous_state(self) -> dict:
        """Per state index: whether that state has seen a token (a full rollback makes it False again)."""
        self._commit_conv_writes()
        out = {}
        for i in range(self.number_of_states):
            parts = [p for p in (self._convs.get(i), self._recs.get(i)) if p is not None]
            out[i] = any(p.get_seq_length() > 0 for p in parts)
        return out

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop(-1)`` would be exact now (rewind rolls recurrent states back too)."""
        try:
            self.check_crop(-1)
        except _rw.Error:
            return False
        return True


class LinearAttentionLayer(LinearAttentionCacheLayerMixin):
    """Conv and recurrent states (Gated DeltaNet, Mamba, LFM2 short conv), ``number_of_states`` of each."""

    _kind_name = "linear_attention"

    def __init__(self, number_of_states: int = 1, conv_kernel_size: int | None = None, **kwargs: Any) -> None:
        self._setup(linear=True, number_of_states=int(number_of_states), conv_kernel_size=conv_kernel_size,
                    device=kwargs.get("device"))

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple:
        """Raises StateError: a linear-attention layer has no keys to mask."""
        raise _rw.StateError(f"get_mask_sizes: a linear-attention layer has no attention part {self._where()}")


class LinearAttentionAndFullAttentionLayer(LinearAttentionLayer, DynamicLayer):
    """A hybrid layer: linear-attention states and full attention under one length, one crop."""

    _kind_name = "hybrid"

    def __init__(self, number_of_states: int = 1, conv_kernel_size: int | None = None, **kwargs: Any) -> None:
        self._setup(attention="full", linear=True, number_of_states=int(number_of_states),
                    conv_kernel_size=conv_kernel_size, device=kwargs.get("device"))

    get_mask_sizes = CacheLayerMixin.get_mask_sizes
    lazy_initialization = LinearAttentionCacheLayerMixin.lazy_initialization

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple:
        """Appends q tokens to the attention part; returns (keys, values) as DynamicLayer.update."""
        if self._kv is None:
            CacheLayerMixin.lazy_initialization(self, key_states, value_states)
        keys, values = self._kv.update(key_states, value_states)
        return _with_grad(keys, key_states, -2), _with_grad(values, value_states, -2)


class LinearAttentionAndSlidingWindowAttentionLayer(LinearAttentionLayer, DynamicSlidingWindowLayer):
    """A hybrid layer: linear-attention states and sliding-window attention."""

    is_sliding = True
    _kind_name = "hybrid_sliding"

    def __init__(self, sliding_window: int, number_of_states: int = 1, conv_kernel_size: int | None = None,
                 **kwargs: Any) -> None:
        if sliding_window is None or int(sliding_window) < 1:
            raise _rw.InvalidArgument(f"sliding_window must be >= 1, got {sliding_window}")
        self._setup(attention="sliding", sliding_window=int(sliding_window), linear=True,
                    number_of_states=int(number_of_states), conv_kernel_size=conv_kernel_size,
                    device=kwargs.get("device"))
        self.sliding_window = int(sliding_window)

    get_mask_sizes = CacheLayerMixin.get_mask_sizes
    lazy_initialization = LinearAttentionCacheLayerMixin.lazy_initialization
    update = LinearAttentionAndFullAttentionLayer.update


class StatelessLayer(_RewindLayerBase):
    """A layer without inference state (``moe`` / ``mlp`` placeholders): length 0, crops and batch operations do
    nothing."""

    _kind_name = "mlp"
    supports_early_init = False

    def __init__(self, **kwargs: Any) -> None:
        self._setup(device=kwargs.get("device"))

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple:
        """Raises StateError: a placeholder layer has no keys to mask."""
        raise _rw.StateError(f"get_mask_sizes: a {self._kind_name} layer has no attention part {self._where()}")


LAYER_TYPE_MAPPING = {
    "full_attention": DynamicLayer,
    "sliding_attention": DynamicSlidingWindowLayer,
    "chunked_attention": DynamicChunkedLayer,
    "linear_attention": LinearAttentionLayer,
    "conv": LinearAttentionLayer,
    "hybrid": LinearAttentionAndFullAttentionLayer,
    "hybrid_sliding": LinearAttentionAndSlidingWindowAttentionLayer,
    "deepseek_sparse_attention": DynamicIndexedLayer,
    "moe": StatelessLayer,
    "mlp": StatelessLayer,
}


def _config_get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def layer_types_and_kwargs(config: Any) -> tuple[list[str], dict]:
    """``(layer_types, layer kwargs)`` of a config object or dict, as transformers reads them: ``layer_types``, or
    ``num_hidden_layers`` of sliding (``sliding_window``), chunked (``attention_chunk_size``) or full layers; the
    window, chunk size, ``number_of_conv_states`` and a conv kernel size (``linear_conv_kernel_dim``,
    ``conv_L_cache``, ``conv_kernel_size``, ``mamba_d_conv``, ``conv_kernel``)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layer_types = _config_get(config, "layer_types")
    if layer_types is None:
        n = _config_get(config, "num_hidden_layers")
        if n is None:
            raise _rw.InvalidArgument("the config has neither `layer_types` nor `num_hidden_layers`")
        if _config_get(config, "sliding_window") is not None:
            layer_types = ["sliding_attention"] * int(n)
        elif _config_get(config, "attention_chunk_size") is not None:
            layer_types = ["chunked_attention"] * int(n)
        else:
            layer_types = ["full_attention"] * int(n)
    layer_types = list(layer_types)
    shared = _config_get(config, "num_kv_shared_layers")
    if shared:
        layer_types = layer_types[: -int(shared)]
    kwargs: dict = {}
    if "sliding_attention" in layer_types or "hybrid_sliding" in layer_types:
        kwargs["sliding_window"] = _config_get(config, "sliding_window")
    if "chunked_attention" in layer_types:
        kwargs["chunk_size"] = _config_get(config, "attention_chunk_size") or _config_get(config, "chunk_size")
    if any(t in ("conv", "linear_attention", "hybrid", "hybrid_sliding") for t in layer_types):
        kwargs["number_of_states"] = _config_get(config, "number_of_conv_states", 1) or 1
        # Linear-attention layers and LFM2-style short-conv layers name their
        # kernel sizes differently; a model may have both.
        for name in ("conv_kernel_size", "linear_conv_kernel_dim", "mamba_d_conv", "conv_kernel", "conv_L_cache"):
            if _config_get(config, name):
                kwargs["conv_kernel_size"] = int(_config_get(config, name))
                break
        for name in ("conv_L_cache", "conv_kernel_size", "linear_conv_kernel_dim", "conv_kernel"):
            if _config_get(config, name):
                kwargs["short_conv_kernel_size"] = int(_config_get(config, name))
                break
    return layer_types, kwargs


def _build_layer(layer_type: str, kwargs: dict) -> _RewindLayerBase:
    try:
        cls = LAYER_TYPE_MAPPING[layer_type]
    except KeyError:
        raise _rw.InvalidArgument(
            f"unknown layer type '{layer_type}'; accepted: {', '.join(LAYER_TYPE_MAPPING)}"
        ) from None
    kwargs = dict(kwargs)
    short = kwargs.pop("short_conv_kernel_size", None)
    if layer_type == "conv" and short is not None:
        kwargs["conv_kernel_size"] = short
    if layer_type == "chunked_attention":
        # transformers' DynamicCache runs chunked layers as sliding windows of the chunk size and builds the chunk
        # mask itself, relative to each row's first real token when the batch is left-padded; keeping only the
        # current chunk of absolute positions (DynamicChunkedLayer) would drop keys such a row still attends to.
        layer = DynamicSlidingWindowLayer(sliding_window=kwargs["chunk_size"], device=kwargs.get("device"))
        layer._kind_name = "chunked_attention"
        return layer
    layer = cls(**kwargs)
    if layer_type in ("moe", "mlp"):
        layer._kind_name = layer_type
    elif layer_type == "conv":
        layer._kind_name = "conv"
    return layer


class Cache:
    """A list of layers, one per model layer (transformers' ``Cache``). Every whole-cache operation is one call of
    rewind's C++ ``Cache`` over every layer's parts: it checks them all before it changes any, so an error leaves
    every layer as it was."""

    def __init__(self, layers: list | None = None, layer_class_to_replicate: type | None = None,
                 offloading: bool = False, offload_only_non_sliding: bool = True, *, device: Any = None) -> None:
        if layers is not None and layer_class_to_replicate is not None:
            raise _rw.InvalidArgument(
                "You can construct a Cache either from a list `layers` of all the predefined `CacheLayer`, or from a "
                "`layer_class_to_replicate`, in which case the Cache will append a new layer corresponding to "
                "`layer_class_to_replicate` for each new call to `update` with an idx not already in the Cache."
            )
        if layers is None and layer_class_to_replicate is None:
            raise _rw.InvalidArgument(
                "You should provide exactly one of `layers` or `layer_class_to_replicate` to initialize a Cache."
            )
        # One device for every layer: device= (a bad one raises here, before anything is built), else the first
        # tensor any layer receives (or a layer given already on one).
        self._dev_slot = _DeviceSlot(device)
        self.layers = list(layers) if layers is not None else []
        for layer in self.layers:
            slot = layer._dev_slot
            if self._dev_slot.dev is None:
                self._dev_slot.dev = slot.dev
            elif slot.dev is not None and slot.dev.name != self._dev_slot.dev.name:
                raise _rw.InvalidArgument(
                    f"Cache: a {layer._kind_name} layer is on {slot.dev.name}, but the cache is on "
                    f"{self._dev_slot.dev.name} (device= or an earlier layer): a cache keeps one device"
                )
        # Every layer's buffers count in the cache's budget (set_memory_budget).
        self._budget = _rw._Budget()
        for i, layer in enumerate(self.layers):
            self._adopt(layer, i)
        self.layer_class_to_replicate = layer_class_to_replicate
        self.offloading = offloading
        self._recording: int | None = None

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(layers={self.layers})"

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> tuple:
        """``(keys, values)`` of layer ``layer_idx`` (transformers' legacy indexing, ``cache[i][0]``)."""
        if not 0 <= layer_idx < len(self.layers):
            raise KeyError(f"Cache only has {len(self.layers)} layers, attempted to access layer with index {layer_idx}")
        layer = self.layers[layer_idx]
        return getattr(layer, "keys", None), getattr(layer, "values", None)

    def to_legacy_cache(self) -> tuple:
        """The layers' ``(keys, values)`` as a tuple (transformers' legacy format)."""
        return tuple(self[i] for i in range(len(self.layers)))

    def __iter__(self):
        """(keys, values, sliding window) per layer, as transformers' DDP data; the window is a 0-d tensor for
        sliding layers, None otherwise (``DynamicCache(list(cache))`` rebuilds the layers)."""
        for layer in self.layers:
            window = getattr(layer, "sliding_window", None)
            if window is not None:
                import torch

                window = torch.tensor(window)
            yield getattr(layer, "keys", None), getattr(layer, "values", None), window

    def _adopt(self, layer: _RewindLayerBase, index: int) -> None:
        layer._share_device(self._dev_slot)
        layer._set_index(index)
        layer._rehome(self._budget)

    @property
    def device(self) -> Any:
        """The device every layer's state is on (a torch.device): ``device=`` or the first tensor's; None before
        either."""
        return None if self._dev_slot.dev is None else _torch_device(self._dev_slot.dev)

    def _txn(self) -> Any:
        """The C++ cache over every layer's parts (rwd::Cache): one transactional call per whole-cache operation."""
        return _rw._Cache([p for layer in self.layers for p in layer._parts()], self._budget)

    def _layer(self, layer_idx: int, grow: bool = False) -> _RewindLayerBase:
        if grow and self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                layer = self.layer_class_to_replicate()
                self._adopt(layer, len(self.layers))
                if self._recording is not None:
                    layer.activate_past_recording(self._recording)
                self.layers.append(layer)
        if not 0 <= layer_idx < len(self.layers):
            raise _rw.IndexError(f"layer index {layer_idx} is outside [0, {len(self.layers)})")
        return self.layers[layer_idx]

    # ---- per-layer forwards ----
    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple:
        """Appends q tokens to layer ``layer_idx``; returns ``(keys, values)`` the new queries attend to."""
        if layer_idx >= len(self.layers):
            self._dev_slot.for_tensor(key_states, "key_states")  # a refused device grows no layer
        layer = self._layer(layer_idx, grow=True)
        if not hasattr(layer, "update"):
            raise _rw.StateError(f"Cannot call `update` on layer {layer_idx}: a {layer._kind_name} layer has no attention")
        return layer.update(key_states, value_states, *args, **kwargs)

    def update_conv_state(self, conv_states: Any, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> Any:
        """Appends conv inputs [B, C, q]; returns the window [B, C, K-1+q] (see ``LinearAttentionLayer``)."""
        layer = self._layer(layer_idx)
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise _rw.StateError(_NOT_LINEAR_CONV)
        return layer.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> Any:
        """Stores the recurrent state after this forward (see ``LinearAttentionLayer.update_recurrent_state``)."""
        layer = self._layer(layer_idx)
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise _rw.StateError(_NOT_LINEAR_CONV)
        return layer.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def begin_recurrent_update(self, num_tokens: int, layer_idx: int, state_idx: int = 0, like: Any = None) -> Any:
        """Zero-copy recurrent update of layer ``layer_idx`` (rewind; see ``LinearAttentionLayer``)."""
        layer = self._layer(layer_idx)
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise _rw.StateError(_NOT_LINEAR_CONV)
        return layer.begin_recurrent_update(num_tokens, state_idx, like)

    def update_indexer(self, indexer_key_states: Any, layer_idx: int) -> Any:
        """Appends indexer keys [B, q, D] to layer ``layer_idx``; returns the kept ones [B, n, D]."""
        layer = self._layer(layer_idx)
        if not hasattr(layer, "update_indexer"):
            raise _rw.StateError(
                f"Cannot call `update_indexer` on layer {layer_idx} which is a {type(layer).__name__}; it has no "
                f"indexer key cache (expected a `DynamicIndexedLayer` or `StaticIndexedLayer`)."
            )
        return layer.update_indexer(indexer_key_states)

    def early_initialization(self, batch_size: int, num_heads: Any, head_dim: Any, dtype: Any, device: Any = None) -> None:
        """Builds every attention layer's storage ahead of its first update (transformers' name): ``num_heads`` and
        ``head_dim`` are ints or per-layer lists; ``dtype`` a torch dtype; ``device`` (default: the cache's, else
        cpu) fixes the cache's device, and must be it when already fixed. Linear layers stay lazy."""
        import torch

        dev = _rw._Device(device) if device is not None else (self._dev_slot.dev or _rw._Device("cpu"))
        if self._dev_slot.dev is not None and self._dev_slot.dev.name != dev.name:
            raise _rw.InvalidArgument(
                f"early_initialization: device={device!r} is {dev.name}, but this cache is on "
                f"{self._dev_slot.dev.name} (a cache keeps one device); nothing was changed"
            )

        n = len(self.layers)
        heads = [num_heads] * n if isinstance(num_heads, int) else list(num_heads)
        dims = [head_dim] * n if isinstance(head_dim, int) else list(head_dim)
        if len(heads) != n or len(dims) != n:
            raise _rw.InvalidArgument(
                f"early_initialization: num_heads / head_dim lists have {len(heads)} / {len(dims)} entries for "
                f"{n} layers"
            )
        for layer, h, d in zip(self.layers, heads, dims):
            if isinstance(layer, CacheLayerMixin) and layer._kv is None:
                fake = torch.zeros((batch_size, h, 0, d), dtype=dtype, device=dev.name)
                CacheLayerMixin.lazy_initialization(layer, fake, fake)

    # ---- queries ----
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by layer ``layer_idx`` (0 for a layer not created yet); defined on every layer kind."""
        if layer_idx >= len(self.layers):
            return 0
        if layer_idx == 0 and isinstance(self.layers[0], StatelessLayer):
            for layer in self.layers:
                if not isinstance(layer, StatelessLayer):
                    return layer.get_seq_length()
        return self._layer(layer_idx).get_seq_length()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Position of the next query of layer layer_idx (its length)."""
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: Any, layer_idx: int) -> tuple:
        """``(kv_length, kv_offset)`` for layer ``layer_idx``'s next update of ``query_length`` tokens."""
        q = _query_length(query_length)
        if layer_idx >= len(self.layers):
            return q, 0
        layer = self.layers[layer_idx]
        if not isinstance(layer, CacheLayerMixin):
            if layer_idx != 0:
                raise _rw.StateError(
                    f"You called `get_mask_sizes` on layer index {layer_idx}, but this layer is a LinearAttention "
                    "layer, which does not track sequence length."
                )
            attention = [x for x in self.layers if isinstance(x, CacheLayerMixin)]
            if not attention:
                raise _rw.StateError(
                    "`get_mask_sizes` can only be called on Attention layers, and the current Cache seem to only "
                    "contain LinearAttention layers."
                )
            layer = attention[0]
        return layer.get_mask_sizes(q)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """Largest get_max_length over the layers (or of layer layer_idx); -1 for no maximum."""
        if layer_idx is not None and layer_idx >= len(self.layers):
            return -1
        if layer_idx is None:
            return max((layer.get_max_length() for layer in self.layers), default=-1)
        return self.layers[layer_idx].get_max_length()

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """Deprecated transformers name of get_max_length."""
        return self.get_max_length(layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether a linear-attention layer (default: the last one) has seen a token."""
        if layer_idx is not None and layer_idx >= len(self.layers):
            return False
        if layer_idx is None:
            linear = [i for i, x in enumerate(self.layers) if isinstance(x, LinearAttentionCacheLayerMixin)]
            if not linear:
                raise _rw.StateError(_NO_LINEAR_LAYER)
            layer_idx = linear[-1]
        elif not isinstance(self.layers[layer_idx], LinearAttentionCacheLayerMixin):
            raise _rw.StateError(
                f"You called `has_previous_state` on layer index {layer_idx}, but this layer is an Attention layer, "
                "which does not support calling it."
            )
        states = self.layers[layer_idx].has_previous_state
        if state_idx is None:
            return all(states.values())
        return states[state_idx]

    # ---- whole-cache operations (transactional) ----
    def check_crop(self, max_length: int) -> None:
        """Raises exactly what ``crop(max_length)`` would raise; changes nothing (rewind)."""
        n = int(max_length)
        for layer in self.layers:
            layer._check_crop_here(n)
        self._txn().check_crop(n)

    def crop(self, max_length: int) -> None:
        """Transactional crop of every layer: negative removes that many tokens, 0 shrinks every layer to its
        minimal working state, positive (deprecated) keeps the first ``max_length`` tokens where every layer can."""
        n = int(max_length)
        for layer in self.layers:
            layer._check_crop_here(n)
        self._txn().crop(n)
        for layer in self.layers:
            layer._after_crop(n)

    def max_rollback(self) -> int:
        """Largest k such that every ``crop(-j)``, j <= k, is exact now, over every stateful layer (rewind)."""
        return self._txn().max_rollback()

    def activate_past_recording(self, max_tokens: int | None = None) -> None:
        """Every layer keeps enough history to remove up to ``max_tokens`` tokens exactly
        (default DEFAULT_MAX_ROLLBACK); call before the first forward. All or nothing: a refusal (CapacityError:
        the budget or the system refused recurrent snapshot slots) leaves every layer as it was."""
        r = DEFAULT_MAX_ROLLBACK if max_tokens is None else int(max_tokens)
        self._txn().activate_past_recording(r)
        for layer in self.layers:
            layer._set_recording(r)
        self._recording = r

    def deactivate_past_recording(self) -> None:
        """Stops recording in every layer and drops the history (all or nothing, as activate_past_recording)."""
        self._txn().deactivate_past_recording()
        for layer in self.layers:
            layer._set_recording(None)
        self._recording = None

    def is_recording(self) -> bool:
        """True when every layer records."""
        return bool(self.layers) and all(x.is_recording() for x in self.layers)

    def reorder_cache(self, beam_idx: Any) -> None:
        """Row i of every layer becomes old row ``beam_idx[i]``."""
        self._txn().reorder_cache(_index_list(beam_idx))

    def batch_select_indices(self, indices: Any) -> None:
        """Keeps batch rows ``indices`` of every layer."""
        self._txn().batch_select_indices(_index_list(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats every batch row ``repeats`` times in every layer."""
        self._txn().batch_repeat_interleave(int(repeats))

    def reset(self) -> None:
        """Every layer back to empty (L = 0); configuration and recording stay."""
        self._txn().reset()
        for layer in self.layers:
            layer._after_reset()

    def memory(self) -> dict:
        """Bytes reserved and used, per layer and in total (rewind's memory report)."""
        layers = [x.memory() for x in self.layers]
        return {
            "layers": layers,
            "bytes_reserved": sum(m["bytes_reserved"] for m in layers),
            "bytes_used": sum(m["bytes_used"] for m in layers),
        }

    def set_memory_budget(self, bytes: int) -> None:
        """Caps the bytes of rewind buffers this cache may hold (0: no cap, the default). An operation that would
        allocate past the cap raises CapacityError naming the budget and changes nothing; growth counts old and new
        buffer while both exist. Raises CapacityError, keeping the old cap, when more are reserved already (rewind)."""
        self._budget.set_limit(int(bytes))

    def memory_budget(self) -> int:
        """The cap of set_memory_budget (0: none)."""
        return self._budget.limit

    def budget_reserved(self) -> int:
        """Bytes of rewind buffers the budget counts now (allocations, rounded to 64 bytes)."""
        return self._budget.reserved

    def shrink_to_fit(self) -> None:
        """Releases the slack of every grown buffer now; changes no content."""
        self._txn().shrink_to_fit()

    # ---- properties ----
    @property
    def max_batch_size(self) -> int:
        """transformers' name of ``batch_size`` (a dynamic cache has no preallocated batch)."""
        return self.batch_size

    @property
    def max_cache_len(self) -> int:
        """``get_max_length()``: the largest window or chunk size over the layers, -1 when none has a maximum."""
        return self.get_max_length()

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """transformers' offloading hook; rewind's state is in CPU memory already, so nothing moves."""
        self._layer(layer_idx).offload()

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """transformers' offloading hook; rewind's state is in CPU memory already, so nothing moves."""
        self._layer(layer_idx).prefetch()

    @property
    def batch_size(self) -> int:
        """Batch size shared by the layers; -1 before any update. Raises StateError when layers disagree."""
        values = [x.batch_size for x in self.layers if x.batch_size != -1]
        if not values:
            return -1
        if len(set(values)) > 1:
            raise _rw.StateError(f"The batch size is not consistent across layers: {values}")
        return values[0]

    @property
    def is_compileable(self) -> bool:
        """Always False: rewind's buffers are not torch.compile static addresses."""
        return False

    @property
    def is_initialized(self) -> bool:
        """True once every attention layer received its first update."""
        layers = [x for x in self.layers if x.supports_early_init]
        return len(layers) > 0 and all(x.is_initialized for x in layers)

    @property
    def is_sliding(self) -> list:
        """Per layer: sliding-window (or chunked) attention."""
        return [getattr(x, "is_sliding", False) for x in self.layers]

    @property
    def is_linear(self) -> list:
        """Per layer: linear-attention states without full attention (transformers' definition)."""
        return [
            isinstance(x, LinearAttentionCacheLayerMixin) and not isinstance(x, LinearAttentionAndFullAttentionLayer)
            for x in self.layers
        ]


class DynamicCache(Cache):
    """transformers' ``DynamicCache`` with rewind's layers and rollback.

    Built from ``config`` (an object or dict with ``layer_types``, ``sliding_window``, ...; a transformers config
    works), from ``layer_types`` plus ``sliding_window`` / ``attention_chunk_size`` / ``number_of_states`` /
    ``conv_kernel_size`` keywords (rewind), from ``ddp_cache_data`` (an iterable of ``(keys, values)`` per layer),
    or, with none of them, as full-attention layers created as ``update`` reaches them.
    """

    def __init__(self, ddp_cache_data: Iterable | None = None, config: Any = None, offloading: bool = False,
                 offload_only_non_sliding: bool = False, *, layer_types: list | None = None,
                 sliding_window: int | None = None, attention_chunk_size: int | None = None,
                 number_of_states: int = 1, conv_kernel_size: int | None = None, device: Any = None) -> None:
        # Resolved first: a bad device raises before any layer is built, and ddp_cache_data goes onto it.
        dev = None if device is None else _rw._Device(device)
        layers: list = []
        if config is not None and layer_types is not None:
            raise _rw.InvalidArgument("DynamicCache: give `config` or `layer_types`, not both")
        if layer_types is not None:
            config = {
                "layer_types": list(layer_types),
                "sliding_window": sliding_window,
                "attention_chunk_size": attention_chunk_size,
                "number_of_conv_states": number_of_states,
                "conv_kernel_size": conv_kernel_size,
            }
        if config is not None:
            types, kwargs = layer_types_and_kwargs(config)
            layers = [_build_layer(t, dict(kwargs, device=dev)) for t in types]
        if ddp_cache_data is not None:
            for layer_idx, data in enumerate(ddp_cache_data):
                if config is None:
                    window = data[2] if len(data) == 3 else None
                    if window is not None:
                        w = int(window.reshape(-1)[0]) if hasattr(window, "reshape") else int(window)
                        layers.append(DynamicSlidingWindowLayer(sliding_window=w, device=dev))
                    else:
                        layers.append(DynamicLayer(device=dev))
                layers[layer_idx].update(data[0], data[1])
        if layers:
            super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding,
                             device=dev)
        else:
            super().__init__(layer_class_to_replicate=DynamicLayer, offloading=offloading,
                             offload_only_non_sliding=offload_only_non_sliding, device=dev)


def _from_legacy_cache(cls, past_key_values: Iterable) -> "DynamicCache":
    """A DynamicCache filled from transformers' legacy format ``((keys, values), ...)``."""
    return cls(ddp_cache_data=[tuple(x) for x in past_key_values])


DynamicCache.from_legacy_cache = classmethod(_from_legacy_cache)


class EncoderDecoderCache(Cache):
    """A self-attention cache that rolls back like any other and a cross-attention cache written once from the
    encoder output (transformers' ``EncoderDecoderCache``): ``crop`` applies to the self-attention part only,
    batch operations and ``reset`` to both (both checked before either changes)."""

    def __init__(self, *caches: Any) -> None:
        if len(caches) != 2:
            raise _rw.InvalidArgument(f"Expected 2 arguments (self-attention and cross-attention caches), got {len(caches)}")
        if not isinstance(caches[0], Cache) or not isinstance(caches[1], Cache):
            raise _rw.InvalidArgument(
                f"One of the two arguments is not a Cache: {type(caches[0]) = }, {type(caches[1]) = }"
            )
        self.self_attention_cache, self.cross_attention_cache = caches
        # Both parts on one device: the batch operations run over both in one C++ call.
        mine, theirs = caches[0]._dev_slot, caches[1]._dev_slot
        if mine.dev is not None and theirs.dev is not None and mine.dev.name != theirs.dev.name:
            raise _rw.InvalidArgument(
                f"EncoderDecoderCache: the self-attention cache is on {mine.dev.name}, the cross-attention cache on "
                f"{theirs.dev.name}; both must be on one device"
            )
        if mine.dev is None:
            mine.dev = theirs.dev
        for layer in self.cross_attention_cache.layers:
            layer._share_device(mine)
        self.cross_attention_cache._dev_slot = mine
        # One budget for both parts: the batch operations allocate for both in one C++ call.
        for layer in self.cross_attention_cache.layers:
            layer._rehome(self.self_attention_cache._budget)
        self.cross_attention_cache._budget = self.self_attention_cache._budget
        self.is_updated = {
            i: bool(self.cross_attention_cache.get_seq_length(i) > 0) for i in range(len(self.cross_attention_cache))
        }

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(self_attention_cache={self.self_attention_cache}, "
                f"cross_attention_cache={self.cross_attention_cache})")

    def __len__(self) -> int:
        return len(self.self_attention_cache)

    def __iter__(self):
        for a, b in zip(self.self_attention_cache, self.cross_attention_cache):
            yield a + b

    @property
    def layers(self) -> list:
        """The self-attention part's layers."""
        return self.self_attention_cache.layers

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple:
        """Self-attention update of layer layer_idx; returns (keys, values)."""
        return self.self_attention_cache.update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Length of the self-attention part."""
        return self.self_attention_cache.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """get_max_length of the self-attention part."""
        return self.self_attention_cache.get_max_length(layer_idx)

    def get_mask_sizes(self, query_length: Any, layer_idx: int) -> tuple:
        """get_mask_sizes of the self-attention part."""
        return self.self_attention_cache.get_mask_sizes(query_length, layer_idx)

    def crop(self, maximum_length: int) -> None:
        """Crops the self-attention part only; the encoder's keys stay."""
        self.self_attention_cache.crop(maximum_length)

    def check_crop(self, maximum_length: int) -> None:
        """Raises what crop would raise; changes nothing."""
        self.self_attention_cache.check_crop(maximum_length)

    def max_rollback(self) -> int:
        """max_rollback of the self-attention part."""
        return self.self_attention_cache.max_rollback()

    def activate_past_recording(self, max_tokens: int | None = None) -> None:
        """Records past states in the self-attention part (the cross part is never cropped)."""
        self.self_attention_cache.activate_past_recording(max_tokens)

    def reorder_cache(self, beam_idx: Any) -> None:
        """Reorders the batch rows of both parts (rwd::EncoderDecoderCache: both or neither)."""
        _rw._encoder_decoder_reorder_cache(self.self_attention_cache._txn(), self.cross_attention_cache._txn(),
                                           _index_list(beam_idx))

    def batch_select_indices(self, indices: Any) -> None:
        """Keeps batch rows of both parts (both or neither)."""
        _rw._encoder_decoder_batch_select_indices(self.self_attention_cache._txn(),
                                                  self.cross_attention_cache._txn(), _index_list(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats batch rows in both parts (both or neither)."""
        _rw._encoder_decoder_batch_repeat_interleave(self.self_attention_cache._txn(),
                                                     self.cross_attention_cache._txn(), int(repeats))

    def reset(self) -> None:
        """Empties both parts (both or neither); is_updated becomes False everywhere."""
        _rw._encoder_decoder_reset(self.self_attention_cache._txn(), self.cross_attention_cache._txn())
        for c in (self.self_attention_cache, self.cross_attention_cache):
            for layer in c.layers:
                layer._after_reset()
        for i in self.is_updated:
            self.is_updated[i] = False

    def set_memory_budget(self, bytes: int) -> None:
        """Caps both parts together (they share one budget)."""
        self.self_attention_cache.set_memory_budget(bytes)

    def memory(self) -> dict:
        """Bytes reserved and used by each part and in total."""
        a, b = self.self_attention_cache.memory(), self.cross_attention_cache.memory()
        return {"self_attention": a, "cross_attention": b,
                "bytes_reserved": a["bytes_reserved"] + b["bytes_reserved"],
                "bytes_used": a["bytes_used"] + b["bytes_used"]}

    @property
    def is_sliding(self) -> list:
        """is_sliding of the self-attention part."""
        return self.self_attention_cache.is_sliding

    @property
    def batch_size(self) -> int:
        """Batch size of the self-attention part."""
        return self.self_attention_cache.batch_size
