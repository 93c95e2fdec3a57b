"""rewind: inference state of transformer and hybrid language models with exact rollback.

``import rewind`` gives transformers-shaped cache classes (``DynamicCache``, ``DynamicLayer``,
``DynamicSlidingWindowLayer``, ``LinearAttentionLayer``, ...) whose ``crop`` is exact for every layer kind,
recurrent states included, and the reference runtime (``Model``: load, forward, generate). See docs/python.md.
"""

import warnings as _warnings

from . import _rewind
from ._rewind import (  # noqa: F401  (the exception hierarchy)
    CapacityError,
    Error,
    FormatError,
    IndexError,
    InvalidArgument,
    RollbackError,
    StateError,
    StoreError,
    cuda_built,
    cuda_device_count,
    pin_stats,
    reset_one_time_warnings,
    set_warning_handler,
)
from .cache_utils import (  # noqa: F401
    DEFAULT_MAX_ROLLBACK,
    LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicChunkedLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StatelessLayer,
    layer_types_and_kwargs,
)
from . import generation  # noqa: F401
from .generation import generate  # noqa: F401
from .runtime import Model, ModelCache, get_num_threads, set_num_threads  # noqa: F401

__version__ = "0.1.0"

# `from rewind import *` leaves out rewind.IndexError: it would shadow the
# builtin IndexError (which it derives from) in the importing module.
__all__ = [
    "Error", "InvalidArgument", "CapacityError", "RollbackError", "StateError", "FormatError", "StoreError",
    "Cache", "DynamicCache", "EncoderDecoderCache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin",
    "DynamicLayer", "DynamicSlidingWindowLayer", "DynamicChunkedLayer", "DynamicIndexedLayer",
    "LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer",
    "StatelessLayer", "LAYER_TYPE_MAPPING", "DEFAULT_MAX_ROLLBACK", "layer_types_and_kwargs",
    "Model", "ModelCache", "set_num_threads", "get_num_threads", "pin_stats", "cuda_built", "cuda_device_count", "set_warning_handler",
    "reset_one_time_warnings", "generate", "__version__",
]


def _warn(message: str) -> None:
    _warnings.warn(message, FutureWarning, stacklevel=4)


# rewind's one-time warnings (a deprecated positive crop) become Python
# FutureWarnings, as transformers' deprecation warnings are.
set_warning_handler(_warn)
