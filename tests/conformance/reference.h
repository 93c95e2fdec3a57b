// tests/cache/reference.h: the naive reference the conformance suite compares
// rewind's cache with.
//
// The reference is written from docs/semantics.md alone (sections 3-10), not
// from src/cache. It keeps every token ever appended to every part (keys,
// values, side rows, conv inputs) and the full list S(0..L) of recurrent
// states, plus the few integers the contract defines (L, the retained first
// position of each part, R). Everything a layer must return follows from
// those: the keys an update returns, the conv window, S(L), the mask sizes,
// max_rollback and which crops must be refused with which message.
//
// Element values are 32-bit (f32) or 16-bit (f16 / bf16) patterns derived
// from a hash of (salt, part, position, batch row, element), so any stale,
// misplaced or mixed-up element is caught by a bitwise comparison (the cache
// never converts).
#pragma once

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rewind/cache.h"
#include "rewind/dtype.h"
#include "rewind/error.h"
#include "rewind/layer.h"
#include "rewind/tensor.h"

namespace rwt {

using i64 = std::int64_t;
using rwd::DType;
using rwd::LayerKind;
using rwd::LayerOptions;
using rwd::MaskSizes;
using rwd::TensorView;
using Bytes = std::vector<unsigned char>;

// ---- the verbatim sentences of docs/semantics.md section 8 -----------------
inline const std::string kNotTracking =
    "`crop` was called, but the current layer does not track past states. Call "
    "`activate_past_recording` before `crop` to be able to rollback the cache.";
inline const std::string kSlidingNotTracking =
    "`crop` was called, but the current layer does not track past states, and the sliding "
    "window size was already reached. Call `activate_past_recording` before `crop` to be able "
    "to rollback the cache.";
inline const std::string kLinearNegative =
    "Linear attention layers can only be cropped by passing a negative int, to specify how "
    "many tokens to remove";
inline const std::string kOnceSliding =
    "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be "
    "cropped by passing a negative int, to specify how many tokens to remove";
inline const std::string kConvOnNonLinear = "Cannot call `update_conv_state` on a non-LinearAttention layer!";
inline const std::string kHasPreviousOnAttention =
    "`has_previous_state` can only be called on LinearAttention layers, and the current Cache "
    "seem to only contain Attention layers.";

inline i64 floor_div(i64 a, i64 b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// ---- host tensors and byte-level access -------------------------------------

inline TensorView make_view(void* data, DType dt, const std::vector<i64>& shape) {
  TensorView v;
  v.data = data;
  v.dtype = dt;
  v.rank = static_cast<int>(shape.size());
  for (std::size_t d = 0; d < 4; ++d) {
    v.shape[d] = 1;
    v.strides[d] = 0;
  }
  i64 s = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[static_cast<std::size_t>(d)] = shape[static_cast<std::size_t>(d)];
    v.strides[static_cast<std::size_t>(d)] = s;
    s *= shape[static_cast<std::size_t>(d)];
  }
  return v;
}

inline i64 product(const std::vector<i64>& shape) {
  i64 n = 1;
  for (i64 e : shape) n *= e;
  return n;
}

// A contiguous host tensor the tests own (inputs to the cache, expectations).
struct HostTensor {
  DType dtype = DType::F32;
  std::vector<i64> shape;
  Bytes bytes;
  // Optional explicit strides (a non-contiguous view of `bytes`).
  std::vector<i64> strides;

