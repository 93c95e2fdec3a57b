// Which parts each layer kind has (Layer's constructor, the snapshot format
// and restore all follow these two answers).
#pragma once

#include "rewind/layer.h"

namespace rwd::detail {

// Full, sliding, chunked, sparse and both hybrids: keys and values.
bool kind_has_attention(LayerKind k);
// Linear attention, conv and both hybrids: conv and / or recurrent states.
bool kind_is_linear(LayerKind k);

}  // namespace rwd::detail
