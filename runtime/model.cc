#include "runtime/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "rewind/error.h"
#include "rewind/prefix_cache.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

namespace k = kernels;

namespace {

// An [out, in] matrix of `dtype` (F32, BF16 or F16) packed for
// kernels::matmul in the same dtype.
k::PackedMatrix pack(const std::byte* w, DType dtype, std::int64_t out, std::int64_t in) {
  const auto* half = static_cast<const std::uint16_t*>(static_cast<const void*>(w));
  if (dtype == DType::BF16) return k::PackedMatrix::from_bf16(half, out, in);
  if (dtype == DType::F16) return k::PackedMatrix::from_f16(half, out, in);
  return k::PackedMatrix(static_cast<const float*>(static_cast<const void*>(w)), out, in);
}

// Element i of a loaded tensor (F32, BF16 or F16) as f32, exactly.
float element_as_f32(const Tensor& t, std::size_t i) {
  switch (t.view().dtype) {
    case DType::BF16: return bf16_to_f32(t.data<std::uint16_t>()[i]);
    case DType::F16: return f16_to_f32(t.data<std::uint16_t>()[i]);
    default: return t.data<float>()[i];
  }
}

// The linear weight `name` ([out, in]) packed for kernels::matmul.
k::PackedMatrix packed(const ModelWeights& w, const std::string& name) {
  const Tensor& t = w.get(name);
  return pack(t.data<std::byte>(), t.view().dtype, t.view().size(0), t.view().size(1));
}

// The [B=1, H, n, D] keys / values view of token-major rows [n, H, D].
TensorView heads_view(float* rows, std::int64_t n, std::int64_t heads, std::int64_t dim) {
  return TensorView::strided(rows, DType::F32, {1, heads, n, dim}, {n * heads * dim, dim, heads * dim, 1});
}

// The [B=1, C, n] conv-input view of token-major rows [n, C].
TensorView channels_view(float* rows, std::int64_t n, std::int64_t channels) {
  return TensorView::strided(rows, DType::F32, {1, channels, n}, {n * channels, 1, channels});
}

// Throws InvalidArgument naming the first token outside the vocabulary.
void check_tokens(std::span<const std::int32_t> tokens, const ModelConfig& c, const char* where) {
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
      throw InvalidArgument(std::string(where) + ": token " + std::to_string(tokens[t]) + " at index " +
                            std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
    }
  }
}

