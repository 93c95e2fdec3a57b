#include "runtime/model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "cache_rows.h"
#include "rewind/error.h"
#include "rewind/prefix_cache.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

namespace k = kernels;
using detail::AttendedKeys;
using detail::BatchRows;
using detail::CacheRows;
using detail::CacheTimer;
using detail::ConvWindow;
using detail::RecurrentChain;
using detail::SequenceRows;
using detail::TreeRows;

namespace {

k::PackedMatrix::Element element_of(DType dtype) {
  if (dtype == DType::BF16) return k::PackedMatrix::Element::BF16;
  if (dtype == DType::F16) return k::PackedMatrix::Element::F16;
  return k::PackedMatrix::Element::F32;
}

// An [out, in] matrix of `dtype` (F32, BF16 or F16) packed for
// kernels::matmul in the same dtype, or quantized to Q8 (`what` names it
// in the error for a weight Q8 cannot hold).
k::PackedMatrix pack(const std::byte* w, DType dtype, std::int64_t out, std::int64_t in, WeightFormat format,
                     const std::string& what) {
  const auto* half = static_cast<const std::uint16_t*>(static_cast<const void*>(w));
  if (format == WeightFormat::kQ8) {
    // One pass: from_q8 finds a non-finite weight while it quantizes.
    std::int64_t bad = -1;
    k::PackedMatrix m = k::PackedMatrix::from_q8(w, element_of(dtype), out, in, &bad);
    if (bad >= 0) {
      throw FormatError("weights q8: " + what + " holds a non-finite value at [" + std::to_string(bad / in) + ", " +
                        std::to_string(bad % in) + "]; Q8 blocks hold finite weights only (load it as stored)");
    }
    return m;
  }
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

// A matmul weight [out, in] as the model got it: a float tensor (F32, BF16
// or F16), or a Q8 checkpoint's int8 values and scales.
struct MatrixSource {
  const std::byte* data = nullptr;  // float rows
  DType dtype = DType::F32;
  const Q8Weight* q8 = nullptr;  // or these
  std::int64_t out = 0, in = 0;
};

MatrixSource source_of(const ModelWeights& w, const std::string& name) {
  if (const Q8Weight* q = w.q8_weight(name)) return {nullptr, DType::F32, q, q->out, q->in};
  const Tensor& t = w.get(name);
  return {t.data<std::byte>(), t.view().dtype, nullptr, t.view().size(0), t.view().size(1)};
}

// Rows [first, first + count) of a matrix.
struct RowRange {
  std::int64_t first, count;
};

// The rows `ranges` of `m`, gathered in that order and packed in `format`
// (a Q8 source is packed as it is stored: its rows were quantized one by
// one, so gathering them equals quantizing the gathered float rows): how
// fused projections (per-head query and gate, Qwen3-Next's per-key-head
// qkvz / ba groups) are split into the unfused matrices the blocks
// multiply with.
k::PackedMatrix gathered(const MatrixSource& m, const std::vector<RowRange>& ranges, WeightFormat format,
                         const std::string& what) {
  std::int64_t rows = 0;
  for (const RowRange& r : ranges) rows += r.count;
  auto gather = [&](const std::byte* src, std::size_t row) {
    std::vector<std::byte> out(static_cast<std::size_t>(rows) * row);
    std::byte* dst = out.data();
    for (const RowRange& r : ranges) {
      std::memcpy(dst, src + static_cast<std::size_t>(r.first) * row, static_cast<std::size_t>(r.count) * row);
      dst += static_cast<std::size_t>(r.count) * row;
    }
    return out;
  };
  if (m.q8 != nullptr) {
    const auto blocks = static_cast<std::size_t>((m.in + k::PackedMatrix::kQ8Block - 1) / k::PackedMatrix::kQ8Block);
    const std::vector<std::byte> q = gather(static_cast<const std::byte*>(static_cast<const void*>(m.q8->q)),
                                            static_cast<std::size_t>(m.in));
    const std::vector<std::byte> scales = gather(m.q8->scales, blocks * 2);
    return k::PackedMatrix::from_q8_blocks(static_cast<const std::int8_t*>(static_cast<const void*>(q.data())),
                                           scales.data(), rows, m.in);
  }
  const std::vector<std::byte> data = gather(m.data, static_cast<std::size_t>(m.in) * dtype_size(m.dtype));
  return pack(data.data(), m.dtype, rows, m.in, format, what);
}

// The linear weight `name` ([out, in]) packed for kernels::matmul.
k::PackedMatrix packed(const ModelWeights& w, const std::string& name, WeightFormat format) {
  const MatrixSource m = source_of(w, name);
  if (m.q8 != nullptr) return k::PackedMatrix::from_q8_blocks(m.q8->q, m.q8->scales, m.out, m.in);
  return pack(m.data, m.dtype, m.out, m.in, format, "tensor '" + name + "'");
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

// The kernels read the cache's rows in place: every layer's state must be in
// host memory. Throws InvalidArgument naming the first layer that is not.
void check_host_state(const LayerOptions& o, int layer, const char* where) {
  if (o.storage && !o.storage->device().is_host()) {
    throw InvalidArgument(std::string(where) + ": layer " + std::to_string(layer) + "'s state is on " +
                          o.storage->device().describe() +
                          "; the CPU runtime reads the cache in place and needs host storage "
                          "(LayerOptions::storage = rwd::host_storage())");
  }
}

// "rewind-hybrid-" + 16 hex digits hashing config.json's fields and every
// tensor's name, shape and bytes (Model::fingerprint).
std::string fingerprint_of(const ModelWeights& weights, WeightFormat format) {
  const std::string config_text = to_json(weights.config());
  std::uint64_t h = content_hash(std::as_bytes(std::span(config_text)));
  if (format != WeightFormat::kAsStored) {
    const std::string tag = std::string("weights:") + weight_format_name(format);
    h = content_hash(std::as_bytes(std::span(tag)), h);
  }
  for (const auto& name : weights.names()) {
    const Tensor& t = weights.get(name);
    const std::string head = name + ":" + t.view().describe();
    h = content_hash(std::as_bytes(std::span(head)), h);
    h = content_hash(std::span(static_cast<const std::byte*>(t.view().data), t.bytes()), h);
  }
  for (const auto& name : weights.q8_names()) {
    const Q8Weight& q = *weights.q8_weight(name);
    const std::string head = name + ":q8[" + std::to_string(q.out) + ", " + std::to_string(q.in) + "]";
    h = content_hash(std::as_bytes(std::span(head)), h);
    h = content_hash(std::span(q.q_entry->data, q.q_entry->nbytes), h);
    h = content_hash(std::span(q.scale_entry->data, q.scale_entry->nbytes), h);
  }
  static constexpr char digits[] = "0123456789abcdef";
  std::string hex(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) hex[static_cast<std::size_t>(i)] = digits[h & 15];
  return "rewind-hybrid-" + hex;
}

// glibc raises its mmap threshold as large blocks are freed, so released
// weights end up as free heap pages it keeps; handing them back after each
// release keeps freed and packed copies from adding up while loading.
void return_freed_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace

// Packs the weights layer by layer for Model::Model: small tensors as f32,
// linear weights for kernels::matmul, each original released as soon as
// it is packed, so loading holds at most one layer's matrices twice.
class Model::Packer {
 public:
  Packer(Model& model, const PackFile* pack, std::vector<PackedMatrixRecord>* record)
      : m_(model), c_(model.weights_.config()), pack_(pack), record_(record) {
    for (WeightSpec& s : expected_weights(c_)) {
      if (s.matmul) shapes_.emplace(std::move(s.name), std::move(s.shape));
    }
  }

  std::string name(std::int64_t layer, WeightRole role) const { return weight_name(c_, layer, role); }
  // A small tensor (norm, conv, gate parameters) as f32 for the kernels: an
  // F32 tensor is used in place; a BF16 or F16 one is widened into folded_,
  // and so is a (1 + w) norm weight, with the 1 folded in once (1 + w in f32
  // is the rounding transformers does per forward, so the product is the
  // same).
  const float* small(const std::string& n, bool plus_one) {
    const Tensor& t = m_.weights_.get(n);
    if (t.view().dtype == DType::F32 && !plus_one) return t.data<float>();
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] = element_as_f32(t, i);
      if (plus_one) v[i] = 1.0f + v[i];
    }
    return m_.folded_.emplace_back(std::move(v)).data();
  }
  const float* norm(const std::string& n) { return small(n, c_.norm_plus_one); }
  const float* get(std::int64_t layer, WeightRole role) { return small(name(layer, role), false); }
  // Layer `layer`'s conv weight ([channels, 1, K]) tap-major as f32 for
  // kernels::causal_conv1d_taps, taps[i * channels + c] = weight[c, i]:
  // transposed once here rather than per decoding step. The original is
  // released, so the weights are held once.
  const float* conv_taps(std::int64_t layer, WeightRole role, std::int64_t kernel_size) {
    const std::string n = name(layer, role);
    const Tensor& t = m_.weights_.get(n);
    const std::size_t k = static_cast<std::size_t>(kernel_size), channels = static_cast<std::size_t>(t.numel()) / k;
    std::vector<float> taps(channels * k);
    for (std::size_t c = 0; c < channels; ++c) {
      for (std::size_t i = 0; i < k; ++i) taps[i * channels + c] = element_as_f32(t, c * k + i);
    }
    m_.weights_.release(n);
    return m_.folded_.emplace_back(std::move(taps)).data();
  }
  // The matrix the model holds under `key` (out x in): the pack's next one
  // when the model is mapped from a pack, else what `produce` packs (then
  // recorded for a pack being written). One order for both: a pack holds
  // the matrices in the order they are made here.
  template <class Produce>
  k::PackedMatrix matrix(const std::string& key, std::int64_t out, std::int64_t in, Produce&& produce) {
    if (pack_ != nullptr) return pack_->take(next_++, key, out, in);
    k::PackedMatrix m = produce();
    assert(m.out() == out && m.in() == in);
    if (record_ != nullptr) record_->push_back({key, m.element(), m.out(), m.in(), m.storage()});
    return m;
  }
  // The [out, in] shape of matmul weight `n`, as config.json implies it.
  const std::vector<std::int64_t>& shape(const std::string& n) const { return shapes_.at(n); }
  // The matmul weight `n` packed; the original is released.
  k::PackedMatrix whole(const std::string& n) {
    k::PackedMatrix m = matrix(n, shape(n)[0], shape(n)[1], [&] { return packed(m_.weights_, n, m_.weight_format_); });
    if (!m_.weights_.matmul_omitted()) m_.weights_.release(n);
    return m;
  }
  // The linear weight of `role` packed; the original is released.
  k::PackedMatrix linear(std::int64_t layer, WeightRole role) { return whole(name(layer, role)); }
  // Layer i's weights; the originals are released when it returns.
  LayerWeights layer(std::int64_t i);

 private:
  void attention(std::int64_t i, LayerWeights& w);
  void gated_deltanet(std::int64_t i, LayerWeights& w);
  // A fused tensor split into row groups, released once its layer is
  // packed (its source is not read when the matrices come from a pack).
  MatrixSource fused(std::int64_t layer, WeightRole role) {
    fused_.push_back(name(layer, role));
    if (m_.weights_.matmul_omitted()) return {nullptr, DType::F32, nullptr, 0, shape(fused_.back())[1]};
    return source_of(m_.weights_, fused_.back());
  }
  // Rows `ranges` of fused tensor `t` (named `n`) as the matrix "n#part".
  k::PackedMatrix part(const MatrixSource& t, const std::string& n, const char* part,
                       const std::vector<RowRange>& ranges) {
    std::int64_t rows = 0;
    for (const RowRange& r : ranges) rows += r.count;
    return matrix(n + "#" + part, rows, t.in,
                  [&] { return rwd::runtime::gathered(t, ranges, m_.weight_format_, "tensor '" + n + "'"); });
  }
  // part() of rows [first + g * stride, ... + count) for g in [0, groups).
  k::PackedMatrix part(const MatrixSource& t, const std::string& n, const char* name, std::int64_t groups,
                       std::int64_t stride, std::int64_t first, std::int64_t count) {
    std::vector<RowRange> ranges;
    for (std::int64_t g = 0; g < groups; ++g) ranges.push_back({g * stride + first, count});
    return part(t, n, name, ranges);
  }

  Model& m_;
  const ModelConfig& c_;
  const PackFile* pack_;
  std::vector<PackedMatrixRecord>* record_;
  std::size_t next_ = 0;  // the pack's next matrix
  std::map<std::string, std::vector<std::int64_t>, std::less<>> shapes_;
  std::vector<std::string> fused_;
};

void Model::Packer::attention(std::int64_t i, LayerWeights& w) {
  if (c_.attn_output_gate) {
    // q_proj: per head, head_dim query rows then head_dim gate rows.
    const MatrixSource q = fused(i, WeightRole::AttnQ);
    const std::string n = fused_.back();
    w.wq = part(q, n, "q", c_.num_attention_heads, 2 * c_.head_dim, 0, c_.head_dim);
    w.wgate = part(q, n, "gate", c_.num_attention_heads, 2 * c_.head_dim, c_.head_dim, c_.head_dim);
  } else {
    w.wq = linear(i, WeightRole::AttnQ);
  }
  w.wk = linear(i, WeightRole::AttnK);
  w.wv = linear(i, WeightRole::AttnV);
  w.wo = linear(i, WeightRole::AttnO);
  if (c_.qk_norm) {
    w.q_norm = norm(name(i, WeightRole::AttnQNorm));
    w.k_norm = norm(name(i, WeightRole::AttnKNorm));
  }
}

void Model::Packer::gated_deltanet(std::int64_t i, LayerWeights& w) {
  if (c_.fused_gdn_projections) {
    // Qwen3-Next groups the rows per key head g: [q (kd), k (kd), v (r vd),
    // z (r vd)] and [b (r), a (r)] with r = lnv / lnk value heads per key
    // head; the unfused layout is all q, all k, all v (value heads in
    // order g * r + j), and z, b, a in value-head order.
    const std::int64_t nk = c_.linear_num_key_heads, kd = c_.linear_key_head_dim;
    const std::int64_t r = c_.linear_num_value_heads / nk, rv = r * c_.linear_value_head_dim;
    const std::int64_t group = 2 * kd + 2 * rv;
    const MatrixSource qkvz = fused(i, WeightRole::GdnQkvz);
    const std::string qkvz_name = name(i, WeightRole::GdnQkvz);
    const MatrixSource ba = fused(i, WeightRole::GdnBa);
    const std::string ba_name = name(i, WeightRole::GdnBa);
    std::vector<RowRange> qkv;
    for (std::int64_t first : {std::int64_t{0}, kd, 2 * kd}) {  // q, k, v blocks of each group
      const std::int64_t count = first == 2 * kd ? rv : kd;
      for (std::int64_t g = 0; g < nk; ++g) qkv.push_back({g * group + first, count});
    }
    w.in_qkv = part(qkvz, qkvz_name, "qkv", qkv);
    w.in_z = part(qkvz, qkvz_name, "z", nk, group, 2 * kd + rv, rv);
    w.in_b = part(ba, ba_name, "b", nk, 2 * r, 0, r);
    w.in_a = part(ba, ba_name, "a", nk, 2 * r, r, r);
  } else {
    w.in_qkv = linear(i, WeightRole::GdnQkv);
    w.in_z = linear(i, WeightRole::GdnZ);
    w.in_b = linear(i, WeightRole::GdnB);
    w.in_a = linear(i, WeightRole::GdnA);
  }
  w.conv = conv_taps(i, WeightRole::GdnConv, c_.linear_conv_kernel_dim);
  w.dt_bias = get(i, WeightRole::GdnDtBias);
  w.a_log = get(i, WeightRole::GdnALog);
  w.out_norm = get(i, WeightRole::GdnNorm);  // a plain-weight norm in every family
  w.out = linear(i, WeightRole::GdnOut);
}

Model::LayerWeights Model::Packer::layer(std::int64_t i) {
  const LayerKind kind = c_.layer_types[static_cast<std::size_t>(i)];
  LayerWeights w;
  w.input_norm = norm(name(i, WeightRole::InputNorm));
  w.post_norm = norm(name(i, WeightRole::PostNorm));
  w.gate = linear(i, WeightRole::MlpGate);
  w.up = linear(i, WeightRole::MlpUp);
  w.down = linear(i, WeightRole::MlpDown);
  switch (runtime_layer_kind(kind, i)) {
    case RuntimeLayerKind::FullAttention:
    case RuntimeLayerKind::SlidingAttention:
      w.kind = kind == LayerKind::FullAttention ? LayerWeights::Kind::Attention : LayerWeights::Kind::Sliding;
      attention(i, w);
      break;
    case RuntimeLayerKind::LinearAttention:
      w.kind = LayerWeights::Kind::GatedDeltaNet;
      gated_deltanet(i, w);
      break;
    case RuntimeLayerKind::Conv:
      w.kind = LayerWeights::Kind::ShortConv;
      w.in_bcx = linear(i, WeightRole::ConvIn);
      w.conv = conv_taps(i, WeightRole::ConvConv, c_.conv_L_cache);
      w.out = linear(i, WeightRole::ConvOut);
      break;
  }
  if (!m_.weights_.matmul_omitted()) {
    for (const auto& n : fused_) m_.weights_.release(n);
  }
  fused_.clear();
  return_freed_memory();
  return w;
}

const char* weight_format_name(WeightFormat format) { return format == WeightFormat::kQ8 ? "q8" : "as-stored"; }

WeightFormat weight_format_from_name(std::string_view name, std::string_view what) {
  for (const WeightFormat f : {WeightFormat::kAsStored, WeightFormat::kQ8}) {
    if (name == weight_format_name(f)) return f;
  }
  throw InvalidArgument(std::string(what) + " '" + std::string(name) + "': the formats are as-stored and q8");
}

namespace {

// The format a model of `weights` holds its matmul weights in.
WeightFormat resolved_format(const ModelWeights& weights, const LoadOptions& options) {
  if (!weights.q8()) return options.weights.value_or(WeightFormat::kAsStored);
  if (options.weights == WeightFormat::kAsStored) {
    throw InvalidArgument(
        "weights as-stored: this checkpoint's weights are already quantized (a Q8 checkpoint, written by rewind "
        "quantize), and Q8 weights are never dequantized; allowed: no weights option (they load as q8) or q8");
  }
  return WeightFormat::kQ8;
}

}  // namespace

Model::Model(ModelWeights weights, LoadOptions options) : Model(std::move(weights), options, nullptr, nullptr) {}

Model::Model(ModelWeights weights, LoadOptions options, const PackFile* pack, std::vector<PackedMatrixRecord>* record)
    : weights_(std::move(weights)), weight_format_(resolved_format(weights_, options)) {
  const ModelConfig& c = weights_.config();
  // rope_inv_freq(c) is theta^(-2j / d), scaled where the config says so
  // (Llama 3), so one cache serves either.
  rope_cache_ = std::make_unique<kernels::RopeCache>(rope_inv_freq(c));
  if (pack != nullptr) {
    // The pack recorded what the model it was made from computed, so the
    // matrices' bytes are neither counted nor hashed again.
    assert(weights_.matmul_omitted() && pack->info().weights == weight_format_name(weight_format_));
    parameter_count_ = pack->info().parameter_count;
    fingerprint_ = pack->info().fingerprint;
  } else {
    for (const auto& name : weights_.names()) parameter_count_ += weights_.get(name).numel();
    for (const auto& name : weights_.q8_names())
      parameter_count_ += weights_.q8_weight(name)->out * weights_.q8_weight(name)->in;
    fingerprint_ = fingerprint_of(weights_, weight_format_);  // before packing releases the originals
  }
  Packer packer(*this, pack, record);
  const std::string embed_name = packer.name(0, WeightRole::Embed);
  final_norm_ = packer.norm(packer.name(0, WeightRole::FinalNorm));
  // A tied embedding is looked up in the packed output matrix (the same
  // values), so the model holds it once.
  lm_head_ = packer.whole(c.tie_word_embeddings ? embed_name : packer.name(0, WeightRole::LmHead));
  embed_ = c.tie_word_embeddings ? nullptr : &weights_.get(embed_name);
  return_freed_memory();
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.layer_types[static_cast<std::size_t>(i)] == LayerKind::FullAttention ||
        c.layer_types[static_cast<std::size_t>(i)] == LayerKind::SlidingAttention) {
      has_attention_ = true;
    }
    layers_.push_back(packer.layer(i));
  }
}

