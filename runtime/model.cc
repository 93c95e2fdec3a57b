#include "runtime/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "rewind/error.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

namespace k = kernels;

namespace {

const float* data_of(const ModelWeights& w, const std::string& name) { return w.get(name).data<float>(); }

// The linear weight `name` ([out, in]) packed for kernels::matmul.
k::PackedMatrix packed(const ModelWeights& w, const std::string& name) {
  const Tensor& t = w.get(name);
  return k::PackedMatrix(t.data<float>(), t.view().size(0), t.view().size(1));
}

// The [B=1, H, n, D] keys / values view of token-major rows [n, H, D].
TensorView heads_view(float* rows, std::int64_t n, std::int64_t heads, std::int64_t dim) {
  return TensorView::strided(rows, DType::F32, {1, heads, n, dim}, {n * heads * dim, dim, heads * dim, 1});
}

// The [B=1, C, n] conv-input view of token-major rows [n, C].
TensorView channels_view(float* rows, std::int64_t n, std::int64_t channels) {
  return TensorView::strided(rows, DType::F32, {1, channels, n}, {n * channels, 1, channels});
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
  for (const auto& name : weights_.names()) parameter_count_ += weights_.get(name).numel();
  embed_ = data_of(weights_, "model.embed_tokens.weight");
  final_norm_ = data_of(weights_, "model.norm.weight");
  lm_head_ = packed(weights_, c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  // Linear weights whose packed copy is the only one used from here on (a
  // tied embedding stays: the lookup reads it).
  std::vector<std::string> packed_names;
  if (!c.tie_word_embeddings) packed_names.push_back("lm_head.weight");
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    auto get = [&](const std::string& name) { return data_of(weights_, p + name); };
    auto linear = [&](const std::string& name) {
      packed_names.push_back(p + name);
      return packed(weights_, p + name);
    };
    LayerWeights w;
    w.input_norm = get("input_layernorm.weight");
    w.post_norm = get("post_attention_layernorm.weight");
    w.gate = linear("mlp.gate_proj.weight");
    w.up = linear("mlp.up_proj.weight");
    w.down = linear("mlp.down_proj.weight");
    const std::string& type = c.layer_types[static_cast<std::size_t>(i)];
    if (type == "full_attention" || type == "sliding_attention") {
      w.kind = type == "full_attention" ? LayerWeights::Kind::Attention : LayerWeights::Kind::Sliding;
      has_attention_ = true;
      w.wq = linear("self_attn.q_proj.weight");
      w.wk = linear("self_attn.k_proj.weight");
      w.wv = linear("self_attn.v_proj.weight");
      w.wo = linear("self_attn.o_proj.weight");
    } else if (type == "linear_attention") {
      w.kind = LayerWeights::Kind::GatedDeltaNet;
      w.in_qkv = linear("linear_attn.in_proj_qkv.weight");
      w.in_z = linear("linear_attn.in_proj_z.weight");
      w.in_b = linear("linear_attn.in_proj_b.weight");
      w.in_a = linear("linear_attn.in_proj_a.weight");
      w.conv = get("linear_attn.conv1d.weight");
      w.dt_bias = get("linear_attn.dt_bias");
      w.a_log = get("linear_attn.A_log");
      w.out_norm = get("linear_attn.norm.weight");
      w.out = linear("linear_attn.out_proj.weight");
    } else if (type == "conv") {
      w.kind = LayerWeights::Kind::ShortConv;
      w.in_bcx = linear("conv.in_proj.weight");
      w.conv = get("conv.conv.weight");
      w.out = linear("conv.out_proj.weight");
    } else {
      throw FormatError("config.json: layer type '" + type + "' of layer " + std::to_string(i) +
                        " is not implemented by the runtime");
    }
    layers_.push_back(std::move(w));
  }
  for (const auto& name : packed_names) weights_.release(name);
}

Model Model::load(const std::string& dir) { return Model(ModelWeights::load(dir)); }

Cache Model::make_cache() const {
  const ModelConfig& c = config();
  std::vector<Layer> layers;
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string& type = c.layer_types[static_cast<std::size_t>(i)];
    LayerOptions o;
    o.dtype = DType::F32;
    o.batch_size = 1;
    LayerKind kind;
    if (type == "full_attention" || type == "sliding_attention") {
      kind = type == "full_attention" ? LayerKind::FullAttention : LayerKind::SlidingAttention;
      o.num_kv_heads = c.num_key_value_heads;
      o.key_dim = c.head_dim;
      o.sliding_window = c.sliding_window;
    } else if (type == "linear_attention") {
      kind = LayerKind::LinearAttention;
      o.conv_kernel_size = c.linear_conv_kernel_dim;
      o.conv_channels = {c.linear_conv_dim()};
      o.recurrent_shapes = {{c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}};
    } else {
      kind = LayerKind::Conv;
      o.conv_kernel_size = c.conv_L_cache;
      o.conv_channels = {c.hidden_size};
    }
    layers.emplace_back(kind, o, static_cast<int>(i));
  }
  return Cache(std::move(layers));
}

