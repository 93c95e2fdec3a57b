// Snapshots of one layer (rewind/snapshot.h): what a layer at length L
// needs to continue exactly, copied out, checked and loaded back.
#include <algorithm>
#include <string>
#include <utility>

#include "aligned_memory.h"
#include "cache/layer_impl.h"
#include "tensor_copy.h"

namespace rwd {
namespace {

using detail::copy_of;
using detail::present;
using detail::RetentionRule;
using detail::TokenTrack;

std::string num(std::int64_t v) { return std::to_string(v); }

bool has_shape(const TensorView& v, const std::vector<std::int64_t>& shape, DType dtype) {
  if (v.rank != static_cast<int>(shape.size()) || v.dtype != dtype) return false;
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (v.size(static_cast<int>(d)) != shape[d]) return false;
  return true;
}

void require_shape(const Tensor& t, const std::vector<std::int64_t>& shape, DType dtype, const std::string& where,
                   const std::string& part) {
  if (has_shape(t.view(), shape, dtype)) return;
  std::string want = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) want += (d ? ", " : "") + num(shape[d]);
  want += "] " + std::string(dtype_name(dtype));
  throw InvalidArgument(where + ": the snapshot's " + part + " is " +
                        (present(t) ? t.view().describe() : std::string("absent")) + ", this layer needs " + want);
}

// Rows [first, L) of the track into a new tensor shaped as the track's view.
Tensor copy_rows(const TokenTrack& t, std::int64_t first, std::int64_t L) { return copy_of(t.view(first, L - first)); }

// Loads positions [first, L) of a token track from `rows` (positions
// [rows_first, L) along `token_dim`).
void load_rows(TokenTrack& t, std::int64_t first, std::int64_t L, const TensorView& rows, std::int64_t rows_first) {
  const TensorView dst = t.load(first, L - first);
  copy_tensor(rows.slice(t.shape.token_dim(), first - rows_first, L - first), dst);
  t.protect();
}

}  // namespace

namespace detail {

void check_layer_snapshot(const LayerSnapshot& s, std::int64_t L, LayerKind kind, const LayerOptions& o,
                          const RetentionRule& rule, const std::string& where) {
  if (s.kind != kind) {
    throw InvalidArgument(where + ": the snapshot holds a " + std::string(layer_kind_name(s.kind)) +
                          " layer here, this cache a " + std::string(layer_kind_name(kind)) + " layer");
  }
  if (kind_has_attention(kind)) {
    const std::int64_t need = rule.keep_first(L, 0);
    if (s.first < 0 || s.first > need) {
      throw InvalidArgument(where + ": the snapshot holds positions [" + num(s.first) + ", " + num(L) +
                            ") of its attention, but restoring length " + num(L) + " needs [" + num(need) + ", " +
                            num(L) + ")");
    }
    const std::int64_t n = L - s.first;
    const std::int64_t vdim = o.value_dim == 0 ? o.key_dim : o.value_dim;
    require_shape(s.keys, {1, o.num_kv_heads, n, o.key_dim}, o.dtype, where, "keys");
    require_shape(s.values, {1, o.num_kv_heads, n, vdim}, o.dtype, where, "values");
    if (s.sides.size() != o.side_dims.size()) {
      throw InvalidArgument(where + ": the snapshot holds " + num(static_cast<std::int64_t>(s.sides.size())) +
                            " side tensors, this layer has " + num(static_cast<std::int64_t>(o.side_dims.size())));
    }
    for (std::size_t i = 0; i < s.sides.size(); ++i)
      require_shape(s.sides[i], {1, n, o.side_dims[i]}, o.dtype, where,
                    "side tensor " + num(static_cast<std::int64_t>(i)));
  } else if (present(s.keys) || present(s.values) || !s.sides.empty()) {
    throw InvalidArgument(where + ": the snapshot holds attention rows, but this layer has no attention");
  }
  const bool linear = kind_is_linear(kind);
  const std::size_t convs = linear ? o.conv_channels.size() : 0;
  const std::size_t recurrents = linear && kind != LayerKind::Conv ? o.recurrent_shapes.size() : 0;
  if (s.conv_states.size() != convs || s.recurrent_states.size() != recurrents) {
    throw InvalidArgument(where + ": the snapshot holds " + num(static_cast<std::int64_t>(s.conv_states.size())) +
                          " conv and " + num(static_cast<std::int64_t>(s.recurrent_states.size())) +
                          " recurrent states, this layer has " + num(static_cast<std::int64_t>(convs)) + " and " +
                          num(static_cast<std::int64_t>(recurrents)));
  }
  for (std::size_t i = 0; i < convs; ++i)
    require_shape(s.conv_states[i], {1, o.conv_channels[i], o.conv_kernel_size}, o.dtype, where,
                  "conv state " + num(static_cast<std::int64_t>(i)));
  for (std::size_t i = 0; i < recurrents; ++i) {
    std::vector<std::int64_t> shape{1};
    shape.insert(shape.end(), o.recurrent_shapes[i].begin(), o.recurrent_shapes[i].end());
    require_shape(s.recurrent_states[i], shape, o.recurrent_dtype, where,
                  "recurrent state " + num(static_cast<std::int64_t>(i)));
  }
}

void check_snapshot_frame(const Snapshot& s, std::size_t num_layers, const std::string& operation) {
  if (s.layers.size() != num_layers) {
    throw InvalidArgument(operation + ": the snapshot has " + std::to_string(s.layers.size()) + " layers, this cache " +
                          std::to_string(num_layers));
  }
  if (s.length < 0 || s.length > kMaxTokens) {
    throw InvalidArgument(operation + ": the snapshot's length " + num(s.length) + " is outside [0, 2^40]");
  }
}

}  // namespace detail