// Adds the wall time of its scope to *sink (when sink is non-null).
class CacheTimer {
 public:
  explicit CacheTimer(double* sink) : sink_(sink) {
    if (sink_) start_ = std::chrono::steady_clock::now();
  }
  ~CacheTimer() {
    if (sink_) *sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  CacheTimer(const CacheTimer&) = delete;
  CacheTimer& operator=(const CacheTimer&) = delete;

 private:
  double* sink_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

Model::Model(ModelWeights weights) : weights_(std::move(weights)) {
  const ModelConfig& c = weights_.config();
  rope_cache_ = std::make_unique<kernels::RopeCache>(c.rope_theta, c.rope_dim());
  for (const auto& name : weights_.names()) parameter_count_ += weights_.get(name).numel();
  {  // before packing releases the originals
    const std::string config_text = to_json(c);
    std::uint64_t h = content_hash(std::as_bytes(std::span(config_text)));
    for (const auto& name : weights_.names()) {
      const Tensor& t = weights_.get(name);
      const std::string head = name + ":" + t.view().describe();
      h = content_hash(std::as_bytes(std::span(head)), h);
      h = content_hash(std::span(static_cast<const std::byte*>(t.view().data), t.bytes()), h);
    }
    static constexpr char digits[] = "0123456789abcdef";
    std::string hex(16, '0');
    for (int i = 15; i >= 0; --i, h >>= 4) hex[static_cast<std::size_t>(i)] = digits[h & 15];
    fingerprint_ = "rewind-hybrid-" + hex;
  }
  auto name = [&c](std::int64_t layer, WeightRole role) { return weight_name(c, layer, role); };
  // A small tensor (norm, conv, gate parameters) as f32 for the kernels: an
  // F32 tensor is used in place; a BF16 or F16 one is widened into folded_,
  // and so is a (1 + w) norm weight, with the 1 folded in once (1 + w in f32
  // is the rounding transformers does per forward, so the product is the
  // same).
  auto small = [&](const std::string& n, bool plus_one) -> const float* {
    const Tensor& t = weights_.get(n);
    if (t.view().dtype == DType::F32 && !plus_one) return t.data<float>();
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] = element_as_f32(t, i);
      if (plus_one) v[i] = 1.0f + v[i];
    }
    return folded_.emplace_back(std::move(v)).data();
  };
  auto norm = [&](const std::string& n) { return small(n, c.norm_plus_one); };
  const std::string embed_name = name(0, WeightRole::Embed);
  final_norm_ = norm(name(0, WeightRole::FinalNorm));
  lm_head_ = packed(weights_, c.tie_word_embeddings ? embed_name : name(0, WeightRole::LmHead));
  // A tied embedding is looked up in the packed output matrix (the same
  // values), so the model holds it once.
  embed_ = c.tie_word_embeddings ? nullptr : &weights_.get(embed_name);
  // Linear weights are released as soon as their layer is packed, so loading
  // holds at most one layer's matrices twice.
  if (c.tie_word_embeddings) weights_.release(embed_name);
  if (!c.tie_word_embeddings) weights_.release(name(0, WeightRole::LmHead));
  // glibc raises its mmap threshold as large blocks are freed, so released
  // weights end up as free heap pages it keeps; handing them back after each
  // release keeps freed and packed copies from adding up while loading.
  auto trim = [] {
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
  };
  trim();
  std::vector<std::string> packed_names;
  // Rows [first + k * stride, ... + count) for k = 0, 1, ..., of the [out, in]
  // matrix `t`, gathered in that order and packed (in t's dtype): how fused
  // projections (per-head query and gate, Qwen3-Next's per-key-head qkvz /
  // ba groups) are split into the unfused matrices the blocks multiply with.
  auto gather = [](const Tensor& t, std::int64_t groups, std::int64_t stride, std::int64_t first,
                   std::int64_t count) {
    const std::int64_t in = t.view().size(1);
    const std::size_t row = static_cast<std::size_t>(in) * dtype_size(t.view().dtype);
    std::vector<std::byte> rows(static_cast<std::size_t>(groups * count) * row);
    for (std::int64_t g = 0; g < groups; ++g) {
      std::memcpy(rows.data() + static_cast<std::size_t>(g * count) * row,
                  t.data<std::byte>() + static_cast<std::size_t>(g * stride + first) * row,
                  static_cast<std::size_t>(count) * row);
    }
    return pack(rows.data(), t.view().dtype, groups * count, in);
  };
  auto release_packed = [&] {
    for (const auto& n : packed_names) weights_.release(n);
    packed_names.clear();
    trim();
  };
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto get = [&](WeightRole role) { return small(name(i, role), false); };
    auto linear = [&](WeightRole role) {
      k::PackedMatrix m = packed(weights_, name(i, role));
      weights_.release(name(i, role));
      return m;
    };
    LayerWeights w;
    w.input_norm = norm(name(i, WeightRole::InputNorm));
    w.post_norm = norm(name(i, WeightRole::PostNorm));
    w.gate = linear(WeightRole::MlpGate);
    w.up = linear(WeightRole::MlpUp);
    w.down = linear(WeightRole::MlpDown);
    switch (c.layer_types[static_cast<std::size_t>(i)]) {
      case LayerKind::FullAttention:
      case LayerKind::SlidingAttention:
        w.kind = c.layer_types[static_cast<std::size_t>(i)] == LayerKind::FullAttention ? LayerWeights::Kind::Attention
                                                                                        : LayerWeights::Kind::Sliding;
        has_attention_ = true;
        if (c.attn_output_gate) {
          // q_proj: per head, head_dim query rows then head_dim gate rows.
          const Tensor& q = weights_.get(name(i, WeightRole::AttnQ));
          w.wq = gather(q, c.num_attention_heads, 2 * c.head_dim, 0, c.head_dim);
          w.wgate = gather(q, c.num_attention_heads, 2 * c.head_dim, c.head_dim, c.head_dim);
          packed_names.push_back(name(i, WeightRole::AttnQ));
        } else {
          w.wq = linear(WeightRole::AttnQ);
        }
        w.wk = linear(WeightRole::AttnK);
        w.wv = linear(WeightRole::AttnV);
        w.wo = linear(WeightRole::AttnO);
        if (c.qk_norm) {
          w.q_norm = norm(name(i, WeightRole::AttnQNorm));
          w.k_norm = norm(name(i, WeightRole::AttnKNorm));
        }
        break;
      case LayerKind::LinearAttention:
        w.kind = LayerWeights::Kind::GatedDeltaNet;
        if (c.fused_gdn_projections) {
          // Qwen3-Next groups the rows per key head g: [q (kd), k (kd), v (r vd),
          // z (r vd)] and [b (r), a (r)] with r = lnv / lnk value heads per key
          // head; the unfused layout is all q, all k, all v (value heads in
          // order g * r + j), and z, b, a in value-head order.
          const std::int64_t nk = c.linear_num_key_heads, kd = c.linear_key_head_dim;
          const std::int64_t r = c.linear_num_value_heads / nk, rv = r * c.linear_value_head_dim;
          const std::int64_t group = 2 * kd + 2 * rv;
          const Tensor& qkvz = weights_.get(name(i, WeightRole::GdnQkvz));
          const Tensor& ba = weights_.get(name(i, WeightRole::GdnBa));
          const std::int64_t d = c.hidden_size;
          const std::size_t row = static_cast<std::size_t>(d) * dtype_size(qkvz.view().dtype);
          std::vector<std::byte> qkv(static_cast<std::size_t>(c.linear_conv_dim()) * row);
          std::byte* dst = qkv.data();
          for (std::int64_t part : {std::int64_t{0}, kd, 2 * kd}) {  // q, k, v blocks of each group
            const std::int64_t count = part == 2 * kd ? rv : kd;
            for (std::int64_t g = 0; g < nk; ++g, dst += static_cast<std::size_t>(count) * row) {
              std::memcpy(dst, qkvz.data<std::byte>() + static_cast<std::size_t>(g * group + part) * row,
                          static_cast<std::size_t>(count) * row);
            }
          }
          w.in_qkv = pack(qkv.data(), qkvz.view().dtype, c.linear_conv_dim(), d);
          w.in_z = gather(qkvz, nk, group, 2 * kd + rv, rv);
          w.in_b = gather(ba, nk, 2 * r, 0, r);
          w.in_a = gather(ba, nk, 2 * r, r, r);
          packed_names.push_back(name(i, WeightRole::GdnQkvz));
          packed_names.push_back(name(i, WeightRole::GdnBa));
        } else {
          w.in_qkv = linear(WeightRole::GdnQkv);
          w.in_z = linear(WeightRole::GdnZ);
          w.in_b = linear(WeightRole::GdnB);
          w.in_a = linear(WeightRole::GdnA);
        }
        w.conv = get(WeightRole::GdnConv);
        w.dt_bias = get(WeightRole::GdnDtBias);
        w.a_log = get(WeightRole::GdnALog);
        w.out_norm = get(WeightRole::GdnNorm);  // a plain-weight norm in every family
        w.out = linear(WeightRole::GdnOut);
        break;
      case LayerKind::Conv:
        w.kind = LayerWeights::Kind::ShortConv;
        w.in_bcx = linear(WeightRole::ConvIn);
        w.conv = get(WeightRole::ConvConv);
        w.out = linear(WeightRole::ConvOut);
        break;
      case LayerKind::ChunkedAttention:
      case LayerKind::Hybrid:
      case LayerKind::HybridSliding:
      case LayerKind::SparseAttention:
      case LayerKind::Moe:
      case LayerKind::Mlp:
        throw FormatError("config.json: layer type '" +
                          std::string(layer_kind_name(c.layer_types[static_cast<std::size_t>(i)])) + "' of layer " +
                          std::to_string(i) + " is not implemented by the runtime");
    }
    layers_.push_back(std::move(w));
    release_packed();
  }
}

