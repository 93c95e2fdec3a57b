// runtime/model.h: the reference hybrid decoder.
//
// A pre-norm decoder (RMSNorm, SwiGLU MLP) whose layers follow
// config.layer_types: full_attention and sliding_attention (GQA with RoPE),
// linear_attention (Gated DeltaNet as in Qwen3-Next) and conv (LFM2-style
// gated short convolution). It runs rewind's own layout and the
// transformers families of runtime/model_config.h (LFM2, Qwen3.5, dense
// Qwen3-Next, Qwen3, Llama): their variants ((1 + w) norms, q/k norm, the
// attention output gate, partial RoPE, Llama 3 RoPE scaling, fused
// projections) are config flags, applied
// row by row, so batch invariance holds for all of them. All inference state lives in a
// rwd::Cache built by make_cache() (one sequence, forward()) or a
// rwd::SequenceCache built by make_sequence_cache() (many sequences,
// forward_batch()), or a draft tree on a Cache (forward_tree()); the model
// touches them only through the public cache API, like any other user,
// behind one internal interface over the three (runtime/cache_rows.h), so
// that each layer kind is written once.
//
// forward() is batch invariant: the logits of a token are bit-identical
// whether it is processed alone or inside a multi-token forward, because
// every kernel keeps one reduction order per row (runtime/kernels.h). That
// is what makes speculative decoding provably lossless here.
//
// Thread safety: a Model is immutable after construction and may be shared
// by threads, each with its own Cache. forward() runs its kernels on the
// calling thread and the kernels' thread pool (threads: the calling
// thread's OpenMP setting, omp_set_num_threads / OMP_NUM_THREADS).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rewind/cache.h"
#include "rewind/sequences.h"
#include "runtime/kernels.h"
#include "runtime/model_config.h"
#include "runtime/pack_file.h"
#include "runtime/weights_io.h"