void Model::attention_block(int layer, const LayerWeights& w, const float* h, std::int64_t n, std::int64_t pos0,
                            const kernels::RopeTable& rope,
                            Cache& cache, float* out, double* cache_seconds) const {
  const ModelConfig& c = config();
  const std::int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(n * nh * hd)), key(static_cast<std::size_t>(n * nkv * hd)),
      val(key.size()), att(q.size());
  k::matmul(h, n, w.wq, q.data());
  k::matmul(h, n, w.wk, key.data());
  k::matmul(h, n, w.wv, val.data());
  k::rope_inplace(q.data(), n, nh, hd, rope);
  k::rope_inplace(key.data(), n, nkv, hd, rope);
  MaskSizes mask;
  KeyValueView kv;
  {
    CacheTimer timer(cache_seconds);
    mask = cache.get_mask_sizes(n, layer);
    kv = cache.update(heads_view(key.data(), n, nkv, hd), heads_view(val.data(), n, nkv, hd), layer);
  }
  const k::StridedKV keys{static_cast<const float*>(kv.keys.data), kv.keys.stride(1), kv.keys.stride(2)};
  const k::StridedKV values{static_cast<const float*>(kv.values.data), kv.values.stride(1), kv.values.stride(2)};
  k::AttentionMask m;
  if (w.kind == LayerWeights::Kind::Sliding) m.window = c.sliding_window;
  k::attention(q.data(), n, pos0, nh, nkv, hd, keys, values, mask.kv_offset, mask.kv_length, m, att.data());
  k::matmul(att.data(), n, w.wo, out);
}

void Model::gated_deltanet_block(int layer, const LayerWeights& w, const float* h, std::int64_t n, Cache& cache,
                                 float* out, double* cache_seconds) const {
  const ModelConfig& c = config();
  const std::int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const std::int64_t kd = c.linear_key_head_dim, vd = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
  const std::int64_t channels = c.linear_conv_dim(), qk = nk * kd, vv = nv * vd;
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  std::vector<float> qkv(sz(n * channels)), z(sz(n * vv)), b(sz(n * nv)), a(sz(n * nv)), mixed(sz(n * channels));
  k::matmul(h, n, w.in_qkv, qkv.data());
  k::matmul(h, n, w.in_z, z.data());
  k::matmul(h, n, w.in_b, b.data());
  k::matmul(h, n, w.in_a, a.data());
  TensorView window;
  {
    CacheTimer timer(cache_seconds);
    window = cache.update_conv_state(channels_view(qkv.data(), n, channels), layer);
  }
  k::causal_conv1d(static_cast<const float*>(window.data), channels, K, n, window.stride(1), window.stride(2), w.conv,
                   nullptr, /*fuse_silu=*/true, mixed.data());
  std::vector<float> q(sz(n * qk)), key(sz(n * qk)), v(sz(n * vv)), g(sz(n * nv)), beta(sz(n * nv)),
      o(sz(n * vv));
  for (std::int64_t t = 0; t < n; ++t) {
    const float* row = mixed.data() + t * channels;
    std::memcpy(q.data() + t * qk, row, sz(qk) * sizeof(float));
    std::memcpy(key.data() + t * qk, row + qk, sz(qk) * sizeof(float));
    std::memcpy(v.data() + t * vv, row + 2 * qk, sz(vv) * sizeof(float));
    for (std::int64_t hh = 0; hh < nv; ++hh) {
      const std::size_t i = sz(t * nv + hh);
      beta[i] = k::sigmoid(b[i]);
      g[i] = -std::exp(w.a_log[hh]) * k::softplus(a[i] + w.dt_bias[hh]);
    }
  }
  k::l2_normalize(q.data(), n * nk, kd, 1e-6f);
  k::l2_normalize(key.data(), n * nk, kd, 1e-6f);
  k::scale_inplace(q.data(), n * qk, 1.0f / std::sqrt(static_cast<float>(kd)));
  std::vector<float*> states(sz(n));
  const float* previous = nullptr;
  std::optional<RecurrentUpdate> update;
  {
    CacheTimer timer(cache_seconds);
    update.emplace(cache.begin_recurrent_update(n, layer));
    for (std::int64_t t = 0; t < n; ++t) states[sz(t)] = static_cast<float*>(update->next(t + 1).data);
    previous = static_cast<const float*>(update->previous().data);
  }
  k::gated_delta_rule(q.data(), key.data(), v.data(), g.data(), beta.data(), n, nv, nk, kd, vd, previous,
                      states.data(), o.data());
  {
    CacheTimer timer(cache_seconds);
    update->commit();
  }
  k::gated_rms_norm(o.data(), z.data(), w.out_norm, n * nv, vd, c.rms_norm_eps, o.data());
  k::matmul(o.data(), n, w.out, out);
}

