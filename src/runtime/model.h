// runtime/model.h: the reference hybrid decoder.
//
// A pre-norm decoder (RMSNorm, SwiGLU MLP, byte-level vocabulary) whose
// layers follow config.layer_types: full_attention and sliding_attention
// (GQA with RoPE), linear_attention (Gated DeltaNet as in Qwen3-Next) and
// conv (LFM2-style gated short convolution). All inference state lives in a
// rwd::Cache built by make_cache(); the model touches it only through the
// public cache API, like any other user.
//
// forward() is batch invariant: the logits of a token are bit-identical
// whether it is processed alone or inside a multi-token forward, because
// every kernel keeps one reduction order per row (runtime/kernels.h). That
// is what makes speculative decoding provably lossless here.
//
// Thread safety: a Model is immutable after construction and may be shared
// by threads, each with its own Cache. forward() uses OpenMP inside.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rewind/cache.h"
#include "runtime/model_config.h"
#include "runtime/weights_io.h"

namespace rwd::runtime {

class Model {
 public:
  // Takes validated weights (ModelWeights::load / random check them).
  explicit Model(ModelWeights weights);
  // Loads DIR/config.json + DIR/model.safetensors. Throws FormatError /
  // rwd::Error as ModelWeights::load does.
  static Model load(const std::string& dir);

  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return weights_.config(); }
  std::int64_t vocab_size() const { return config().vocab_size; }
  std::int64_t parameter_count() const;

  // An empty cache for one sequence (batch 1) with one layer per model layer.
  Cache make_cache() const;

  // Runs `tokens` (n >= 1, each in [0, vocab)) at positions
  // [L, L + n) where L = cache.get_seq_length(), appending them to the cache.
  // Writes logits to `logits`: [n, vocab] when all_logits, else only the
  // last row [vocab]. Throws InvalidArgument for an empty span or a token
  // outside the vocabulary (nothing appended then).
  // When `cache_seconds` is given, the time spent inside cache calls
  // (update, update_conv_state, recurrent slots, mask sizes) is added to it.
  void forward(std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits,
               bool all_logits = true, double* cache_seconds = nullptr) const;

  // Bytes of cache memory one more token costs in attention layers
  // (keys + values, f32), and the fixed state of the linear layers.
  std::size_t kv_bytes_per_token() const;
  std::size_t fixed_state_bytes() const;
  // Extra bytes that activate_past_recording(R) costs at most.
  std::size_t rollback_bytes(std::int64_t R) const;

 private:
  // Pointers into weights_ (f32, nn.Linear layout [out, in]); unused ones null.
  struct LayerWeights {
    enum class Kind { Attention, Sliding, GatedDeltaNet, ShortConv } kind = Kind::Attention;
    const float* input_norm = nullptr;  // [d]
    const float* post_norm = nullptr;   // [d]
    const float* gate = nullptr;        // [ff, d]
    const float* up = nullptr;          // [ff, d]
    const float* down = nullptr;        // [d, ff]
    // attention
    const float* wq = nullptr;  // [nh*hd, d]
    const float* wk = nullptr;  // [nkv*hd, d]
    const float* wv = nullptr;  // [nkv*hd, d]
    const float* wo = nullptr;  // [d, nh*hd]
    // Gated DeltaNet
    const float* in_qkv = nullptr;  // [conv_dim, d]
    const float* in_z = nullptr;    // [lnv*lvd, d]
    const float* in_b = nullptr;    // [lnv, d]
    const float* in_a = nullptr;    // [lnv, d]
    const float* conv = nullptr;    // [channels, K] (conv_dim for GDN, d for short conv)
    const float* dt_bias = nullptr;  // [lnv]
    const float* a_log = nullptr;    // [lnv]
    const float* out_norm = nullptr;  // [lvd]
    const float* out = nullptr;       // [d, lnv*lvd] or [d, d]
    // short conv
    const float* in_bcx = nullptr;  // [3d, d]
  };
  void attention_block(int layer, const LayerWeights& w, const float* h, std::int64_t n,
                       std::int64_t pos0, Cache& cache, float* out, double* cache_seconds) const;
  void gated_deltanet_block(int layer, const LayerWeights& w, const float* h, std::int64_t n,
                            Cache& cache, float* out, double* cache_seconds) const;
  void short_conv_block(int layer, const LayerWeights& w, const float* h, std::int64_t n,
                        Cache& cache, float* out, double* cache_seconds) const;

  ModelWeights weights_;
  std::vector<LayerWeights> layers_;
  const float* embed_ = nullptr;     // [vocab, d]
  const float* final_norm_ = nullptr;  // [d]
  const float* lm_head_ = nullptr;   // [vocab, d] (the embedding when tied)
};

// Byte-level tokenizer: a text becomes BOS followed by its bytes.
std::vector<std::int32_t> encode_prompt(const std::string& text, const ModelConfig& config);
// Bytes of the tokens that are bytes (< 256); special tokens are skipped.
std::string decode_tokens(std::span<const std::int32_t> tokens);

}  // namespace rwd::runtime