std::size_t Model::weight_bytes() const {
  std::size_t total = weights_.bytes() + lm_head_.bytes();
  for (const auto& v : folded_) total += v.size() * sizeof(float);
  for (const LayerWeights& w : layers_) {
    for (const k::PackedMatrix* m : {&w.gate, &w.up, &w.down, &w.wq, &w.wk, &w.wv, &w.wo, &w.wgate, &w.in_qkv, &w.in_z,
                                     &w.in_b, &w.in_a, &w.out, &w.in_bcx}) {
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

namespace {

// The pack of `dir` that Model::load may map for `options`, opened and
// checked against the directory's files; null when there is none or it is
// not current (then *note says why).
std::optional<PackFile> current_pack(const std::string& dir, const LoadOptions& options, std::string* note) {
  if (options.pack == LoadOptions::Pack::kNever) return std::nullopt;
  // Without a weights option a float checkpoint loads as stored and a Q8
  // checkpoint as q8; the pack records which kind it came from.
  std::vector<std::string> formats;
  if (options.weights) {
    formats.emplace_back(weight_format_name(*options.weights));
  } else {
    formats = {weight_format_name(WeightFormat::kAsStored), weight_format_name(WeightFormat::kQ8)};
  }
  for (const std::string& format : formats) {
    const std::string path = (std::filesystem::path(dir) / pack_file_name(format)).string();
    if (!std::filesystem::exists(path)) continue;
    std::string why;
    try {
      PackFile pack = PackFile::open(path);
      why = pack_mismatch(pack, dir, format);
      if (why.empty() && !options.weights && format == weight_format_name(WeightFormat::kQ8) &&
          !pack.info().from_q8_checkpoint) {
        why = "it holds weights quantized at load, which only --weights q8 asks for";
      }
      if (why.empty()) return pack;
    } catch (const Error& e) {  // malformed, unreadable, or its directory unlistable: load without it
      why = e.what();
    }
    *note = path + " not used: " + why + " (rewind pack rewrites it)";
    // An as-stored pack is never a Q8 checkpoint's: a q8 pack beside it
    // was asked for with --weights q8 and is not this load's.
    break;
  }
  return std::nullopt;
}

}  // namespace

Model Model::load(const std::string& dir, LoadOptions options) {
  std::string note;
  const std::optional<PackFile> pack = current_pack(dir, options, &note);
  if (!pack) {
    Model m(ModelWeights::load(dir), options);
    m.pack_note_ = note;
    return m;
  }
  Model m(ModelWeights::load(dir, ModelWeights::Matmul::kCheckOnly), options, &*pack, nullptr);
  m.pack_path_ = pack->path();
  return m;
}

PackResult write_pack_file(const std::string& dir, LoadOptions options) {
  // Taken before the files are read: one that changes while it is packed
  // no longer matches, and the pack is not used.
  PackInfo info;
  info.sources = pack_sources(dir);
  ModelWeights weights = ModelWeights::load(dir);
  info.from_q8_checkpoint = weights.q8();
  std::vector<PackedMatrixRecord> records;
  options.pack = LoadOptions::Pack::kNever;
  const Model m(std::move(weights), options, nullptr, &records);
  info.weights = weight_format_name(m.weight_format());
  info.fingerprint = m.fingerprint();
  info.parameter_count = m.parameter_count();
  PackResult result;
  result.path = (std::filesystem::path(dir) / pack_file_name(info.weights)).string();
  result.weights = info.weights;
  result.matrices = static_cast<std::int64_t>(records.size());
  result.file_bytes = write_pack(result.path, records, info);
  return result;
}

Cache Model::make_cache() const {
  const ModelConfig& c = config();
  std::vector<Layer> layers;
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerKind kind = c.layer_types[static_cast<std::size_t>(i)];
    LayerOptions o;
    o.dtype = DType::F32;
    o.batch_size = 1;
    o.storage = rwd::host_storage();  // the kernels read the rows in place
    switch (runtime_layer_kind(kind, i)) {
      case RuntimeLayerKind::FullAttention:
      case RuntimeLayerKind::SlidingAttention:
        o.num_kv_heads = c.num_key_value_heads;
        o.key_dim = c.head_dim;
        o.sliding_window = c.sliding_window;
        break;
      case RuntimeLayerKind::LinearAttention:
        o.conv_kernel_size = c.linear_conv_kernel_dim;
        o.conv_channels = {c.linear_conv_dim()};
        o.recurrent_shapes = {{c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}};
        break;
      case RuntimeLayerKind::Conv:
        o.conv_kernel_size = c.conv_L_cache;
        o.conv_channels = {c.hidden_size};
        break;
    }
    layers.emplace_back(kind, o, static_cast<int>(i));
  }
  return Cache(std::move(layers));
}

SequenceCache Model::make_sequence_cache(SequenceCacheOptions options) const {
  const Cache one = make_cache();  // the layers' kinds and options, once
  std::vector<SequenceLayer> layers;
  for (int i = 0; i < one.num_layers(); ++i) layers.push_back({one.layer(i).kind(), one.layer(i).options()});
  return SequenceCache(std::move(layers), options);
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
  for (ScratchRows* r : {&x,
                         &h,
                         &mix,
                         &gate,
                         &up,
                         &attention.q,
                         &attention.key,
                         &attention.val,
                         &attention.att,
                         &attention.gate,
                         &deltanet.qkv,
                         &deltanet.z,
                         &deltanet.b,
                         &deltanet.a,
                         &deltanet.mixed,
                         &deltanet.q,
                         &deltanet.key,
                         &deltanet.v,
                         &deltanet.g,
                         &deltanet.beta,
                         &deltanet.o,
                         &conv.bcx,
                         &conv.bx,
                         &conv.conv}) {
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

// ---- the math of each block that does not touch the cache ---------------------------

kernels::RopeTable Model::rope_table(const std::int64_t* positions, std::int64_t rows) const {
  return kernels::RopeTable(positions, rows, *rope_cache_);
}

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

// ---- the blocks, once for every front-end ------------------------------------------------

void Model::attention_block(const BlockArgs& a, CacheRows& cache) const {
  const ModelConfig& c = config();
  const std::int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  AttentionRows& r = a.scratch->attention;
  attention_in(*a.w, a.h, a.n, *a.rope, r);
  cache.store_keys(a.layer, r.key.data(), r.val.data(), nkv, hd);
  k::AttentionMask m;
  if (a.w->kind == LayerWeights::Kind::Sliding) m.window = c.sliding_window;
  const std::span<const CacheRows::Group> groups = cache.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const CacheRows::Group& group = groups[g];
    const std::int64_t pos0 = cache.positions()[static_cast<std::size_t>(group.row)];
    const AttendedKeys kv = cache.attended(g);
    k::attention_paged(r.q.data() + group.row * nh * hd, group.count, pos0, nh, nkv, hd, kv.runs, kv.k_strides,
                       kv.v_strides, kv.kv_offset, kv.kv_len, m, r.att.data() + group.row * nh * hd);
  }
  attention_out(*a.w, a.n, r, a.out);
}

void Model::conv_rows(const LayerWeights& w, int layer, float* x, std::int64_t channels, std::int64_t kernel_size,
                      bool fuse_silu, CacheRows& cache, float* out) const {
  const std::span<const ConvWindow> windows = cache.conv(layer, x, channels);
  const std::span<const CacheRows::Group> groups = cache.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    k::causal_conv1d_taps(windows[g].data, channels, kernel_size, groups[g].count, windows[g].channel_stride,
                          windows[g].time_stride, w.conv, nullptr, fuse_silu, out + groups[g].row * channels);
  }
}

void Model::gated_deltanet_block(const BlockArgs& a, CacheRows& cache) const {
  const ModelConfig& c = config();
  const std::int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const std::int64_t kd = c.linear_key_head_dim, vd = c.linear_value_head_dim;
  const std::int64_t qk = nk * kd, vv = nv * vd;
  DeltaNetRows& r = a.scratch->deltanet;
  deltanet_in(*a.w, a.h, a.n, r);
  conv_rows(*a.w, a.layer, r.qkv.data(), c.linear_conv_dim(), c.linear_conv_kernel_dim, /*fuse_silu=*/true, cache,
            r.mixed.data());
  deltanet_mid(*a.w, a.n, r);
  const std::span<const RecurrentChain> chains = cache.begin_recurrent(a.layer);
  const std::span<const CacheRows::Group> groups = cache.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::int64_t o = groups[g].row;
    k::gated_delta_rule(r.q.data() + o * qk, r.key.data() + o * qk, r.v.data() + o * vv, r.g.data() + o * nv,
                        r.beta.data() + o * nv, groups[g].count, nv, nk, kd, vd, chains[g].previous, chains[g].next,
                        r.o.data() + o * vv);
  }
  cache.end_recurrent();
  deltanet_out(*a.w, a.n, r, a.out);
}

void Model::short_conv_block(const BlockArgs& a, CacheRows& cache) const {
  const ModelConfig& c = config();
  ShortConvRows& r = a.scratch->conv;
  short_conv_in(*a.w, a.h, a.n, r);
  conv_rows(*a.w, a.layer, r.bx.data(), c.hidden_size, c.conv_L_cache, /*fuse_silu=*/false, cache, r.conv.data());
  short_conv_out(*a.w, a.n, r, a.out);
}

void Model::run_layers(std::span<const std::int32_t> tokens, CacheRows& cache, Scratch& scratch) const {
  const ModelConfig& c = config();
  const auto n = static_cast<std::int64_t>(tokens.size());
  const std::int64_t d = c.hidden_size;
  scratch.resize_stream(static_cast<std::size_t>(n), static_cast<std::size_t>(d),
                        static_cast<std::size_t>(c.intermediate_size));
  ScratchRows &x = scratch.x, &h = scratch.h, &mix = scratch.mix;
  for (std::int64_t t = 0; t < n; ++t) embed_row(tokens[static_cast<std::size_t>(t)], x.data() + t * d);
  // One table of RoPE angles for the rows' positions, shared by every
  // attention layer.
  const k::RopeTable rope = rope_table(cache.positions().data(), has_attention_ ? n : 0);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& w = layers_[i];
    k::rms_norm(x.data(), w.input_norm, n, d, c.rms_norm_eps, h.data());
    const BlockArgs a{static_cast<int>(i), &w, h.data(), n, &rope, mix.data(), &scratch};
    switch (w.kind) {
      case LayerWeights::Kind::Attention:
      case LayerWeights::Kind::Sliding: attention_block(a, cache); break;
      case LayerWeights::Kind::GatedDeltaNet: gated_deltanet_block(a, cache); break;
      case LayerWeights::Kind::ShortConv: short_conv_block(a, cache); break;
    }
    mlp(w, n, x, h, mix, scratch.gate, scratch.up);
  }
}