std::size_t Model::weight_bytes() const {
  std::size_t total = weights_.bytes() + lm_head_.bytes();
  for (const auto& v : folded_) total += v.size() * sizeof(float);
  for (const LayerWeights& w : layers_) {
    for (const k::PackedMatrix* m : {&w.gate, &w.up, &w.down, &w.wq, &w.wk, &w.wv, &w.wo, &w.wgate, &w.in_qkv,
                                     &w.in_z, &w.in_b, &w.in_a, &w.out, &w.in_bcx}) {
      total += m->bytes();
    }
  }
  return total;
}

void Model::embed_row(std::int32_t token, float* dst) const {
  const std::int64_t d = config().hidden_size;
  if (embed_ == nullptr) {
    lm_head_.row(token, dst);
  } else if (embed_->view().dtype == DType::F32) {
    std::memcpy(dst, embed_->data<float>() + token * d, static_cast<std::size_t>(d) * sizeof(float));
  } else {
    const auto first = static_cast<std::size_t>(token * d);
    for (std::int64_t i = 0; i < d; ++i) dst[i] = element_as_f32(*embed_, first + static_cast<std::size_t>(i));
  }
}

Model Model::load(const std::string& dir) { return Model(ModelWeights::load(dir)); }

Cache Model::make_cache() const {
  const ModelConfig& c = config();
  std::vector<Layer> layers;
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerKind kind = c.layer_types[static_cast<std::size_t>(i)];
    LayerOptions o;
    o.dtype = DType::F32;
    o.batch_size = 1;
    switch (kind) {
      case LayerKind::FullAttention:
      case LayerKind::SlidingAttention:
        o.num_kv_heads = c.num_key_value_heads;
        o.key_dim = c.head_dim;
        o.sliding_window = c.sliding_window;
        break;
      case LayerKind::LinearAttention:
        o.conv_kernel_size = c.linear_conv_kernel_dim;
        o.conv_channels = {c.linear_conv_dim()};
        o.recurrent_shapes = {{c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}};
        break;
      case LayerKind::Conv:
        o.conv_kernel_size = c.conv_L_cache;
        o.conv_channels = {c.hidden_size};
        break;
      case LayerKind::ChunkedAttention:
      case LayerKind::Hybrid:
      case LayerKind::HybridSliding:
      case LayerKind::SparseAttention:
      case LayerKind::Moe:
      case LayerKind::Mlp: break;  // the constructor refused them
    }
    layers.emplace_back(kind, o, static_cast<int>(i));
  }
  return Cache(std::move(layers));
}

// ---- scratch rows ----------------------------------------------------------------------

void Model::ScratchRows::resize(std::size_t n) {
  if (n > capacity_) {
    data_.reset(new float[n]);  // not value-initialised: no zero-fill
    capacity_ = n;
  }
  size_ = n;
#ifndef NDEBUG
  // Debug builds (the sanitizer runs) fill the rows with NaN, so a read of
  // an element no kernel wrote (stale from an earlier forward, or never
  // set) shows up in every bitwise comparison instead of passing silently.
  std::fill(data_.get(), data_.get() + n, std::numeric_limits<float>::quiet_NaN());
#endif
}

void Model::ScratchRows::trim(std::size_t keep) {
  if (capacity_ <= keep) return;
  data_.reset();
  size_ = capacity_ = 0;
}

void Model::Scratch::resize_stream(std::size_t rows, std::size_t hidden, std::size_t intermediate) {
  for (ScratchRows* r : {&x, &h, &mix}) r->resize(rows * hidden);
  for (ScratchRows* r : {&gate, &up}) r->resize(rows * intermediate);
}

void Model::Scratch::trim(std::size_t keep) {
  for (ScratchRows* r : {&x, &h, &mix, &gate, &up, &attention.q, &attention.key, &attention.val, &attention.att,
                         &attention.gate, &deltanet.qkv, &deltanet.z, &deltanet.b, &deltanet.a, &deltanet.mixed,
                         &deltanet.q, &deltanet.key, &deltanet.v, &deltanet.g, &deltanet.beta, &deltanet.o, &conv.bcx,
                         &conv.bx, &conv.conv}) {
    r->trim(keep);
  }
}

