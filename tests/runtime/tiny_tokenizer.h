// A small tokenizer.json in the shape of Qwen's (tests/runtime/tokenizer_test.cc
// works its ids out by hand; fuzz/fuzz_tokenizer.cc encodes arbitrary text
// with it).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace rwd::runtime::testing_tokenizer {

using json = nlohmann::json;

// GPT-2's byte-to-character rule, written out here on its own: printable
// bytes stand for themselves, the others take U+0100, U+0101, ... in order.
inline std::string byte_char(int b) {
  int cp = b;
  if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

inline const char* kQwenPattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";

// A tokenizer.json in Qwen's shape: byte b is token b; merges
//   0 "h e" -> 256 "he"     1 "l l" -> 257 "ll"    2 "he ll" -> 258 "hell"
//   3 "hell o" -> 259       4 "Ġ w" -> 260 "Ġw"    5 "l o" -> 261 "lo"
// added tokens 300 <|end|> (special), 301 <sep> (special, lstrip + rstrip),
// 302 [X] (not special), 303 ab, 304 abc (longest match wins), 305 <s>.
inline json tiny() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  vocab["hell"] = 258;
  vocab["hello"] = 259;
  vocab[byte_char(' ') + "w"] = 260;
  vocab["lo"] = 261;
  json merges = json::array({"h e", "l l", "he ll", "hell o", byte_char(' ') + " w", "l o"});
  auto added = [](int id, const char* content, bool special, bool lstrip = false, bool rstrip = false) {
    return json{{"id", id},         {"content", content},  {"single_word", false}, {"lstrip", lstrip},
                {"rstrip", rstrip}, {"normalized", false}, {"special", special}};
  };
  json j;
  j["version"] = "1.0";
  j["added_tokens"] = json::array({added(300, "<|end|>", true), added(301, "<sep>", true, true, true),
                                   added(302, "[X]", false), added(303, "ab", false), added(304, "abc", false),
                                   added(305, "<s>", true)});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array(
           {json{
                {"type", "Split"}, {"pattern", {{"Regex", kQwenPattern}}}, {"behavior", "Isolated"}, {"invert", false}},
            json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}})}};
  j["post_processor"] = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merges}};
  return j;
}

}  // namespace rwd::runtime::testing_tokenizer