namespace rwd::runtime {

namespace detail {
class CacheRows;  // how a forward addresses its cache (runtime/cache_rows.h)
}

// Which rows of logits a batched forward writes for one sequence.
enum class LogitRows {
  kAll,   // one per token (verification)
  kLast,  // the last token's only (a prompt, a decoding step)
  kNone,  // none (a prompt whose next token comes in a later forward)
};

// One sequence's share of a batched forward: its new tokens (none: the
// sequence is left as it is) and the logits it needs.
struct SequenceTokens {
  SeqId seq;
  std::span<const std::int32_t> tokens;
  LogitRows logits = LogitRows::kAll;
};

// How a Model holds its linear weights (every matrix kernels::matmul
// multiplies with: projections, MLP, output head and a tied embedding).
enum class WeightFormat : std::uint8_t {
  kAsStored,  // the checkpoint's dtype (f32, bf16 or f16): exact
  kQ8,        // quantized at load into int8 blocks of 32 with a bf16 scale
              // each (kernels::PackedMatrix::from_q8, docs/quantization.md)
};

// "as-stored" or "q8" (the CLI's --weights values).
const char* weight_format_name(WeightFormat format);
// The format weight_format_name gives `name`. Throws InvalidArgument naming
// `what` (e.g. "--weights") and the accepted names for anything else.
WeightFormat weight_format_from_name(std::string_view name, std::string_view what);

// Options of Model's constructor and Model::load.
struct LoadOptions {
  // Unset: as the checkpoint holds them (a Q8 checkpoint's as Q8, any
  // other's as stored). kQ8 quantizes a float checkpoint at load; kAsStored
  // asks for the checkpoint's float dtype, which a Q8 checkpoint no longer
  // has (refused).
  std::optional<WeightFormat> weights;
  // Whether Model::load maps the matrices from a pack file of these weights
  // in the model directory (`rewind pack`, write_pack_file below,
  // runtime/pack_file.h): kIfCurrent uses one while the files it was made
  // from are unchanged and loads from those files otherwise (pack_note()
  // says why); kNever always loads from the files.
  enum class Pack : std::uint8_t { kIfCurrent, kNever };
  Pack pack = Pack::kIfCurrent;
};

// What write_pack_file wrote.
struct PackResult {
  std::string path;
  std::string weights;  // weight_format_name of the matrices packed
  std::int64_t matrices = 0;
  std::uint64_t file_bytes = 0;
};

class Model {
 public:
  // Takes validated weights (ModelWeights::load / random check them) and
  // packs them as options.weights says. Throws FormatError for kQ8 when a
  // linear weight is not finite (Q8 has no infinity or NaN), and
  // InvalidArgument for kAsStored with the weights of a Q8 checkpoint
  // (ModelWeights::q8: they are packed as they are, never dequantized).
  explicit Model(ModelWeights weights, LoadOptions options = {});
  // Loads DIR/config.json + DIR/model.safetensors. With a current pack file
  // of the weights asked for in DIR (LoadOptions::pack), the matrices are
  // views of its mapping instead of packed copies (nothing else differs:
  // the same logits, bit for bit, and the same fingerprint); the
  // safetensors' matmul weights are then checked but not read. Throws
  // FormatError / rwd::Error as ModelWeights::load and the constructor do,
  // and FormatError when a pack that matches the files does not match the
  // model (a pack written by another build).
  static Model load(const std::string& dir, LoadOptions options = {});

  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return weights_.config(); }
  std::int64_t vocab_size() const { return config().vocab_size; }
  // Bytes the model's weights occupy in memory: packed matrices (in the
  // stored dtype, panel padding included), the embedding, norms and other
  // small tensors.
  std::size_t weight_bytes() const;
  // Parameters in the model file (tied embeddings counted once).
  std::int64_t parameter_count() const { return parameter_count_; }
  // Identifies the model and its weights: "rewind-hybrid-" + 16 hex digits
  // hashing config.json's fields (to_json) and every tensor's name, shape
  // and bytes (rwd::content_hash). What prefix-cache entries and snapshot
  // files are tagged with.
  // A Q8 model's logits differ from the stored weights', so its fingerprint
  // also hashes the format: cache entries of one never serve the other. A
  // Q8 checkpoint's model hashes the stored int8 values and scales instead
  // of the float weights it was made from, so its fingerprint differs from
  // that of the same checkpoint quantized at load (same logits: entries of
  // one are recomputed by the other, never wrongly served).
  const std::string& fingerprint() const { return fingerprint_; }
  // How the linear weights are held (LoadOptions::weights; kQ8 for a Q8
  // checkpoint).
  WeightFormat weight_format() const { return weight_format_; }
  // The pack file the matrices are mapped from, or empty (Model::load).
  const std::string& pack_path() const { return pack_path_; }
  // Why Model::load found a pack file and did not use it ("DIR/rewind.
  // as-stored.pack not used: model.safetensors changed since it was
  // written ..."), or empty.
  const std::string& pack_note() const { return pack_note_; }

  // An empty cache for one sequence (batch 1) with one layer per model layer.
  Cache make_cache() const;

  // Runs `tokens` (n >= 1, each in [0, vocab)) at positions
  // [L, L + n) where L = cache.get_seq_length(), appending them to the cache.
  // Writes logits to `logits`: [n, vocab] when all_logits, else only the
  // last row [vocab]. Throws InvalidArgument for an empty span or a token
  // outside the vocabulary (nothing appended then).
  // When `cache_seconds` is given, the time spent inside cache calls
  // (update, update_conv_state, recurrent slots, mask sizes) is added to it.
  // Memory: besides the cache and `logits`, every forward (this, forward_batch,
  // forward_tree) works in rows that its thread keeps for the next forward,
  // up to 256 KB per buffer (24 buffers; a few tens of KB for the shipped
  // models' decoding); larger rows, a long prompt's, are freed on return.
  // Those grow with the tokens of one forward (about 24 KB a token for the
  // shipped target): the generation functions feed prompts in pieces of
  // GenerationOptions::max_prefill_rows (runtime/generate.h).
  // The model also keeps the RoPE angles of the positions it has seen
  // (kernels::RopeCache).
  void forward(std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits, bool all_logits = true,
               double* cache_seconds = nullptr) const;