void Model::short_conv_block(int layer, const LayerWeights& w, const float* h, std::int64_t n, Cache& cache,
                             float* out, double* cache_seconds) const {
  const ModelConfig& c = config();
  const std::int64_t d = c.hidden_size, K = c.conv_L_cache;
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  std::vector<float> bcx(sz(n * 3 * d)), bx(sz(n * d)), conv(sz(n * d));
  k::matmul(h, n, w.in_bcx, bcx.data());
  for (std::int64_t t = 0; t < n; ++t) {
    const float* row = bcx.data() + t * 3 * d;
    for (std::int64_t i = 0; i < d; ++i) bx[sz(t * d + i)] = row[i] * row[2 * d + i];
  }
  TensorView window;
  {
    CacheTimer timer(cache_seconds);
    window = cache.update_conv_state(channels_view(bx.data(), n, d), layer);
  }
  k::causal_conv1d(static_cast<const float*>(window.data), d, K, n, window.stride(1), window.stride(2), w.conv,
                   nullptr, /*fuse_silu=*/false, conv.data());
  for (std::int64_t t = 0; t < n; ++t) {
    const float* gate = bcx.data() + t * 3 * d + d;
    for (std::int64_t i = 0; i < d; ++i) conv[sz(t * d + i)] *= gate[i];
  }
  k::matmul(conv.data(), n, w.out, out);
}

void Model::forward(std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits,
                    bool all_logits, double* cache_seconds) const {
  const ModelConfig& c = config();
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n < 1) throw InvalidArgument("Model::forward needs at least one token");
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
      throw InvalidArgument("Model::forward: token " + std::to_string(tokens[t]) + " at index " + std::to_string(t) +
                            " is outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
    }
  }
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
  std::vector<float> x(sz(n * d)), h(sz(n * d)), mix(sz(n * d)), gate(sz(n * ff)), up(sz(n * ff));
  for (std::int64_t t = 0; t < n; ++t) {
    std::memcpy(x.data() + t * d, embed_ + tokens[sz(t)] * d, sz(d) * sizeof(float));
  }
  // One table of RoPE angles for the positions of this forward, shared by
  // every attention layer.
  std::vector<std::int64_t> positions(sz(n));
  for (std::int64_t t = 0; t < n; ++t) positions[sz(t)] = pos0 + t;
  const k::RopeTable rope(positions.data(), has_attention_ ? n : 0, c.rope_theta, c.head_dim);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& w = layers_[i];
    const int layer = static_cast<int>(i);
    k::rms_norm(x.data(), w.input_norm, n, d, c.rms_norm_eps, h.data());
    switch (w.kind) {
      case LayerWeights::Kind::Attention:
      case LayerWeights::Kind::Sliding: attention_block(layer, w, h.data(), n, pos0, rope, cache, mix.data(), cache_seconds); break;
      case LayerWeights::Kind::GatedDeltaNet: gated_deltanet_block(layer, w, h.data(), n, cache, mix.data(), cache_seconds);
        break;
      case LayerWeights::Kind::ShortConv: short_conv_block(layer, w, h.data(), n, cache, mix.data(), cache_seconds); break;
    }
    k::add_inplace(x.data(), mix.data(), n * d);
    k::rms_norm(x.data(), w.post_norm, n, d, c.rms_norm_eps, h.data());
    k::matmul(h.data(), n, w.gate, gate.data());
    k::matmul(h.data(), n, w.up, up.data());
    k::swiglu(gate.data(), up.data(), n * ff, gate.data());
    k::matmul(gate.data(), n, w.down, mix.data());
    k::add_inplace(x.data(), mix.data(), n * d);
  }
  const std::int64_t first = all_logits ? 0 : n - 1;
  const std::int64_t rows = n - first;
  k::rms_norm(x.data() + first * d, final_norm_, rows, d, c.rms_norm_eps, h.data());
  logits.resize(sz(rows * V));
  k::matmul(h.data(), rows, lm_head_, logits.data());
  CacheTimer timer(cache_seconds);
  transaction->commit();
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
  tokens.push_back(static_cast<std::int32_t>(config.bos_token_id));
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