  HostTensor() = default;
  HostTensor(DType dt, std::vector<i64> s) : dtype(dt), shape(std::move(s)) {
    bytes.assign(static_cast<std::size_t>(product(shape)) * rwd::dtype_size(dt), 0);
  }
  TensorView view() const {
    TensorView v = make_view(const_cast<unsigned char*>(bytes.data()), dtype, shape);
    if (!strides.empty())
      for (std::size_t d = 0; d < strides.size(); ++d) v.strides[d] = strides[d];
    return v;
  }
};

inline std::vector<i64> shape_of(const TensorView& v) {
  std::vector<i64> s;
  for (int d = 0; d < v.rank; ++d) s.push_back(v.shape[static_cast<std::size_t>(d)]);
  return s;
}

inline std::string shape_str(const std::vector<i64>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// A contiguous host copy of `v`. Views a cache returns may be on a device
// (the guarded test storage of a REWIND_GUARDED_STORAGE build faults on any
// direct read), so the tests read them only through this copy.
inline rwd::Tensor to_host(const TensorView& v) {
  rwd::Tensor t(v.dtype, v.shape.data(), v.rank);
  rwd::copy_tensor(v, t.view());
  return t;
}

// Row-major bytes of every element of `v`.
inline Bytes gather(const TensorView& v) {
  if (!v.device.is_host()) return gather(to_host(v).view());
  const std::size_t es = rwd::dtype_size(v.dtype);
  auto ext = [&](std::size_t d) { return static_cast<int>(d) < v.rank ? v.shape[d] : 1; };
  Bytes out;
  if (v.rank > 0 && v.numel() == 0) return out;
  out.resize(static_cast<std::size_t>(ext(0) * ext(1) * ext(2) * ext(3)) * es);
  // Innermost runs are copied in one go when they are contiguous.
  const bool inner_contiguous = ext(3) == 1 || v.strides[3] == 1;
  const std::size_t run = inner_contiguous ? static_cast<std::size_t>(ext(3)) * es : es;
  unsigned char* dst = out.data();
  for (i64 a = 0; a < ext(0); ++a)
    for (i64 b = 0; b < ext(1); ++b)
      for (i64 c = 0; c < ext(2); ++c) {
        if (inner_contiguous) {
          std::memcpy(dst, v.ptr(a, b, c, 0), run);
          dst += run;
          continue;
        }
        for (i64 d = 0; d < ext(3); ++d) {
          std::memcpy(dst, v.ptr(a, b, c, d), es);
          dst += es;
        }
      }
  return out;
}

// Writes row-major `bytes` into every element of `v`.
inline void scatter(const Bytes& bytes, const TensorView& v) {
  if (!v.device.is_host()) {  // written through the view's storage
    const rwd::Tensor h(v.dtype, v.shape.data(), v.rank);
    scatter(bytes, h.view());
    rwd::copy_tensor(h.view(), v);
    return;
  }
  const std::size_t es = rwd::dtype_size(v.dtype);
  auto ext = [&](std::size_t d) { return static_cast<int>(d) < v.rank ? v.shape[d] : 1; };
  std::size_t off = 0;
  if (v.rank > 0 && v.numel() == 0) return;
  for (i64 a = 0; a < ext(0); ++a)
    for (i64 b = 0; b < ext(1); ++b)
      for (i64 c = 0; c < ext(2); ++c)
        for (i64 d = 0; d < ext(3); ++d) {
          std::memcpy(v.ptr(a, b, c, d), bytes.data() + off, es);
          off += es;
        }
}

// ---- element values ----------------------------------------------------------

inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline std::uint64_t key_of(std::uint64_t salt, std::uint64_t part, i64 pos, i64 b, i64 e) {
  std::uint64_t k = mix64(salt);
  k = mix64(k ^ (part * 0x100000001b3ULL));
  k = mix64(k ^ static_cast<std::uint64_t>(pos + 1000000));
  k = mix64(k ^ (static_cast<std::uint64_t>(b) << 32) ^ static_cast<std::uint64_t>(e));
  return k;
}

// Writes a finite, non-zero-ish value pattern (never Inf / NaN) for `key`.
inline void write_pattern(unsigned char* dst, DType dt, std::uint64_t key) {
  const std::uint64_t h = mix64(key);
  if (dt == DType::F32) {
    std::uint32_t u = static_cast<std::uint32_t>(h) & ~(1u << 30);  // exponent < 255
    u |= 1u << 23;                                                  // never zero
    std::memcpy(dst, &u, 4);
  } else {
    std::uint16_t u = static_cast<std::uint16_t>(h & 0xFFFFu);
    u = static_cast<std::uint16_t>(u & ~(1u << 14));  // exponent never all ones
    u = static_cast<std::uint16_t>(u | (dt == DType::F16 ? (1u << 10) : (1u << 7)));
    std::memcpy(dst, &u, 2);
  }
}

// One token of one part: B rows of `elems` elements.
inline Bytes make_row(std::uint64_t salt, std::uint64_t part, i64 pos, i64 B, i64 elems, DType dt) {
  const std::size_t es = rwd::dtype_size(dt);
  Bytes r(static_cast<std::size_t>(B * elems) * es);
  for (i64 b = 0; b < B; ++b)
    for (i64 e = 0; e < elems; ++e)
      write_pattern(r.data() + static_cast<std::size_t>(b * elems + e) * es, dt, key_of(salt, part, pos, b, e));
  return r;
}

// ---- expected errors ---------------------------------------------------------

enum class Err { None, Rollback, State, Invalid, Index, Capacity };

inline const char* err_name(Err e) {
  switch (e) {
    case Err::None: return "none";
    case Err::Rollback: return "RollbackError";
    case Err::State: return "StateError";
    case Err::Invalid: return "InvalidArgument";
    case Err::Index: return "IndexError";
    case Err::Capacity: return "CapacityError";
  }
  return "?";
}

inline Err classify(const rwd::Error& e) {
  if (dynamic_cast<const rwd::RollbackError*>(&e)) return Err::Rollback;
  if (dynamic_cast<const rwd::StateError*>(&e)) return Err::State;
  if (dynamic_cast<const rwd::InvalidArgument*>(&e)) return Err::Invalid;
  if (dynamic_cast<const rwd::IndexError*>(&e)) return Err::Index;
  if (dynamic_cast<const rwd::CapacityError*>(&e)) return Err::Capacity;
  return Err::None;
}

// Runs f; "" when it threw one of `kinds` (Err::None in the list: or
// nothing), else what went wrong (another error, std::bad_alloc or another
// non-rewind exception escaping, nothing thrown). For the fuzz targets.
template <class F>
std::string expect_kinds(F&& f, const std::vector<Err>& kinds) {
  std::string names;
  for (Err k : kinds) names += (names.empty() ? "" : " or ") + std::string(err_name(k));
  try {
    f();
  } catch (const rwd::Error& e) {
    const Err got = classify(e);
    for (Err k : kinds)
      if (k == got) return "";
    return std::string("unexpected ") + err_name(got) + " (expected " + names + "): " + e.what();
  } catch (const std::bad_alloc& e) {
    return std::string("std::bad_alloc escaped (expected ") + names + "): " + e.what();
  } catch (const std::exception& e) {
    return std::string("non-rewind exception (expected ") + names + "): " + e.what();
  }
  for (Err k : kinds)
    if (k == Err::None) return "";
  return "nothing was thrown (expected " + names + ")";
}

// Splits row-major bytes of `shape` into one row per index of `token_dim`
// (the other dimensions in row-major order: the reference's row layout).
inline std::vector<Bytes> token_rows(const Bytes& logical, const std::vector<i64>& shape, int token_dim,
                                     std::size_t es) {
  const auto td = static_cast<std::size_t>(token_dim);
  i64 outer = 1, inner = 1;
  for (std::size_t d = 0; d < td; ++d) outer *= shape[d];
  for (std::size_t d = td + 1; d < shape.size(); ++d) inner *= shape[d];
  const i64 q = shape[td];
  const std::size_t run = static_cast<std::size_t>(inner) * es;
  std::vector<Bytes> rows(static_cast<std::size_t>(q));
  for (i64 t = 0; t < q; ++t) {
    Bytes& r = rows[static_cast<std::size_t>(t)];
    r.reserve(static_cast<std::size_t>(outer) * run);
    for (i64 o = 0; o < outer; ++o) {
      const std::size_t off = static_cast<std::size_t>(o * q + t) * run;
      r.insert(r.end(), logical.begin() + static_cast<std::ptrdiff_t>(off),
               logical.begin() + static_cast<std::ptrdiff_t>(off + run));
    }
  }
  return rows;
}

// A view with explicit fields (extents TensorView::strided would refuse).
inline TensorView raw_view(void* data, DType dt, const std::vector<i64>& shape, const std::vector<i64>& strides) {
  TensorView v;
  v.data = data;
  v.dtype = dt;
  v.rank = static_cast<int>(shape.size());
  for (std::size_t d = 0; d < 4; ++d) {
    v.shape[d] = d < shape.size() ? shape[d] : 1;
    v.strides[d] = d < strides.size() ? strides[d] : 0;
  }
  return v;
}

// True when `msg` contains `n` as a whole number (not part of a longer one).
inline bool has_number(const std::string& msg, i64 n) {
  const std::string s = std::to_string(n);
  std::size_t pos = 0;
  while ((pos = msg.find(s, pos)) != std::string::npos) {
    const bool left = pos == 0 || !std::isdigit(static_cast<unsigned char>(msg[pos - 1]));
    const std::size_t e = pos + s.size();
    const bool right = e >= msg.size() || !std::isdigit(static_cast<unsigned char>(msg[e]));
    if (left && right) return true;
    ++pos;
  }
  return false;
}

// True when the message names layer `index` ("layer 3").
inline bool names_layer(const std::string& msg, int index) {
  const std::string word = "layer ";
  for (std::size_t pos = msg.find(word); pos != std::string::npos; pos = msg.find(word, pos + 1)) {
    std::size_t e = pos + word.size();
    const bool neg = e < msg.size() && msg[e] == '-';
    if (neg) ++e;
    std::size_t end = e;
    while (end < msg.size() && std::isdigit(static_cast<unsigned char>(msg[end]))) ++end;
    if (end == e) continue;
    const long long n = std::stoll(msg.substr(e, end - e));
    if ((neg ? -n : n) == index) return true;
  }
  return false;
}

// One acceptable message: an opening sentence ("" = any) and numbers it must name.
struct Alt {
  std::string prefix;
  std::vector<i64> numbers;
};

struct Expect {
  Err kind = Err::None;
  int layer = -1;         // the message must name this layer (when >= 0)
  std::vector<Alt> alts;  // any one of them; empty = any message
  bool ok() const { return kind == Err::None; }
};

// Empty when the exception matches `x`, else a description of the mismatch.
inline std::string match_error(const rwd::Error& e, const Expect& x) {
  const std::string msg = e.what();
  const Err got = classify(e);
  if (got != x.kind) return std::string("expected ") + err_name(x.kind) + ", got " + err_name(got) + ": " + msg;
  if (x.layer >= 0 && !names_layer(msg, x.layer))
    return "message does not name layer " + std::to_string(x.layer) + ": " + msg;
  if (x.alts.empty()) return "";
  for (const Alt& a : x.alts) {
    if (msg.rfind(a.prefix, 0) != 0) continue;
    bool all = true;
    for (i64 n : a.numbers) all = all && has_number(msg, n);
    if (all) return "";
  }
  std::string want;
  for (const Alt& a : x.alts) {
    want += "\n  \"" + a.prefix + "\" naming";
    for (i64 n : a.numbers) want += " " + std::to_string(n);
  }
  return "message \"" + msg + "\" matches none of:" + want;
}

// ---- the reference layer -----------------------------------------------------

enum class Attn { None, Full, Sliding, Chunked };

// Part ids (for value generation).
enum : std::uint64_t { kPartKeys = 1, kPartValues = 2, kPartSide = 10, kPartConv = 20, kPartRec = 30 };

struct StepData {
  i64 q = 0;
  std::vector<Bytes> keys, values;        // [t] -> B*H*D
  std::vector<std::vector<Bytes>> sides;  // [s][t] -> B*D_s
  std::vector<std::vector<Bytes>> conv;   // [s][t] -> B*channels_s
  std::vector<std::vector<Bytes>> rec;    // [s][t] -> S(L+1+t): B*numel_s
};

class RefLayer {
 public:
  RefLayer(LayerKind kind, const LayerOptions& o, int index) : kind_(kind), opt_(o), index_(index) {
    switch (kind) {
      case LayerKind::FullAttention: attn_ = Attn::Full; break;
      case LayerKind::SlidingAttention: attn_ = Attn::Sliding; break;
      case LayerKind::ChunkedAttention: attn_ = Attn::Chunked; break;
      case LayerKind::LinearAttention: linear_ = true; break;
      case LayerKind::Conv: linear_ = true; break;
      case LayerKind::Hybrid:
        attn_ = Attn::Full;
        linear_ = true;
        break;
      case LayerKind::HybridSliding:
        attn_ = Attn::Sliding;
        linear_ = true;
        break;
      case LayerKind::SparseAttention: attn_ = Attn::Full; break;
      case LayerKind::Moe:
      case LayerKind::Mlp: stateless_ = true; break;
    }
    H = o.num_kv_heads;
    Dk = o.key_dim;
    Dv = o.value_dim == 0 ? o.key_dim : o.value_dim;
    W = o.sliding_window;
    C = o.chunk_size;
    K = o.conv_kernel_size;
    M = o.static_capacity;
    // Reading: side tensors belong to the sparse-attention kind (the only
    // kind the header says needs them).
    if (kind == LayerKind::SparseAttention) side_dims = o.side_dims;
    if (linear_) {
      conv_ch = o.conv_channels;
      if (kind != LayerKind::Conv) rec_shapes = o.recurrent_shapes;
    }
    for (auto& s : rec_shapes) rec_numel.push_back(product(s));
    reset();
  }

  // ---- configuration
  LayerKind kind() const { return kind_; }
  const LayerOptions& options() const { return opt_; }
  int index() const { return index_; }
  void set_index(int i) { index_ = i; }
  Attn attn() const { return attn_; }
  bool has_attention() const { return attn_ != Attn::None; }
  bool linear() const { return linear_; }
  bool stateless() const { return stateless_; }
  DType dtype() const { return opt_.dtype; }
  DType rdtype() const { return opt_.recurrent_dtype; }
  std::size_t esize() const { return rwd::dtype_size(opt_.dtype); }
  std::size_t resize() const { return rwd::dtype_size(opt_.recurrent_dtype); }

  i64 H = 0, Dk = 0, Dv = 0, W = 0, C = 0, K = 0, M = 0;
  std::vector<i64> side_dims, conv_ch, rec_numel;
  std::vector<std::vector<i64>> rec_shapes;

  // ---- state
  i64 L = 0;
  i64 B = 1;
  bool recording = false;
  i64 R = 0;
  i64 first = 0;                          // first retained attention / side position
  i64 conv_first = 0;                     // first retained conv input (<= 0: nothing real evicted)
  i64 rec_first = 0;                      // oldest held recurrent snapshot S(rec_first)
  std::vector<Bytes> keys, values;        // [p]
  std::vector<std::vector<Bytes>> sides;  // [s][p]
  std::vector<std::vector<Bytes>> conv;   // [s][p]
  std::vector<std::vector<Bytes>> rec;    // [s][j] = S(j), j = 0..L

  void clear_tokens() {
    L = 0;
    first = 0;
    conv_first = -K;
    rec_first = 0;
    keys.clear();
    values.clear();
    sides.assign(side_dims.size(), {});
    conv.assign(conv_ch.size(), {});
    rec.assign(rec_shapes.size(), {});
    for (std::size_t s = 0; s < rec.size(); ++s)
      rec[s].push_back(Bytes(static_cast<std::size_t>(B * rec_numel[s]) * resize(), 0));
  }
  // reset(): back to new, recording setting kept.
  void reset() {
    B = opt_.batch_size;
    clear_tokens();
  }

  // ---- rules (docs/semantics.md sections 4, 5, 10)

  MaskSizes mask_sizes(i64 q) const {
    switch (attn_) {
      case Attn::Full: return {L + q, 0};
      case Attn::Sliding: return {std::min(L, W - 1) + q, std::max<i64>(0, L - W + 1)};
      case Attn::Chunked: {
        const i64 c0 = floor_div(L, C) * C;
        return {L - c0 + q, c0};
      }
      case Attn::None: break;
    }
    return {0, 0};
  }

  // Drops what a rollback of up to r tokens no longer needs (10.1); r = 0 is
  // the minimal working state (crop(0), no recording).
  void retain(i64 r) {
    if (attn_ == Attn::Sliding) first = std::max(first, L - (W - 1 + r));
    if (attn_ == Attn::Chunked) first = std::max(first, floor_div(std::max<i64>(0, L - r), C) * C);
    first = std::max<i64>(first, 0);
    if (linear_) {
      conv_first = std::max(conv_first, L - K - r);
      rec_first = std::max(rec_first, L - r);
    }
  }
  i64 effective_r() const { return recording ? R : 0; }

  i64 max_rollback() const {
    if (stateless_) return 0;
    i64 m = L;
    if (attn_ == Attn::Sliding && first > 0) m = std::min(m, L - first - (W - 1));
    if (attn_ == Attn::Chunked && first > 0) m = std::min(m, L - first);
    if (linear_) {
      if (!recording) return 0;
      if (!conv_ch.empty() && conv_first > 0) m = std::min(m, L - conv_first - K);
      if (!rec_shapes.empty() && rec_first > 1) m = std::min(m, L - rec_first);
    }
    return m;
  }

  // What crop(n) must do: Err::None, or the error it must raise (10.4, 10.6, 10.7).
  Expect crop_expect(i64 n) const {
    Expect x;
    x.layer = index_;
    if (stateless_) return x;
    const bool sliding_full = attn_ == Attn::Sliding && L >= W;
    if (n > 0) {
      if (linear_) {
        x.alts.push_back({kLinearNegative, {}});
        // Ambiguous: which check comes first when not recording.
        if (!recording) x.alts.push_back({kNotTracking, {}});
      }
      if (sliding_full) {
        x.alts.push_back({kOnceSliding, {}});
        if (!recording) x.alts.push_back({kSlidingNotTracking, {L, W}});
      }
      if (!x.alts.empty()) {
        x.kind = Err::Rollback;
      } else if (attn_ == Attn::Chunked && first > 0) {
        x.kind = Err::Rollback;  // message not specified: names the layer
      }
      return x;
    }
    if (!recording) {
      if (linear_) x.alts.push_back({kNotTracking, {}});
      if (sliding_full) x.alts.push_back({kSlidingNotTracking, {L, W}});
      if (!x.alts.empty()) {
        x.kind = Err::Rollback;
        return x;
      }
    }
    const i64 k = -n;
    if (n == 0 || k >= L || k <= max_rollback()) return x;
    x.kind = Err::Rollback;
    x.alts.push_back({"", {k, max_rollback()}});
    return x;
  }

  // Applies crop(n); REQUIRES crop_expect(n).ok().
  void crop(i64 n) {
    if (stateless_) return;
    if (n > 0) {
      if (n < L) truncate(n);
      return;
    }
    if (n == 0) {
      retain(0);
      return;
    }
    const i64 k = -n;
    if (k >= L) {
      clear_tokens();
      return;
    }
    truncate(L - k);
  }

  void truncate(i64 len) {
    L = len;
    auto cut = [&](std::vector<Bytes>& v) { v.resize(static_cast<std::size_t>(len)); };
    if (has_attention()) {
      cut(keys);
      cut(values);
    }
    for (auto& s : sides) cut(s);
    for (auto& c : conv) cut(c);
    for (auto& r : rec) r.resize(static_cast<std::size_t>(len + 1));
  }

  void activate(i64 r) {
    if (stateless_) return;
    recording = true;
    R = r;
    retain(r);
  }
  void deactivate() {
    if (stateless_) return;
    recording = false;
    R = 0;
    retain(0);
  }

  // Static full attention: L + q > M is a CapacityError (10.11). Static
  // sliding / chunked layers are given enough slots in these tests.
  Expect update_expect(i64 q) const {
    Expect x;
    x.layer = index_;
    if (attn_ == Attn::Full && M > 0 && L + q > M) {
      x.kind = Err::Capacity;
      x.alts.push_back({"", {M}});
    }
    return x;
  }

  StepData make_step(i64 q, std::uint64_t salt) const {
    StepData st;
    st.q = q;
    for (i64 t = 0; t < q; ++t) {
      const i64 p = L + t;
      if (has_attention()) {
        st.keys.push_back(make_row(salt, kPartKeys, p, B, H * Dk, dtype()));
        st.values.push_back(make_row(salt, kPartValues, p, B, H * Dv, dtype()));
      }
    }
    st.sides.resize(side_dims.size());
    for (std::size_t s = 0; s < side_dims.size(); ++s)
      for (i64 t = 0; t < q; ++t) st.sides[s].push_back(make_row(salt, kPartSide + s, L + t, B, side_dims[s], dtype()));
    st.conv.resize(conv_ch.size());
    for (std::size_t s = 0; s < conv_ch.size(); ++s)
      for (i64 t = 0; t < q; ++t) st.conv[s].push_back(make_row(salt, kPartConv + s, L + t, B, conv_ch[s], dtype()));
    st.rec.resize(rec_shapes.size());
    for (std::size_t s = 0; s < rec_shapes.size(); ++s)
      for (i64 t = 0; t < q; ++t)
        st.rec[s].push_back(make_row(salt, kPartRec + s, L + t + 1, B, rec_numel[s], rdtype()));
    return st;
  }

  // The step data that replays positions [0, L) of this layer's history.
  StepData history_step() const {
    StepData st;
    st.q = L;
    st.keys = keys;
    st.values = values;
    st.sides = sides;
    st.conv = conv;
    st.rec.resize(rec.size());
    for (std::size_t s = 0; s < rec.size(); ++s) st.rec[s].assign(rec[s].begin() + 1, rec[s].end());
    return st;
  }

  // Appends a step (every part) and applies the retention rule.
  void apply_update(const StepData& st) {
    for (i64 t = 0; t < st.q; ++t) {
      const auto ut = static_cast<std::size_t>(t);
      if (has_attention()) {
        keys.push_back(st.keys[ut]);
        values.push_back(st.values[ut]);
      }
      for (std::size_t s = 0; s < sides.size(); ++s) sides[s].push_back(st.sides[s][ut]);
      for (std::size_t s = 0; s < conv.size(); ++s) conv[s].push_back(st.conv[s][ut]);
      for (std::size_t s = 0; s < rec.size(); ++s) rec[s].push_back(st.rec[s][ut]);
    }
    L += st.q;
    retain(effective_r());
  }

  // ---- batch operations: row b becomes old row idx[b]
  void batch_apply(const std::vector<i64>& idx) {
    if (stateless_) return;
    auto perm = [&](Bytes& row, std::size_t row_bytes) {
      Bytes out;
      out.reserve(idx.size() * row_bytes);
      for (i64 i : idx)
        out.insert(out.end(), row.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i) * row_bytes),
                   row.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i + 1) * row_bytes));
      row = std::move(out);
    };
    for (auto& r : keys) perm(r, static_cast<std::size_t>(H * Dk) * esize());
    for (auto& r : values) perm(r, static_cast<std::size_t>(H * Dv) * esize());
    for (std::size_t s = 0; s < sides.size(); ++s)
      for (auto& r : sides[s]) perm(r, static_cast<std::size_t>(side_dims[s]) * esize());
    for (std::size_t s = 0; s < conv.size(); ++s)
      for (auto& r : conv[s]) perm(r, static_cast<std::size_t>(conv_ch[s]) * esize());
    for (std::size_t s = 0; s < rec.size(); ++s)
      for (auto& r : rec[s]) perm(r, static_cast<std::size_t>(rec_numel[s]) * resize());
    B = static_cast<i64>(idx.size());
  }
  Expect select_expect(const std::vector<i64>& idx) const {
    Expect x;
    if (stateless_) return x;
    if (idx.empty()) x.kind = Err::Invalid;
    for (i64 i : idx)
      if (i < 0 || i >= B) x.kind = Err::Index;
    return x;
  }
  Expect reorder_expect(const std::vector<i64>& idx) const {
    Expect x;
    if (stateless_) return x;
    if (static_cast<i64>(idx.size()) != B) {
      x.kind = Err::Invalid;
      return x;
    }
    for (i64 i : idx)
      if (i < 0 || i >= B) x.kind = Err::Index;
    return x;
  }
  std::vector<i64> repeat_indices(i64 r) const {
    std::vector<i64> idx;
    for (i64 b = 0; b < B; ++b)
      for (i64 j = 0; j < r; ++j) idx.push_back(b);
    return idx;
  }

  // ---- expected tensors (row-major bytes)
  // Keys / values [B, H, to-from, D] of positions [from, to).
  Bytes expect_kv(bool is_keys, i64 from, i64 to) const {
    const i64 D = is_keys ? Dk : Dv;
    const auto& h = is_keys ? keys : values;
    const std::size_t es = esize();
    Bytes out;
    for (i64 b = 0; b < B; ++b)
      for (i64 hh = 0; hh < H; ++hh)
        for (i64 p = from; p < to; ++p) {
          const Bytes& r = h[static_cast<std::size_t>(p)];
          const std::size_t off = static_cast<std::size_t>((b * H + hh) * D) * es;
          out.insert(out.end(), r.begin() + static_cast<std::ptrdiff_t>(off),
                     r.begin() + static_cast<std::ptrdiff_t>(off + static_cast<std::size_t>(D) * es));
        }
    return out;
  }
  // Side rows [B, to-from, D].
  Bytes expect_side(std::size_t s, i64 from, i64 to) const {
    const i64 D = side_dims[s];
    const std::size_t es = esize();
    Bytes out;
    for (i64 b = 0; b < B; ++b)
      for (i64 p = from; p < to; ++p) {
        const Bytes& r = sides[s][static_cast<std::size_t>(p)];
        const std::size_t off = static_cast<std::size_t>(b * D) * es;
        out.insert(out.end(), r.begin() + static_cast<std::ptrdiff_t>(off),
                   r.begin() + static_cast<std::ptrdiff_t>(off + static_cast<std::size_t>(D) * es));
      }
    return out;
  }
  // Conv inputs [B, channels, to-from] of positions [from, to), zeros before 0.
  Bytes expect_conv(std::size_t s, i64 from, i64 to) const {
    const i64 ch = conv_ch[s];
    const std::size_t es = esize();
    Bytes out;
    for (i64 b = 0; b < B; ++b)
      for (i64 c = 0; c < ch; ++c)
        for (i64 p = from; p < to; ++p) {
          if (p < 0) {
            out.insert(out.end(), es, 0);
            continue;
          }
          const Bytes& r = conv[s][static_cast<std::size_t>(p)];
          const std::size_t off = static_cast<std::size_t>(b * ch + c) * es;
          out.insert(out.end(), r.begin() + static_cast<std::ptrdiff_t>(off),
                     r.begin() + static_cast<std::ptrdiff_t>(off + es));
        }
    return out;
  }
  const Bytes& expect_rec(std::size_t s, i64 j) const { return rec[s][static_cast<std::size_t>(j)]; }

  std::vector<i64> rec_state_shape(std::size_t s) const {
    std::vector<i64> sh{B};
    sh.insert(sh.end(), rec_shapes[s].begin(), rec_shapes[s].end());
    return sh;
  }

  // ---- inputs built from step data
  HostTensor kv_input(const StepData& st, bool is_keys, bool strided) const {
    const i64 D = is_keys ? Dk : Dv;
    const auto& rows = is_keys ? st.keys : st.values;
    const i64 q = st.q;
    const std::size_t es = esize();
    HostTensor t(dtype(), {B, H, q, D});
    if (strided) t.strides = {q * H * D, D, H * D, 1};  // memory laid out [B, q, H, D]
    const TensorView v = t.view();
    for (i64 b = 0; b < B; ++b)
      for (i64 hh = 0; hh < H; ++hh)
        for (i64 p = 0; p < q; ++p)
          std::memcpy(v.ptr(b, hh, p, 0),
                      rows[static_cast<std::size_t>(p)].data() + static_cast<std::size_t>((b * H + hh) * D) * es,
                      static_cast<std::size_t>(D) * es);
    return t;
  }
  HostTensor side_input(const StepData& st, std::size_t s) const {
    const i64 D = side_dims[s];
    const std::size_t es = esize();
    HostTensor t(dtype(), {B, st.q, D});
    const TensorView v = t.view();
    for (i64 b = 0; b < B; ++b)
      for (i64 p = 0; p < st.q; ++p)
        std::memcpy(v.ptr(b, p, 0),
                    st.sides[s][static_cast<std::size_t>(p)].data() + static_cast<std::size_t>(b * D) * es,
                    static_cast<std::size_t>(D) * es);
    return t;
  }
  HostTensor conv_input(const StepData& st, std::size_t s) const {
    const i64 ch = conv_ch[s];
    const std::size_t es = esize();
    HostTensor t(dtype(), {B, ch, st.q});
    const TensorView v = t.view();
    for (i64 b = 0; b < B; ++b)
      for (i64 c = 0; c < ch; ++c)
        for (i64 p = 0; p < st.q; ++p)
          std::memcpy(v.ptr(b, c, p),
                      st.conv[s][static_cast<std::size_t>(p)].data() + static_cast<std::size_t>(b * ch + c) * es, es);
    return t;
  }
  // S(L+1+t) as one [B, shape...] tensor (update_recurrent_state's input).
  HostTensor rec_token_input(const StepData& st, std::size_t s, i64 t) const {
    HostTensor h(rdtype(), rec_state_shape(s));
    h.bytes = st.rec[s][static_cast<std::size_t>(t)];
    return h;
  }

 private:
  LayerKind kind_;
  LayerOptions opt_;
  int index_;
  Attn attn_ = Attn::None;
  bool linear_ = false;
  bool stateless_ = false;
};