  // An empty cache for many sequences with one layer per model layer
  // (each with its own shapes). Throws InvalidArgument for a bad block size.
  SequenceCache make_sequence_cache(SequenceCacheOptions options = {}) const;

  // One forward over a ragged batch: each entry's tokens at its sequence's
  // positions [L, L + n), all entries' rows through every weight together,
  // attention, conv and recurrent state per sequence. Writes logits [R,
  // vocab]: each entry's rows (its logits: every token's, the last one's or
  // none) in entry order; a prompt's other rows skip the output matmul.
  // Batch invariant: a sequence's logits and stored state are bit-identical
  // to a forward of that sequence alone (in any batch, or through forward()
  // with a Cache). All or nothing (begin_batch): an exception leaves every
  // sequence unchanged. Throws InvalidArgument for an empty batch, no token
  // at all, a token outside the vocabulary or a LogitRows outside its three
  // values, and what
  // SequenceCache::begin_batch throws (invalid or repeated ids, budget).
  void forward_batch(std::span<const SequenceTokens> batch, SequenceCache& cache, std::vector<float>& logits) const;

  // Tree verification (rewind/tree.h): runs the N nodes of `tree`, opened
  // on `cache` with Cache::begin_tree (node i's token is tokens[i]), through
  // every layer and writes logits [N, vocab]. Node i's logits are
  // bit-identical to those its path root..i gets fed as a chain (the kernels
  // keep one reduction order per row, and every node reads exactly the keys,
  // conv inputs and state its path would leave). The caller then commits the
  // accepted path (TreeForward::commit) or abandons the tree. Throws
  // InvalidArgument for tokens.size() != N or a token outside the
  // vocabulary, StateError when `tree` is not open on `cache`, and what the
  // tree's updates throw; the layers are unchanged then (the tree stays
  // open for the caller to abandon).
  void forward_tree(std::span<const std::int32_t> tokens, TreeForward& tree, Cache& cache, std::vector<float>& logits,
                    double* cache_seconds = nullptr) const;

  // Cache memory of one sequence, from the library's retention rules
  // (Layer::retention_bytes over make_cache()'s layers): what one more
  // token costs in full-attention layers (keys + values), the bounded state
  // (sliding windows, conv inputs, recurrent states) without recording, and
  // what activate_past_recording(R) adds to the bounded state. Throws
  // InvalidArgument for R < 0 or R > 2^40, CapacityError past 2^48 bytes.
  std::size_t kv_bytes_per_token() const;
  std::size_t fixed_state_bytes() const;
  std::size_t rollback_bytes(std::int64_t R) const;
  RetentionBytes retention_bytes(std::int64_t R) const;

 private:
  // Linear weights packed for kernels::matmul (shapes [out, in] as in
  // nn.Linear), in the stored dtype (F32, BF16 or F16); the rest are f32, in
  // weights_ or (widened / folded) in folded_. Unused ones empty / null.
  struct LayerWeights {
    enum class Kind { Attention, Sliding, GatedDeltaNet, ShortConv } kind = Kind::Attention;
    const float* input_norm = nullptr;  // [d]
    const float* post_norm = nullptr;   // [d]
    kernels::PackedMatrix gate;         // [ff, d]
    kernels::PackedMatrix up;           // [ff, d]
    kernels::PackedMatrix down;         // [d, ff]
    // attention
    kernels::PackedMatrix wq;       // [nh*hd, d]
    kernels::PackedMatrix wk;       // [nkv*hd, d]
    kernels::PackedMatrix wv;       // [nkv*hd, d]
    kernels::PackedMatrix wo;       // [d, nh*hd]
    kernels::PackedMatrix wgate;    // [nh*hd, d] output gate rows of q_proj (attn_output_gate), else empty
    const float* q_norm = nullptr;  // [hd] per-head query / key RMSNorm (qk_norm), else null
    const float* k_norm = nullptr;
    // Gated DeltaNet
    kernels::PackedMatrix in_qkv;     // [conv_dim, d]
    kernels::PackedMatrix in_z;       // [lnv*lvd, d]
    kernels::PackedMatrix in_b;       // [lnv, d]
    kernels::PackedMatrix in_a;       // [lnv, d]
    const float* conv = nullptr;      // [K, channels] tap-major (conv_dim for GDN, d for short conv)
    const float* dt_bias = nullptr;   // [lnv]
    const float* a_log = nullptr;     // [lnv]
    const float* out_norm = nullptr;  // [lvd]
    kernels::PackedMatrix out;        // [d, lnv*lvd] or [d, d]
    // short conv
    kernels::PackedMatrix in_bcx;  // [3d, d]
  };
  // Floats for a forward's intermediate rows. resize() does not zero-fill
  // (every element is written before it is read, by a matmul or a kernel)
  // and keeps its memory when asked for fewer, so a thread's next forward
  // reuses it instead of allocating, zero-filling and, for long prompts,
  // page-faulting every buffer of every layer again. Contents are undefined
  // after a resize that grows.
  class ScratchRows {
   public:
    void resize(std::size_t n);
    std::size_t size() const { return size_; }
    float* data() { return data_.get(); }
    const float* data() const { return data_.get(); }
    float* begin() { return data_.get(); }
    float& operator[](std::size_t i) { return data_[i]; }
    // Frees the memory when it holds more than `keep` floats.
    void trim(std::size_t keep);

