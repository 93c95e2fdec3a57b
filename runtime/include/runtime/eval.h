// runtime/eval.h: bits per byte and perplexity of a text under a model
// (teacher forcing), for byte-level and tokenized (tokenizer.json) models
// alike: a byte-level model is the case where every token is one byte.
//
// What is scored. T = T[0..N) is the text encoded without the tokens a
// tokenizer adds (Tokenizer::encode(text, false): special tokens written in
// the text are still matched; byte-level: one token per byte), and P is what
// encode(text, true) puts before it: the post-processor's template prefix,
// or BOS when tokenizer_config.json says add_bos_token (BOS for byte-level
// models, Llama and LFM2; nothing for Qwen). The template's suffix (an EOS
// some templates append) is no part of the text and is not scored. T is cut
// into windows of W = min(context, N) tokens (context 0: W = N, one window)
// advanced by `stride` S (0 means S = W: disjoint windows), as transformers'
// perplexity recipe with a stride does:
//   window 0 feeds P + T[0, W) and targets T[0, W);
//   window k >= 1 feeds P + T[kS, min(kS + W, N)) and targets the tokens the
//   previous window did not reach, T[e(k-1), e(k)) with e(k) = min(kS + W, N);
//   the earlier ones are context only. Windows continue until e(k) = N.
// A target is scored when a token precedes it in its window's sequence: with
// a non-empty P every target is scored; with an empty P the first token of
// window 0 (and, for S = W, the first of every window) has nothing to be
// predicted from and is not scored, as transformers scores every token after
// the first. Each token of T is thus scored at most once, from P and up to
// W - 1 tokens before it. With context 0 this is transformers' teacher
// forcing of tokenizer(text) (the loss with labels = input_ids); with
// windows it is its strided recipe, except that P leads every window, not
// only the first, so that each window starts as a text does. Every window
// runs through a fresh cache in forwards of `chunk` tokens, exactly as
// generation feeds a prompt (sliding eviction and the recurrent and conv
// states carried between forwards are exercised).
//
// The figures: bits = sum over scored tokens of -log2 softmax(logits)[token];
// bytes = length of Tokenizer::decode(scored tokens) (special tokens as
// their content, so with a non-empty P the text's own length);
// bits per byte = bits / bytes (= total nats / ln 2 / bytes), perplexity =
// 2^(bits / scored tokens) = exp(mean nats per token).
//
// Because the forward is batch invariant (runtime/model.h), the result does
// not depend on `chunk`, bit for bit; it depends on `context` and `stride`.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string_view>

#include "runtime/model.h"
#include "runtime/tokenizer.h"

namespace rwd::runtime {

struct EvalOptions {
  std::int64_t chunk = 128;  // tokens per forward, >= 1
  std::int64_t context = 0;  // W: text tokens per window (bytes for byte-level models), 0 = the whole text
  std::int64_t stride = 0;   // S: tokens a window advances, 1 <= S <= context; 0 = context (disjoint)
  // Called after every forward with (tokens scored so far, tokens to score).
  std::function<void(std::int64_t, std::int64_t)> on_progress;
};

struct EvalResult {
  std::int64_t tokens = 0;       // tokens scored
  std::int64_t bytes = 0;        // bytes the scored tokens decode to
  std::int64_t text_tokens = 0;  // N: tokens of the text (scored or not)
  std::int64_t segments = 0;     // windows fed (sequences)
  std::int64_t forwards = 0;
  double bits = 0.0;  // sum of -log2 p(token) over the scored tokens
  double seconds = 0.0;
  double bits_per_byte() const { return bytes > 0 ? bits / static_cast<double>(bytes) : 0.0; }
  double bits_per_token() const { return tokens > 0 ? bits / static_cast<double>(tokens) : 0.0; }
  // exp of the mean negative log-likelihood per scored token, in nats.
  double perplexity() const { return tokens > 0 ? std::exp2(bits_per_token()) : 0.0; }
};

// -log2 softmax(logits)[target], the softmax in double (max subtracted).
// REQUIRES: n >= 1, 0 <= target < n.
double negative_log2_prob(const float* logits, std::int64_t n, std::int64_t target);

// Scores `text` under `model` with `tokenizer` as described above. Throws
// InvalidArgument, before any forward, for: an empty text, chunk < 1,
// context < 0, stride outside [0, context] (or non-zero with context 0),
// text that is not valid UTF-8 for a BPE tokenizer, a token id outside the
// model's vocabulary, a window longer than the model's
// max_position_embeddings (P + W positions), nothing to score (a text of
// one token, or windows of one token, with an empty P) and scored tokens
// that decode to no bytes.
EvalResult evaluate_text(const Model& model, const Tokenizer& tokenizer, std::string_view text,
                         const EvalOptions& options = {});

// The same with the byte-level tokenizer of a model directory without
// tokenizer.json (tokenizer_for_model: BOS first when config.add_bos, then
// one token per byte).
EvalResult evaluate_text(const Model& model, std::string_view text, const EvalOptions& options = {});

}  // namespace rwd::runtime