// ---- the reference cache (transactional over layers) --------------------------

class RefCache {
 public:
  std::vector<RefLayer> layers;

  i64 seq_length() const {
    for (const auto& l : layers)
      if (!l.stateless()) return l.L;
    return 0;
  }
  // Whole-cache operations need every stateful layer at one length (a
  // forward that stopped halfway leaves them out of step: StateError).
  bool in_step() const {
    for (const auto& l : layers)
      if (!l.stateless() && l.L != seq_length()) return false;
    return true;
  }
  i64 max_rollback() const {
    bool any = false;
    i64 m = 0;
    for (const auto& l : layers) {
      if (l.stateless()) continue;
      m = any ? std::min(m, l.max_rollback()) : l.max_rollback();
      any = true;
    }
    return any ? m : seq_length();
  }
  // Every layer's refusal (the cache may report any one of them).
  std::vector<Expect> crop_expect(i64 n) const {
    if (!in_step()) return {Expect{Err::State, -1, {}}};
    std::vector<Expect> out;
    for (const auto& l : layers) {
      Expect x = l.crop_expect(n);
      if (!x.ok()) out.push_back(x);
    }
    return out;
  }
  void crop(i64 n) {
    for (auto& l : layers) l.crop(n);
  }
  void activate(i64 r) {
    for (auto& l : layers) l.activate(r);
  }
  void deactivate() {
    for (auto& l : layers) l.deactivate();
  }
  bool recording() const {
    for (const auto& l : layers)
      if (!l.stateless()) return l.recording;
    return false;
  }
  void reset() {
    for (auto& l : layers) l.reset();
  }
  Expect select_expect(const std::vector<i64>& idx) const {
    if (!in_step()) return Expect{Err::State, -1, {}};
    for (const auto& l : layers) {
      Expect x = l.select_expect(idx);
      if (!x.ok()) return x;
    }
    return {};
  }
  Expect reorder_expect(const std::vector<i64>& idx) const {
    if (!in_step()) return Expect{Err::State, -1, {}};
    for (const auto& l : layers) {
      Expect x = l.reorder_expect(idx);
      if (!x.ok()) return x;
    }
    return {};
  }
  void batch_apply(const std::vector<i64>& idx) {
    for (auto& l : layers) l.batch_apply(idx);
  }
  i64 batch() const {
    for (const auto& l : layers)
      if (!l.stateless()) return l.B;
    return 1;
  }
  std::vector<i64> repeat_indices(i64 r) const {
    std::vector<i64> idx;
    for (i64 b = 0; b < batch(); ++b)
      for (i64 j = 0; j < r; ++j) idx.push_back(b);
    return idx;
  }
};

}  // namespace rwt