// The calling thread's Scratch for one forward, and what it keeps after:
// buffers of up to kKeepFloats (256 KB: a 16-row batch's widest rows on
// the shipped and 26M models) stay for the next forward; a long prompt's
// bigger ones are freed when the forward ends, as before (so a thread holds
// at most 24 x 256 KB between forwards, on the shipped models a few tens
// of KB). Should a forward ever start while the thread's Scratch is in use,
// it gets one of its own.
class Model::ScratchLease {
 public:
  static constexpr std::size_t kKeepFloats = std::size_t{1} << 16;
  ScratchLease() {
    thread_local Scratch shared;
    if (shared.in_use) {
      own_ = std::make_unique<Scratch>();
      scratch_ = own_.get();
    } else {
      scratch_ = &shared;
    }
    scratch_->in_use = true;
  }
  ~ScratchLease() {
    scratch_->trim(kKeepFloats);
    scratch_->in_use = false;
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  Scratch& get() { return *scratch_; }

 private:
  Scratch* scratch_ = nullptr;
  std::unique_ptr<Scratch> own_;
};

// ---- the math of each block, shared by both forwards -------------------------------

void Model::attention_in(const LayerWeights& w, const float* h, std::int64_t n, const kernels::RopeTable& rope,
                         AttentionRows& r) const {
  const ModelConfig& c = config();
  const std::int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  r.q.resize(static_cast<std::size_t>(n * nh * hd));
  r.key.resize(static_cast<std::size_t>(n * nkv * hd));
  r.val.resize(r.key.size());
  r.att.resize(r.q.size());
  k::matmul(h, n, w.wq, r.q.data());
  k::matmul(h, n, w.wk, r.key.data());
  k::matmul(h, n, w.wv, r.val.data());
  if (w.q_norm != nullptr) {
    // Per-head RMSNorm (one row per token and head: batch invariant).
    k::rms_norm(r.q.data(), w.q_norm, n * nh, hd, c.rms_norm_eps, r.q.data());
    k::rms_norm(r.key.data(), w.k_norm, n * nkv, hd, c.rms_norm_eps, r.key.data());
  }
  k::rope_inplace(r.q.data(), n, nh, hd, rope);
  k::rope_inplace(r.key.data(), n, nkv, hd, rope);
  if (w.wgate.out() > 0) {
    r.gate.resize(r.q.size());
    k::matmul(h, n, w.wgate, r.gate.data());
  }
}

void Model::attention_out(const LayerWeights& w, std::int64_t n, AttentionRows& r, float* out) const {
  if (w.wgate.out() > 0) {
    for (std::size_t i = 0; i < r.att.size(); ++i) r.att[i] *= k::sigmoid(r.gate[i]);  // size: n rows
  }
  k::matmul(r.att.data(), n, w.wo, out);
}

void Model::deltanet_in(const LayerWeights& w, const float* h, std::int64_t n, DeltaNetRows& r) const {
  const ModelConfig& c = config();
  const std::int64_t nv = c.linear_num_value_heads, vv = nv * c.linear_value_head_dim;
  const std::int64_t channels = c.linear_conv_dim();
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  r.qkv.resize(sz(n * channels));
  r.z.resize(sz(n * vv));
  r.b.resize(sz(n * nv));
  r.a.resize(sz(n * nv));
  r.mixed.resize(sz(n * channels));
  k::matmul(h, n, w.in_qkv, r.qkv.data());
  k::matmul(h, n, w.in_z, r.z.data());
  k::matmul(h, n, w.in_b, r.b.data());
  k::matmul(h, n, w.in_a, r.a.data());
}

void Model::deltanet_mid(const LayerWeights& w, std::int64_t n, DeltaNetRows& r) const {
  const ModelConfig& c = config();
  const std::int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const std::int64_t kd = c.linear_key_head_dim, vd = c.linear_value_head_dim;
  const std::int64_t channels = c.linear_conv_dim(), qk = nk * kd, vv = nv * vd;
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  r.q.resize(sz(n * qk));
  r.key.resize(sz(n * qk));
  r.v.resize(sz(n * vv));
  r.g.resize(sz(n * nv));
  r.beta.resize(sz(n * nv));
  r.o.resize(sz(n * vv));
  for (std::int64_t t = 0; t < n; ++t) {
    const float* row = r.mixed.data() + t * channels;
    std::memcpy(r.q.data() + t * qk, row, sz(qk) * sizeof(float));
    std::memcpy(r.key.data() + t * qk, row + qk, sz(qk) * sizeof(float));
    std::memcpy(r.v.data() + t * vv, row + 2 * qk, sz(vv) * sizeof(float));
    for (std::int64_t hh = 0; hh < nv; ++hh) {
      const std::size_t i = sz(t * nv + hh);
      r.beta[i] = k::sigmoid(r.b[i]);
      r.g[i] = -std::exp(w.a_log[hh]) * k::softplus(r.a[i] + w.dt_bias[hh]);
    }
  }
  k::l2_normalize(r.q.data(), n * nk, kd, 1e-6f);
  k::l2_normalize(r.key.data(), n * nk, kd, 1e-6f);
  k::scale_inplace(r.q.data(), n * qk, 1.0f / std::sqrt(static_cast<float>(kd)));
}

void Model::deltanet_out(const LayerWeights& w, std::int64_t n, DeltaNetRows& r, float* out) const {
  const ModelConfig& c = config();
  k::gated_rms_norm(r.o.data(), r.z.data(), w.out_norm, n * c.linear_num_value_heads, c.linear_value_head_dim,
                    c.rms_norm_eps, r.o.data());
  k::matmul(r.o.data(), n, w.out, out);
}

void Model::short_conv_in(const LayerWeights& w, const float* h, std::int64_t n, ShortConvRows& r) const {
  const std::int64_t d = config().hidden_size;
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  r.bcx.resize(sz(n * 3 * d));
  r.bx.resize(sz(n * d));
  r.conv.resize(sz(n * d));
  k::matmul(h, n, w.in_bcx, r.bcx.data());
  for (std::int64_t t = 0; t < n; ++t) {
    const float* row = r.bcx.data() + t * 3 * d;
    for (std::int64_t i = 0; i < d; ++i) r.bx[sz(t * d + i)] = row[i] * row[2 * d + i];
  }
}

void Model::short_conv_out(const LayerWeights& w, std::int64_t n, ShortConvRows& r, float* out) const {
  const std::int64_t d = config().hidden_size;
  for (std::int64_t t = 0; t < n; ++t) {
    const float* gate = r.bcx.data() + t * 3 * d + d;
    for (std::int64_t i = 0; i < d; ++i) r.conv[static_cast<std::size_t>(t * d + i)] *= gate[i];
  }
  k::matmul(r.conv.data(), n, w.out, out);
}

void Model::mlp(const LayerWeights& w, std::int64_t n, ScratchRows& x, ScratchRows& h, ScratchRows& mix,
                ScratchRows& gate, ScratchRows& up) const {
  const ModelConfig& c = config();
  const std::int64_t d = c.hidden_size, ff = c.intermediate_size;
  k::add_inplace(x.data(), mix.data(), n * d);
  k::rms_norm(x.data(), w.post_norm, n, d, c.rms_norm_eps, h.data());
  k::matmul(h.data(), n, w.gate, gate.data());
  k::matmul(h.data(), n, w.up, up.data());
  k::swiglu(gate.data(), up.data(), n * ff, gate.data());
  k::matmul(gate.data(), n, w.down, mix.data());
  k::add_inplace(x.data(), mix.data(), n * d);
}

// ---- one sequence: rwd::Cache ---------------------------------------------------------

void Model::attention_block(const BlockArgs& a, const SequenceArgs& s) const {
  const ModelConfig& c = config();
  const std::int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim, n = a.n;
  AttentionRows& r = a.scratch->attention;
  attention_in(*a.w, a.h, n, *a.rope, r);
  MaskSizes mask;
  KeyValueView kv;
  {
    CacheTimer timer(s.cache_seconds);
    mask = s.cache->get_mask_sizes(n, a.layer);
    kv = s.cache->update(heads_view(r.key.data(), n, nkv, hd), heads_view(r.val.data(), n, nkv, hd), a.layer);
  }
  const k::StridedKV keys{static_cast<const float*>(kv.keys.data), kv.keys.stride(1), kv.keys.stride(2)};
  const k::StridedKV values{static_cast<const float*>(kv.values.data), kv.values.stride(1), kv.values.stride(2)};
  k::AttentionMask m;
  if (a.w->kind == LayerWeights::Kind::Sliding) m.window = c.sliding_window;
  k::attention(r.q.data(), n, s.pos0, nh, nkv, hd, keys, values, mask.kv_offset, mask.kv_length, m, r.att.data());
  attention_out(*a.w, n, r, a.out);
}

void Model::gated_deltanet_block(const BlockArgs& a, const SequenceArgs& s) const {
  const ModelConfig& c = config();
  const std::int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const std::int64_t kd = c.linear_key_head_dim, vd = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  const std::int64_t channels = c.linear_conv_dim(), n = a.n;
  DeltaNetRows& r = a.scratch->deltanet;
  deltanet_in(*a.w, a.h, n, r);
  TensorView window;
  {
    CacheTimer timer(s.cache_seconds);
    window = s.cache->update_conv_state(channels_view(r.qkv.data(), n, channels), a.layer);
  }
  k::causal_conv1d(static_cast<const float*>(window.data), channels, K, n, window.stride(1), window.stride(2),
                   a.w->conv, nullptr, /*fuse_silu=*/true, r.mixed.data());
  deltanet_mid(*a.w, n, r);
  std::vector<float*> states(static_cast<std::size_t>(n));
  const float* previous = nullptr;
  std::optional<RecurrentUpdate> update;
  {
    CacheTimer timer(s.cache_seconds);
    update.emplace(s.cache->begin_recurrent_update(n, a.layer));
    for (std::int64_t t = 0; t < n; ++t) states[static_cast<std::size_t>(t)] = static_cast<float*>(update->next(t + 1).data);
    previous = static_cast<const float*>(update->previous().data);
  }
  k::gated_delta_rule(r.q.data(), r.key.data(), r.v.data(), r.g.data(), r.beta.data(), n, nv, nk, kd, vd, previous,
                      states.data(), r.o.data());
  {
    CacheTimer timer(s.cache_seconds);
    update->commit();
  }
  deltanet_out(*a.w, n, r, a.out);
}

void Model::short_conv_block(const BlockArgs& a, const SequenceArgs& s) const {
  const ModelConfig& c = config();
  const std::int64_t d = c.hidden_size, K = c.conv_L_cache, n = a.n;
  ShortConvRows& r = a.scratch->conv;
  short_conv_in(*a.w, a.h, n, r);
  TensorView window;
  {
    CacheTimer timer(s.cache_seconds);
    window = s.cache->update_conv_state(channels_view(r.bx.data(), n, d), a.layer);
  }
  k::causal_conv1d(static_cast<const float*>(window.data), d, K, n, window.stride(1), window.stride(2), a.w->conv,
                   nullptr, /*fuse_silu=*/false, r.conv.data());
  short_conv_out(*a.w, n, r, a.out);
}

template <typename StateArgs>
void Model::mixer_block(const BlockArgs& a, const StateArgs& state) const {
  switch (a.w->kind) {
    case LayerWeights::Kind::Attention:
    case LayerWeights::Kind::Sliding: attention_block(a, state); break;
    case LayerWeights::Kind::GatedDeltaNet: gated_deltanet_block(a, state); break;
    case LayerWeights::Kind::ShortConv: short_conv_block(a, state); break;
  }
}

void Model::forward(std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits,
                    bool all_logits, double* cache_seconds) const {
  const ModelConfig& c = config();
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n < 1) throw InvalidArgument("Model::forward needs at least one token");
  check_tokens(tokens, c, "Model::forward");
  const std::int64_t d = c.hidden_size, ff = c.intermediate_size, V = c.vocab_size;
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  const std::int64_t pos0 = cache.get_seq_length();
  // All or nothing: room and budget for n tokens in every layer are reserved
  // before any layer changes, and an exception anywhere below (a kernel, an
  // allocation) abandons the forward, restoring every layer exactly.
  std::optional<Forward> transaction;
  {
    CacheTimer timer(cache_seconds);
    transaction.emplace(cache.begin_forward(n));
  }
  ScratchLease lease;
  Scratch& scratch = lease.get();
  scratch.resize_stream(sz(n), sz(d), sz(ff));
  ScratchRows &x = scratch.x, &h = scratch.h, &mix = scratch.mix, &gate = scratch.gate, &up = scratch.up;
  for (std::int64_t t = 0; t < n; ++t) embed_row(tokens[sz(t)], x.data() + t * d);
  // One table of RoPE angles for the positions of this forward, shared by
  // every attention layer.
  std::vector<std::int64_t> positions(sz(n));
  for (std::int64_t t = 0; t < n; ++t) positions[sz(t)] = pos0 + t;
  const k::RopeTable rope(positions.data(), has_attention_ ? n : 0, *rope_cache_);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& w = layers_[i];
    const int layer = static_cast<int>(i);
    k::rms_norm(x.data(), w.input_norm, n, d, c.rms_norm_eps, h.data());
    mixer_block({layer, &w, h.data(), n, &rope, mix.data(), &scratch}, SequenceArgs{&cache, pos0, cache_seconds});
    mlp(w, n, x, h, mix, gate, up);
  }
  const std::int64_t first = all_logits ? 0 : n - 1;
  const std::int64_t rows = n - first;
  k::rms_norm(x.data() + first * d, final_norm_, rows, d, c.rms_norm_eps, h.data());
  logits.resize(sz(rows * V));
  k::matmul(h.data(), rows, lm_head_, logits.data());
  CacheTimer timer(cache_seconds);
  transaction->commit();
}