   private:
    std::unique_ptr<float[]> data_;
    std::size_t size_ = 0, capacity_ = 0;
  };
  // The math of each block that does not touch the cache, shared by
  // every forward (rows are independent: batch invariance).
  struct AttentionRows {
    ScratchRows q, key, val, att, gate;  // [n, nh*hd], [n, nkv*hd] x 2, [n, nh*hd] x 2
  };
  void attention_in(const LayerWeights& w, const float* h, std::int64_t n, const kernels::RopeTable& rope,
                    AttentionRows& r) const;
  // The output gate (when the model has one) and o_proj of the attention rows.
  void attention_out(const LayerWeights& w, std::int64_t n, AttentionRows& r, float* out) const;
  struct DeltaNetRows {
    ScratchRows qkv, z, b, a, mixed, q, key, v, g, beta, o;
  };
  void deltanet_in(const LayerWeights& w, const float* h, std::int64_t n, DeltaNetRows& r) const;
  // After the conv (r.mixed): queries, keys, values, gates and betas.
  void deltanet_mid(const LayerWeights& w, std::int64_t n, DeltaNetRows& r) const;
  void deltanet_out(const LayerWeights& w, std::int64_t n, DeltaNetRows& r, float* out) const;
  struct ShortConvRows {
    ScratchRows bcx, bx, conv;
  };
  void short_conv_in(const LayerWeights& w, const float* h, std::int64_t n, ShortConvRows& r) const;
  void short_conv_out(const LayerWeights& w, std::int64_t n, ShortConvRows& r, float* out) const;
  // The MLP half of a layer and the embedding / final rows.
  void mlp(const LayerWeights& w, std::int64_t n, ScratchRows& x, ScratchRows& h, ScratchRows& mix, ScratchRows& gate,
           ScratchRows& up) const;
  // Every buffer of one forward: the residual stream, the MLP's rows and
  // each block's rows (blocks run one after another). One per thread,
  // reused by that thread's forwards (Model::ScratchLease).
  struct Scratch {
    ScratchRows x, h, mix, gate, up;
    AttentionRows attention;
    DeltaNetRows deltanet;
    ShortConvRows conv;
    bool in_use = false;
    // x, h, mix: [rows, hidden]; gate, up: [rows, intermediate].
    void resize_stream(std::size_t rows, std::size_t hidden, std::size_t intermediate);
    void trim(std::size_t keep);
  };
  class ScratchLease;