// ---- the three forwards ------------------------------------------------------------------

void Model::forward(std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits, bool all_logits,
                    double* cache_seconds) const {
  const ModelConfig& c = config();
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n < 1) throw InvalidArgument("Model::forward needs at least one token");
  check_tokens(tokens, c, "Model::forward");
  const std::int64_t d = c.hidden_size, V = c.vocab_size;
  for (int i = 0; i < cache.num_layers(); ++i) check_host_state(cache.layer(i).options(), i, "Model::forward");
  const std::int64_t pos0 = cache.get_seq_length();
  // All or nothing: room and budget for n tokens in every layer are reserved
  // before any layer changes, and an exception anywhere below (a kernel, an
  // allocation) abandons the forward, restoring every layer exactly.
  std::optional<Forward> transaction;
  {
    CacheTimer timer(cache_seconds);
    transaction.emplace(cache.begin_forward(n));
  }
  SequenceRows rows(cache, pos0, n, cache_seconds);
  ScratchLease lease;
  Scratch& scratch = lease.get();
  run_layers(tokens, rows, scratch);
  const std::int64_t first = all_logits ? 0 : n - 1;
  const std::int64_t count = n - first;
  k::rms_norm(scratch.x.data() + first * d, final_norm_, count, d, c.rms_norm_eps, scratch.h.data());
  logits.resize(static_cast<std::size_t>(count * V));
  k::matmul(scratch.h.data(), count, lm_head_, logits.data());
  CacheTimer timer(cache_seconds);
  transaction->commit();
}

