// libFuzzer target: the tokenizer on arbitrary bytes. The first byte picks a
// mode; the rest is the input.
//   text:   encoded with a Qwen-shaped tokenizer.json (tests/runtime/tiny_tokenizer.h:
//           Qwen's pre-tokenizer regex, merges, special and non-special added
//           tokens). Invalid UTF-8 raises InvalidArgument; valid text
//           decodes back to itself, and streaming one id at a time gives
//           the same bytes, every piece valid UTF-8.
//   ids:    pairs of bytes as token ids (valid, holes, out of range) streamed
//           through StreamDecoder: every piece and the whole output are
//           valid UTF-8, and decode() never throws.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "rewind/error.h"
#include "runtime/safetensors.h"  // is_valid_utf8
#include "runtime/tiny_tokenizer.h"
#include "runtime/tokenizer.h"

namespace {

const rwd::runtime::Tokenizer& tokenizer() {
  // lstrip / rstrip would eat whitespace, which the round trip must keep.
  static const rwd::runtime::Tokenizer t = [] {
    auto j = rwd::runtime::testing_tokenizer::tiny();
    for (auto& a : j["added_tokens"]) a["lstrip"] = a["rstrip"] = false;
    return rwd::runtime::Tokenizer::from_json(j.dump(), "", "fuzz tokenizer.json");
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const rwd::runtime::Tokenizer& t = tokenizer();
  const std::string input(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] % 2 == 0) {
    std::vector<std::int32_t> ids;
    try {
      ids = t.encode(input, false);
    } catch (const rwd::InvalidArgument&) {
      if (rwd::runtime::is_valid_utf8(input)) std::abort();  // valid text refused
      return 0;
    }
    if (!rwd::runtime::is_valid_utf8(input)) std::abort();  // invalid text encoded
    if (t.decode(ids) != input) std::abort();
    rwd::runtime::StreamDecoder d(t, false);
    std::string streamed;
    for (std::int32_t id : ids) {
      const std::string piece = d.push(id);
      if (!rwd::runtime::is_valid_utf8(piece)) std::abort();
      streamed += piece;
    }
    if (streamed + d.finish() != input) std::abort();
  } else {
    std::vector<std::int32_t> ids;
    for (std::size_t i = 0; i + 1 < input.size(); i += 2) {
      // Ids up to 2^15 + the sign: most in [0, 512), some far outside.
      const auto hi = static_cast<std::uint8_t>(input[i]), lo = static_cast<std::uint8_t>(input[i + 1]);
      std::int32_t id = (hi & 0x01) << 8 | lo;
      if (hi & 0x80) id = -id - 1;
      if (hi & 0x40) id += 1 << 20;
      ids.push_back(id);
    }
    rwd::runtime::StreamDecoder d(t, (data[0] & 2) != 0);
    std::string streamed;
    for (std::int32_t id : ids) {
      const std::string piece = d.push(id);
      if (!rwd::runtime::is_valid_utf8(piece)) std::abort();
      streamed += piece;
    }
    streamed += d.finish();
    if (!rwd::runtime::is_valid_utf8(streamed) || d.pending() != 0) std::abort();
    (void)t.decode(ids, (data[0] & 2) != 0);
  }
  return 0;
}