  // What a forward hands each block of a layer: the layer, its
  // normalized rows h [n, d] (n = every row of the forward), the RoPE
  // table of those rows, and out [n, d] for the block's result.
  struct BlockArgs {
    int layer = 0;
    const LayerWeights* w = nullptr;
    const float* h = nullptr;
    std::int64_t n = 0;
    const kernels::RopeTable* rope = nullptr;
    float* out = nullptr;
    Scratch* scratch = nullptr;  // the forward's buffers; blocks use its rows
  };
  // Each layer kind once, for every front-end: `cache` is the forward's
  // view of its cache (one sequence, a batch, a tree; detail::CacheRows in
  // runtime/cache_rows.h), which stores the block's rows and says what
  // each group of rows reads.
  void attention_block(const BlockArgs& a, detail::CacheRows& cache) const;
  void gated_deltanet_block(const BlockArgs& a, detail::CacheRows& cache) const;
  void short_conv_block(const BlockArgs& a, detail::CacheRows& cache) const;
  // The conv of a Gated DeltaNet or short-conv block: x [n, channels] into
  // the cache, then out [n, channels] from each group's window.
  void conv_rows(const LayerWeights& w, int layer, float* x, std::int64_t channels, std::int64_t kernel_size,
                 bool fuse_silu, detail::CacheRows& cache, float* out) const;
  // Embeds `tokens` (row t at cache.positions()[t]) and runs them through
  // every layer; the last layer's rows are left in scratch.x. REQUIRES:
  // tokens.size() == cache.rows().
  void run_layers(std::span<const std::int32_t> tokens, detail::CacheRows& cache, Scratch& scratch) const;
  // Packs the weights in the constructor (model.cc).
  class Packer;
  // The constructor, taking the matrices from `pack` in order (weights
  // from ModelWeights::load(dir, kCheckOnly)) when it is not null, and
  // appending each matrix it packs to `record` when that is not null.
  Model(ModelWeights weights, LoadOptions options, const PackFile* pack, std::vector<PackedMatrixRecord>* record);
  friend PackResult write_pack_file(const std::string& dir, LoadOptions options);

  // Config, embedding, norms, conv and gate parameters (F32, or BF16 / F16 as
  // stored); the linear weights are released as each is packed (their
  // copies, in the stored dtype, live in layers_ / lm_head_).
  ModelWeights weights_;
  // Norm weights with the 1 of a (1 + w) norm folded in (norm_plus_one);
  // a deque so that the pointers into it survive growth and moves.
  std::deque<std::vector<float>> folded_;
  std::int64_t parameter_count_ = 0;
  std::string fingerprint_;
  std::string pack_path_, pack_note_;
  WeightFormat weight_format_ = WeightFormat::kAsStored;
  bool has_attention_ = false;  // any full / sliding attention layer (needs RoPE)
  // The RoPE angles of the positions seen so far (kernels::RopeCache: at
  // most 64K positions' rows, thread-safe), shared by every forward; its
  // frequencies are the config's (rope_inv_freq: Llama 3 scaling applied).
  std::unique_ptr<kernels::RopeCache> rope_cache_;
  // The RoPE angles of `rows` positions, from rope_cache_.
  kernels::RopeTable rope_table(const std::int64_t* positions, std::int64_t rows) const;
  std::vector<LayerWeights> layers_;
  // The embedding [vocab, d] (F32, BF16 or F16) in weights_, or null when tied:
  // then rows are read from lm_head_.
  const Tensor* embed_ = nullptr;
  // Row `token` of the embedding as f32 into dst[0, d).
  void embed_row(std::int32_t token, float* dst) const;
  const float* final_norm_ = nullptr;  // [d]
  kernels::PackedMatrix lm_head_;      // [vocab, d] (a copy of the embedding when tied)
};

// Writes the pack file (runtime/pack_file.h) of model directory `dir` for
// the weights `options` asks for, as DIR/pack_file_name(format): every
// matrix exactly as Model::load packs it without a pack, so loading with
// the pack gives a model bit-identical to loading without it, with the
// same fingerprint. Replaces an older pack of that format atomically.
// Throws as Model::load does, and rwd::Error when the file cannot be
// written (nothing is left behind then).
PackResult write_pack_file(const std::string& dir, LoadOptions options = {});

// Byte-level tokenizer: a text becomes BOS (when config.add_bos) followed by its bytes.
std::vector<std::int32_t> encode_prompt(const std::string& text, const ModelConfig& config);
// Bytes of the tokens that are bytes (< 256); special tokens are skipped.
std::string decode_tokens(std::span<const std::int32_t> tokens);

}  // namespace rwd::runtime