void Model::forward_batch(std::span<const SequenceTokens> batch, SequenceCache& cache,
                          std::vector<float>& logits) const {
  const ModelConfig& c = config();
  if (batch.empty()) throw InvalidArgument("Model::forward_batch needs at least one sequence");
  for (int i = 0; i < cache.num_layers(); ++i) check_host_state(cache.layer_options(i), i, "Model::forward_batch");
  std::vector<BatchEntry> entries;
  std::vector<std::int64_t> pos0, offset;
  std::vector<std::int32_t> tokens;  // every entry's, in entry order
  for (const SequenceTokens& s : batch) {
    check_tokens(s.tokens, c, "Model::forward_batch");
    if (s.logits != LogitRows::kAll && s.logits != LogitRows::kLast && s.logits != LogitRows::kNone) {
      throw InvalidArgument("Model::forward_batch: entry " + std::to_string(entries.size()) + " asks for logit rows " +
                            std::to_string(static_cast<int>(s.logits)) + "; allowed: kAll, kLast, kNone");
    }
    entries.push_back({s.seq, static_cast<std::int64_t>(s.tokens.size())});
    pos0.push_back(cache.seq_length(s.seq));
    offset.push_back(static_cast<std::int64_t>(tokens.size()));
    tokens.insert(tokens.end(), s.tokens.begin(), s.tokens.end());
  }
  const std::int64_t d = c.hidden_size, V = c.vocab_size, T = static_cast<std::int64_t>(tokens.size());
  auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  // All or nothing across the batch (an exception abandons it).
  SequenceBatch transaction = cache.begin_batch(entries);
  BatchRows rows(cache, batch, pos0, offset);
  ScratchLease lease;
  Scratch& scratch = lease.get();
  run_layers(tokens, rows, scratch);
  ScratchRows& h = scratch.h;
  k::rms_norm(scratch.x.data(), final_norm_, T, d, c.rms_norm_eps, h.data());
  // The rows whose logits are asked for, gathered (each row's product does
  // not depend on the others: the same bits as over all T rows).
  std::int64_t R = 0;
  bool every_row = true;
  for (std::size_t e = 0; e < batch.size(); ++e) {
    const auto n = static_cast<std::int64_t>(batch[e].tokens.size());
    const std::int64_t wanted = batch[e].logits == LogitRows::kAll    ? n
                                : batch[e].logits == LogitRows::kLast ? std::min<std::int64_t>(n, 1)
                                                                      : 0;
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

void Model::forward_tree(std::span<const std::int32_t> tokens, TreeForward& tree, Cache& cache,
                         std::vector<float>& logits, double* cache_seconds) const {
  const ModelConfig& c = config();
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (!tree.is_open_on(cache)) {
    throw StateError("Model::forward_tree needs a tree opened on this cache (Cache::begin_tree)");
  }
  if (n != tree.num_nodes()) {
    throw InvalidArgument("Model::forward_tree got " + std::to_string(n) + " tokens for a tree of " +
                          std::to_string(tree.num_nodes()) + " nodes");
  }
  check_tokens(tokens, c, "Model::forward_tree");
  for (int i = 0; i < cache.num_layers(); ++i) check_host_state(cache.layer(i).options(), i, "Model::forward_tree");
  const std::int64_t d = c.hidden_size, V = c.vocab_size;
  TreeRows rows(tree, cache_seconds);
  ScratchLease lease;
  Scratch& scratch = lease.get();
  run_layers(tokens, rows, scratch);
  k::rms_norm(scratch.x.data(), final_norm_, n, d, c.rms_norm_eps, scratch.h.data());
  logits.resize(static_cast<std::size_t>(n * V));
  k::matmul(scratch.h.data(), n, lm_head_, logits.data());
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