// ---- trees: rwd::TreeForward -------------------------------------------------------------

void Model::attention_block(const BlockArgs& a, const TreeArgs& t) const {
  const ModelConfig& c = config();
  const std::int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim, n = a.n;
  const std::int64_t row = nkv * hd;
  AttentionRows& r = a.scratch->attention;
  attention_in(*a.w, a.h, n, *a.rope, r);
  TreeKeyValues kv;
  {
    CacheTimer timer(t.cache_seconds);
    kv = t.cache->update_tree(heads_view(r.key.data(), n, nkv, hd), heads_view(r.val.data(), n, nkv, hd), a.layer);
  }
  k::AttentionMask m;
  if (a.w->kind == LayerWeights::Kind::Sliding) m.window = c.sliding_window;
  const k::StridedKV strides{nullptr, hd, row};  // token-major, as the committed rows
  const std::int64_t L = t.tree->start_length();
  std::vector<float> path_k, path_v;
  for (std::int64_t node = 0; node < n; ++node) {
    // Node i reads the committed rows its window sees, then its path's rows
    // in position order: the keys its chain would hold, in the same order.
    const std::int64_t first = kv.first_visible[static_cast<std::size_t>(node)];
    const std::vector<std::int64_t> path = t.tree->path(node);
    path_k.clear();
    path_v.clear();
    for (std::int64_t p : path) {
      if (L + t.tree->depth(p) < first) continue;
      path_k.insert(path_k.end(), r.key.begin() + p * row, r.key.begin() + (p + 1) * row);
      path_v.insert(path_v.end(), r.val.begin() + p * row, r.val.begin() + (p + 1) * row);
    }
    const std::int64_t own = static_cast<std::int64_t>(path_k.size()) / row;
    const std::int64_t committed = std::max<std::int64_t>(0, L - first);
    const std::int64_t skip = std::max<std::int64_t>(0, first - kv.committed_first);
    const k::KVRun runs[2] = {
        {static_cast<const float*>(kv.committed.keys.data) + skip * row,
         static_cast<const float*>(kv.committed.values.data) + skip * row, committed},
        {path_k.data(), path_v.data(), own}};
    k::attention_paged(r.q.data() + node * nh * hd, 1, L + t.tree->depth(node), nh, nkv, hd,
                       std::span<const k::KVRun>(runs + (committed == 0 ? 1 : 0), committed == 0 ? 1 : 2), strides,
                       strides, first, committed + own, m, r.att.data() + node * nh * hd);
  }
  attention_out(*a.w, n, r, a.out);
}

