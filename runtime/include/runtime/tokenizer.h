// Tokenizers of model directories: byte-level BPE read from Hugging Face's
// tokenizer.json (Qwen3, Qwen3.5, LFM2), or the byte-level scheme of the
// shipped KJV models (BOS followed by the text's bytes) when a directory has
// no tokenizer.json. docs/model-format.md ("Tokenizer") lists exactly which
// components of tokenizer.json are read and which are refused.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/model_config.h"

namespace rwd::runtime {

enum class TokenizerKind {
  ByteLevel,  // no tokenizer.json: token b < 256 is byte b, the others are special
  Bpe,        // tokenizer.json: byte-level BPE with merges
};

// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  std::int32_t id = 0;
  std::string content;
  bool special = false;      // skipped by decode(..., skip_special = true)
  bool lstrip = false;       // the match takes the whitespace before it
  bool rstrip = false;       // the match takes the whitespace after it
  bool single_word = false;  // matches only where no letter, digit or '_' touches it
  bool normalized = false;   // matched in the normalized text (else in the raw text)
};

class Tokenizer {
 public:
  // The tokenizer of model directory `dir`: tokenizer.json, with
  // tokenizer_config.json when present (bos / eos / pad token names and
  // add_bos_token). Throws FormatError naming the file and the JSON path when
  // a file is malformed or uses a component outside the supported set, and
  // InvalidArgument when `dir` has no tokenizer.json.
  static Tokenizer load(const std::string& dir);
  // The same from the files' text; `where` names them in error messages.
  // An empty `tokenizer_config_json` means no tokenizer_config.json.
  static Tokenizer from_json(const std::string& tokenizer_json, const std::string& tokenizer_config_json,
                             const std::string& where);
  // Today's scheme of byte-level models: encode() gives BOS (none when bos
  // is -1, as for a family whose prompts start without one) then one token
  // per byte, decode() keeps the tokens below 256 as bytes. Every id in
  // [256, vocab_size) is special. Throws InvalidArgument unless 1 <=
  // vocab_size < 2^31 and bos, eos are in [0, vocab_size) or -1 (none).
  static Tokenizer byte_level(std::int64_t vocab_size, std::int32_t bos, std::int32_t eos);
  // load(dir) when `dir` holds tokenizer.json, else byte_level(...).
  static Tokenizer for_model_dir(const std::string& dir, std::int64_t vocab_size, std::int32_t bos, std::int32_t eos);

  TokenizerKind kind() const;
  // "byte-level" or "BPE (tokenizer.json)".
  std::string kind_name() const;

  // The token ids of `text`. Added tokens (special or not) are matched
  // first, leftmost and then longest; the text between them is normalized
  // (NFC when tokenizer.json says so), split by the pre-tokenizer's regexes
  // and merged by BPE, merges applied lowest rank first (leftmost first
  // among equal ranks). With `add_special`, the post-processor's template
  // (TemplateProcessing) adds its tokens; without a template, BOS is put
  // first when tokenizer_config.json says add_bos_token: true. Byte-level:
  // BOS (with add_special) then the bytes. `text` must be valid UTF-8 for a
  // BPE tokenizer (InvalidArgument naming the byte offset otherwise); a
  // byte-level tokenizer takes any bytes. Safe to call from many threads.
  std::vector<std::int32_t> encode(std::string_view text, bool add_special = true) const;

  // The bytes of `ids`, concatenated: a vocabulary token's bytes through the
  // byte-level table, an added token's content as it is. Ids without a token
  // (negative, >= vocab_size(), or a hole in the vocabulary) contribute
  // nothing, as do special tokens when `skip_special`. The result is the
  // exact bytes (it may end inside a UTF-8 sequence); decode(encode(x, false))
  // == x for every NFC-normalized UTF-8 x, except for whitespace that an
  // lstrip / rstrip added token takes into its match.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special = false) const;

  // One past the largest token id (vocabulary and added tokens).
  std::int64_t vocab_size() const;
  // The id of a token string (as tokenizer.json spells it: byte-level
  // characters, e.g. "Ġthe", or an added token's content).
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  // The token string of an id; nullopt outside the vocabulary or in a hole.
  std::optional<std::string> id_to_token(std::int32_t id) const;
  // Whether `id` is a special token (added token with special: true;
  // byte-level: every id >= 256).
  bool is_special(std::int32_t id) const;
  // tokenizer_config.json's bos_token / eos_token / pad_token, as ids
  // (nullopt when not named or named but absent from the vocabulary).
  // Byte-level: the BOS and EOS given to byte_level(), no pad.
  std::optional<std::int32_t> bos_id() const;
  std::optional<std::int32_t> eos_id() const;
  std::optional<std::int32_t> pad_id() const;
  // tokenizer_config.json's add_bos_token (false when absent); true for
  // byte-level tokenizers.
  bool add_bos_token() const;
  // The added tokens, in id order (empty for a byte-level tokenizer).
  const std::vector<AddedToken>& added_tokens() const;
  // The ids that encode(..., true) puts before and after the text (before:
  // the template's prefix, or BOS when add_bos_token asks for it).
  const std::vector<std::int32_t>& prefix_ids() const;
  const std::vector<std::int32_t>& suffix_ids() const;

  // Whether `other` has the same vocabulary: the same kind, vocab_size and
  // token string for every id, the same special flags, and the same BOS and
  // EOS ids. Otherwise `why` (when not null) gets the first difference, e.g.
  // `token 1234 is "Ġthe" here and "Ġa" there`.
  bool compatible_with(const Tokenizer& other, std::string* why = nullptr) const;

  // One line: kind, vocabulary size, BOS / EOS / PAD, count of special tokens.
  std::string describe() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;  // immutable: copies share it, threads may too
  friend class StreamDecoder;
};

// Decodes generated tokens one at a time for streaming output. push()
// returns the bytes that are complete UTF-8 so far and holds back the start
// of a sequence whose remaining bytes may come with the next tokens (a 4-byte
// emoji split over two tokens comes out whole with the second). Bytes that
// can never be valid UTF-8 come out as U+FFFD, one per maximal invalid
// subpart, so that every string returned is valid UTF-8. A byte-level
// tokenizer streams its bytes as they come, unchanged (today's output).
class StreamDecoder {
 public:
  // `tokenizer` must outlive the decoder. Special tokens are dropped when
  // `skip_special`, else shown as their content.
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = true);
  // The bytes that `id` completes.
  std::string push(std::int32_t id);
  // The held-back bytes of an unfinished sequence, as U+FFFD ("" when none);
  // the decoder is then empty and can be reused.
  std::string finish();
  // Bytes held back now.
  std::size_t pending() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
};

// The tokenizer of the model in directory `dir` with config `config`: its
// tokenizer.json (with tokenizer_config.json), or the byte-level scheme
// (BOS + bytes) when it has none; BOS comes first only for a family whose
// prompts start with it (config.add_bos). Throws what for_model_dir throws,
// and InvalidArgument when the tokenizer's ids reach past config.vocab_size
// (they would fall outside the embedding table).
Tokenizer tokenizer_for_model(const std::string& dir, const ModelConfig& config);

}  // namespace rwd::runtime