void Layer::Impl::capture(LayerSnapshot& out, bool with_attention, std::int64_t from_position) const {
  const std::int64_t L = length();
  budgeted("snapshot", [&] {
    if (attention && with_attention) {
      const std::int64_t first = std::max(from_position, keys.rule.keep_first(L, 0));
      out.first = first;
      out.keys = copy_rows(keys, first, L);
      out.values = copy_rows(values, first, L);
      out.sides.clear();
      for (const auto& s : sides) out.sides.push_back(copy_rows(s, first, L));
    }
    out.conv_states.clear();
    // The last K inputs; the zero padding rows stand for positions before 0.
    for (const auto& c : convs) out.conv_states.push_back(copy_rows(c, L - c.rule.size, L));
    out.recurrent_states.clear();
    for (const auto& r : recurrents) {
      const TensorView v = r.view(L);
      out.recurrent_states.push_back(copy_of(v));
    }
  });
}

std::unique_ptr<Layer::Impl> Layer::Impl::restored(const LayerSnapshot& s, std::int64_t L, bool with_attention) const {
  return budgeted("restore", [&] {
    std::unique_ptr<Impl> out = fresh();
    out->load_snapshot(s, L, with_attention);
    return out;
  });
}

void Layer::Impl::load_snapshot(const LayerSnapshot& s, std::int64_t L, bool with_attention) {
  if (attention && with_attention) {
    const std::int64_t first = keys.rule.keep_first(L, 0);
    load_rows(keys, first, L, s.keys.view(), s.first);
    load_rows(values, first, L, s.values.view(), s.first);
    for (std::size_t i = 0; i < sides.size(); ++i) load_rows(sides[i], first, L, s.sides[i].view(), s.first);
  }
  for (std::size_t i = 0; i < convs.size(); ++i) {
    TokenTrack& c = convs[i];
    const std::int64_t K = c.rule.size;
    const std::int64_t first = c.rule.keep_first(L, 0);  // L - K, or -K while the padding is kept
    const TensorView dst = c.load(first, L - first);
    // Positions before L - K exist only as the zero padding (L < K).
    const std::int64_t zeros = (L - K) - first;
    if (zeros > 0) copy_tensor(Tensor(dst.dtype, {1, dst.size(1), zeros}), dst.slice(2, 0, zeros));
    copy_tensor(s.conv_states[i].view(), dst.slice(2, zeros, K));
    c.protect();
  }
  for (std::size_t i = 0; i < recurrents.size(); ++i) recurrents[i].load(L, s.recurrent_states[i].view());
  ++generation;
}

}  // namespace rwd