void Model::gated_deltanet_block(const BlockArgs& a, const TreeArgs& t) const {
  const ModelConfig& c = config();
  const std::int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const std::int64_t kd = c.linear_key_head_dim, vd = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  const std::int64_t channels = c.linear_conv_dim(), n = a.n;
  DeltaNetRows& r = a.scratch->deltanet;
  deltanet_in(*a.w, a.h, n, r);
  TensorView windows;
  {
    CacheTimer timer(t.cache_seconds);
    windows = t.cache->update_tree_conv(channels_view(r.qkv.data(), n, channels), a.layer);
  }
  // Each node's window along its path: [N, C, K] (time-major rows).
  for (std::int64_t node = 0; node < n; ++node)
    k::causal_conv1d(static_cast<const float*>(windows.data) + node * windows.stride(0), channels, K, 1, windows.stride(1),
                     windows.stride(2), a.w->conv, nullptr, /*fuse_silu=*/true, r.mixed.data() + node * channels);
  deltanet_mid(*a.w, n, r);
  TreeRecurrentSlots slots;
  {
    CacheTimer timer(t.cache_seconds);
    slots = t.cache->tree_recurrent_slots(a.layer);
  }
  // Parents come before their children: a node's previous state is written.
  for (std::int64_t node = 0; node < n; ++node) {
    float* next = static_cast<float*>(slots.next(node).data);
    k::gated_delta_rule(r.q.data() + node * nk * kd, r.key.data() + node * nk * kd, r.v.data() + node * nv * vd,
                        r.g.data() + node * nv, r.beta.data() + node * nv, 1, nv, nk, kd, vd,
                        static_cast<const float*>(slots.previous(node).data), &next, r.o.data() + node * nv * vd);
  }
  deltanet_out(*a.w, n, r, a.out);
}

void Model::short_conv_block(const BlockArgs& a, const TreeArgs& t) const {
  const ModelConfig& c = config();
  const std::int64_t d = c.hidden_size, K = c.conv_L_cache, n = a.n;
  ShortConvRows& r = a.scratch->conv;
  short_conv_in(*a.w, a.h, n, r);
  TensorView windows;
  {
    CacheTimer timer(t.cache_seconds);
    windows = t.cache->update_tree_conv(channels_view(r.bx.data(), n, d), a.layer);
  }
  for (std::int64_t node = 0; node < n; ++node)
    k::causal_conv1d(static_cast<const float*>(windows.data) + node * windows.stride(0), d, K, 1, windows.stride(1),
                     windows.stride(2), a.w->conv, nullptr, /*fuse_silu=*/false, r.conv.data() + node * d);
  short_conv_out(*a.w, n, r, a.out);
}

void Model::forward_tree(std::span<const std::int32_t> tokens, const TreeForward& tree, Cache& cache,
                         std::vector<float>& logits, double* cache_seconds) const {
  const ModelConfig& c = config();
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (!tree.is_open() || !cache.tree_open()) {
    throw StateError("Model::forward_tree needs a tree opened on this cache (Cache::begin_tree)");
  }
  if (n != tree.num_nodes()) {
    throw InvalidArgument("Model::forward_tree got " + std::to_string(n) + " tokens for a tree of " +
                          std::to_string(tree.num_nodes()) + " nodes");
  }
  check_tokens(tokens, c, "Model::forward_tree");
  const std::int64_t d = c.hidden_size, ff = c.intermediate_size, V = c.vocab_size;
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  ScratchLease lease;
  Scratch& scratch = lease.get();
  scratch.resize_stream(sz(n), sz(d), sz(ff));
  ScratchRows &x = scratch.x, &h = scratch.h, &mix = scratch.mix, &gate = scratch.gate, &up = scratch.up;
  for (std::int64_t t = 0; t < n; ++t) embed_row(tokens[sz(t)], x.data() + t * d);
  std::vector<std::int64_t> positions(sz(n));
  for (std::int64_t t = 0; t < n; ++t) positions[sz(t)] = tree.position(t);
  const k::RopeTable rope(positions.data(), has_attention_ ? n : 0, *rope_cache_);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& w = layers_[i];
    const int layer = static_cast<int>(i);
    k::rms_norm(x.data(), w.input_norm, n, d, c.rms_norm_eps, h.data());
    mixer_block({layer, &w, h.data(), n, &rope, mix.data(), &scratch}, TreeArgs{&cache, &tree, cache_seconds});
    mlp(w, n, x, h, mix, gate, up);
  }
  k::rms_norm(x.data(), final_norm_, n, d, c.rms_norm_eps, h.data());
  logits.resize(sz(n * V));
  k::matmul(h.data(), n, lm_head_, logits.data());
}

// ---- many sequences: rwd::SequenceCache ---------------------------------------------

// ---- many sequences: the blocks over a ragged batch ---------------------------------

void Model::attention_block(const BlockArgs& a, const BatchArgs& b) const {
  const ModelConfig& c = config();
  const std::int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  AttentionRows& r = a.scratch->attention;
  attention_in(*a.w, a.h, a.n, *a.rope, r);
  const std::span<const PagedKeyValues> kv =
      b.cache->update(heads_view(r.key.data(), a.n, nkv, hd), heads_view(r.val.data(), a.n, nkv, hd), a.layer);
  const BlockLayout& layout = b.cache->block_layout(a.layer);
  k::AttentionMask m;
  if (a.w->kind == LayerWeights::Kind::Sliding) m.window = c.sliding_window;
  // Attention reads each sequence's keys and values in place, block by
  // block (the same values in the same order as a contiguous cache, so the
  // result is the single-sequence one).
  std::vector<k::KVRun> runs;
  const k::StridedKV strides{nullptr, hd, nkv * hd};
  for (std::size_t e = 0; e < b.batch.size(); ++e) {
    const auto n = static_cast<std::int64_t>(b.batch[e].tokens.size());
    if (n == 0) continue;
    runs.clear();
    layout.for_each_block_rows(kv[e].spans, kv[e].kv_offset, kv[e].kv_length,
                               [&](const std::byte* block, std::int64_t row, std::int64_t count, std::int64_t) {
                                 runs.push_back({static_cast<const float*>(layout.rows(block, 0, row, count).data),
                                                 static_cast<const float*>(layout.rows(block, 1, row, count).data),
                                                 count});
                               });
    k::attention_paged(r.q.data() + b.offset[e] * nh * hd, n, b.pos0[e], nh, nkv, hd, runs, strides, strides,
                       kv[e].kv_offset, kv[e].kv_length, m, r.att.data() + b.offset[e] * nh * hd);
  }
  attention_out(*a.w, a.n, r, a.out);
}

void Model::gated_deltanet_block(const BlockArgs& a, const BatchArgs& b) const {
  const ModelConfig& c = config();
  const std::int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const std::int64_t kd = c.linear_key_head_dim, vd = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  const std::int64_t channels = c.linear_conv_dim(), qk = nk * kd, vv = nv * vd;
  DeltaNetRows& r = a.scratch->deltanet;
  deltanet_in(*a.w, a.h, a.n, r);
  const std::span<const TensorView> windows =
      b.cache->update_conv_state(channels_view(r.qkv.data(), a.n, channels), a.layer);
  for (std::size_t e = 0; e < b.batch.size(); ++e) {
    const auto n = static_cast<std::int64_t>(b.batch[e].tokens.size());
    if (n == 0) continue;
    k::causal_conv1d(static_cast<const float*>(windows[e].data), channels, K, n, windows[e].stride(1),
                     windows[e].stride(2), a.w->conv, nullptr, /*fuse_silu=*/true, r.mixed.data() + b.offset[e] * channels);
  }
  deltanet_mid(*a.w, a.n, r);
  BatchRecurrentUpdate update = b.cache->begin_recurrent_update(a.layer);
  std::vector<float*> states;
  for (std::size_t e = 0; e < b.batch.size(); ++e) {
    const auto n = static_cast<std::int64_t>(b.batch[e].tokens.size());
    if (n == 0) continue;
    states.resize(static_cast<std::size_t>(n));
    for (std::int64_t t = 0; t < n; ++t) states[static_cast<std::size_t>(t)] = static_cast<float*>(update.next(e, t + 1).data);
    const std::int64_t o = b.offset[e];
    k::gated_delta_rule(r.q.data() + o * qk, r.key.data() + o * qk, r.v.data() + o * vv, r.g.data() + o * nv,
                        r.beta.data() + o * nv, n, nv, nk, kd, vd, static_cast<const float*>(update.previous(e).data),
                        states.data(), r.o.data() + o * vv);
  }
  update.commit();
  deltanet_out(*a.w, a.n, r, a.out);
}

void Model::short_conv_block(const BlockArgs& a, const BatchArgs& b) const {
  const ModelConfig& c = config();
  const std::int64_t d = c.hidden_size, K = c.conv_L_cache;
  ShortConvRows& r = a.scratch->conv;
  short_conv_in(*a.w, a.h, a.n, r);
  const std::span<const TensorView> windows = b.cache->update_conv_state(channels_view(r.bx.data(), a.n, d), a.layer);
  for (std::size_t e = 0; e < b.batch.size(); ++e) {
    const auto n = static_cast<std::int64_t>(b.batch[e].tokens.size());
    if (n == 0) continue;
    k::causal_conv1d(static_cast<const float*>(windows[e].data), d, K, n, windows[e].stride(1), windows[e].stride(2),
                     a.w->conv, nullptr, /*fuse_silu=*/false, r.conv.data() + b.offset[e] * d);
  }
  short_conv_out(*a.w, a.n, r, a.out);
}

SequenceCache Model::make_sequence_cache(SequenceCacheOptions options) const {
  const Cache one = make_cache();  // the layers' kinds and options, once
  std::vector<SequenceLayer> layers;
  for (int i = 0; i < one.num_layers(); ++i) layers.push_back({one.layer(i).kind(), one.layer(i).options()});
  return SequenceCache(std::move(layers), options);
}

void Model::forward_batch(std::span<const SequenceTokens> batch, SequenceCache& cache,
                          std::vector<float>& logits) const {
  const ModelConfig& c = config();
  if (batch.empty()) throw InvalidArgument("Model::forward_batch needs at least one sequence");
  std::vector<BatchEntry> entries;
  std::vector<std::int64_t> pos0, offset;
  std::int64_t T = 0;
  for (const SequenceTokens& s : batch) {
    check_tokens(s.tokens, c, "Model::forward_batch");
    if (s.logits != LogitRows::kAll && s.logits != LogitRows::kLast && s.logits != LogitRows::kNone) {
      throw InvalidArgument("Model::forward_batch: entry " + std::to_string(entries.size()) + " asks for logit rows " +
                            std::to_string(static_cast<int>(s.logits)) + "; allowed: kAll, kLast, kNone");
    }
    entries.push_back({s.seq, static_cast<std::int64_t>(s.tokens.size())});
    pos0.push_back(cache.seq_length(s.seq));
    offset.push_back(T);
    T += static_cast<std::int64_t>(s.tokens.size());
  }
  const std::int64_t d = c.hidden_size, ff = c.intermediate_size, V = c.vocab_size;
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  // All or nothing across the batch (an exception abandons it).
  SequenceBatch transaction = cache.begin_batch(entries);
  ScratchLease lease;
  Scratch& scratch = lease.get();
  scratch.resize_stream(sz(T), sz(d), sz(ff));
  ScratchRows &x = scratch.x, &h = scratch.h, &mix = scratch.mix, &gate = scratch.gate, &up = scratch.up;
  std::vector<std::int64_t> positions(sz(T));
  for (std::size_t e = 0; e < batch.size(); ++e) {
    for (std::size_t t = 0; t < batch[e].tokens.size(); ++t) {
      const std::int64_t row = offset[e] + static_cast<std::int64_t>(t);
      embed_row(batch[e].tokens[t], x.data() + row * d);
      positions[sz(row)] = pos0[e] + static_cast<std::int64_t>(t);
    }
  }
  const k::RopeTable rope(positions.data(), has_attention_ ? T : 0, *rope_cache_);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& w = layers_[i];
    const int layer = static_cast<int>(i);
    k::rms_norm(x.data(), w.input_norm, T, d, c.rms_norm_eps, h.data());
    mixer_block({layer, &w, h.data(), T, &rope, mix.data(), &scratch}, BatchArgs{&cache, batch, pos0, offset});
    mlp(w, T, x, h, mix, gate, up);
  }
  k::rms_norm(x.data(), final_norm_, T, d, c.rms_norm_eps, h.data());
  // The rows whose logits are asked for, gathered (each row's product does
  // not depend on the others: the same bits as over all T rows).
  std::int64_t R = 0;
  bool every_row = true;
  for (std::size_t e = 0; e < batch.size(); ++e) {
    const auto n = static_cast<std::int64_t>(batch[e].tokens.size());
    const std::int64_t wanted =
        batch[e].logits == LogitRows::kAll ? n : batch[e].logits == LogitRows::kLast ? std::min<std::int64_t>(n, 1) : 0;
    every_row = every_row && wanted == n;
    if (!every_row && wanted > 0) {
      std::memmove(h.data() + R * d, h.data() + (offset[e] + n - wanted) * d, sz(wanted * d) * sizeof(float));
    }
    R += wanted;
  }
  logits.resize(sz(R * V));
  if (R > 0) k::matmul(h.data(), R, lm_head_, logits.data());
  transaction.commit();
}

// The library owns the retention rules: ask a cache of this model's shapes.
RetentionBytes Model::retention_bytes(std::int64_t R) const {
  const Cache cache = make_cache();
  RetentionBytes total;
  for (int i = 0; i < cache.num_layers(); ++i) {
    const RetentionBytes layer = cache.layer(i).retention_bytes(R);
    total.bounded += layer.bounded;
    total.per_token += layer.per_token;
  }
  return total;
}

std::size_t Model::kv_bytes_per_token() const { return retention_bytes(0).per_token; }

std::size_t Model::fixed_state_bytes() const { return retention_bytes(0).bounded; }

std::size_t Model::rollback_bytes(std::int64_t R) const { return retention_bytes(R).bounded - fixed_state_bytes(); }

std::vector<std::int32_t> encode_prompt(const std::string& text, const ModelConfig& config) {
  std::vector<std::int32_t> tokens;
  tokens.reserve(text.size() + 1);
  if (config.add_bos && config.bos_token_id >= 0) tokens.push_back(static_cast<std::int32_t>(config.bos_token_id));
  for (unsigned char ch : text) tokens.push_back(static_cast<std::int32_t>(ch));
  return tokens;
}

std::string decode_tokens(std::span<const std::int32_t> tokens) {
  std::string out;
  for (std::int32_t t : tokens)
    if (t >= 0 && t < 256) out.push_back(static_cast<char>(t));
  return out;
}

}  // namespace rwd::runtime
