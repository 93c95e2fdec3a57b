// rwd::runtime::evaluate_text (runtime/eval.h): bits per byte by teacher
// forcing through the cache, checked against a direct single forward
// (byte-level) and against forwards of one token at a time with the
// log-softmax summed here (tokenized models, windows worked out by hand).
#include "runtime/eval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "rewind/error.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"
#include "runtime/weights_io.h"
#include "test_configs.h"
#include "tiny_tokenizer.h"

namespace rwd::runtime {
namespace {

// Every layer kind; window 5 so that eviction happens inside a segment.
ModelConfig every_kind() { return testing_configs::hybrid(); }

const std::string kText =
    "In the beginning God created the heaven and the earth. And the earth was without form, and void.";

// Mean of -log2 softmax over one forward of BOS + text, computed here
// independently of eval.cc (log-sum-exp in long double).
double direct_bits_per_byte(const Model& m, const std::string& text) {
  const std::vector<std::int32_t> tokens = encode_prompt(text, m.config());
  Cache cache = m.make_cache();
  std::vector<float> logits;
  m.forward(tokens, cache, logits, true);
  const auto V = static_cast<std::size_t>(m.vocab_size());
  long double bits = 0;
  for (std::size_t j = 0; j + 1 < tokens.size(); ++j) {
    const float* row = logits.data() + j * V;
    long double mx = row[0], sum = 0;
    for (std::size_t i = 1; i < V; ++i) mx = std::max<long double>(mx, row[i]);
    for (std::size_t i = 0; i < V; ++i) sum += std::exp(static_cast<long double>(row[i]) - mx);
    const long double log_p = row[static_cast<std::size_t>(tokens[j + 1])] - mx - std::log(sum);
    bits += -log_p / std::log(2.0L);
  }
  return static_cast<double>(bits / static_cast<long double>(text.size()));
}

TEST(Eval, BitsPerByteEqualsDirectForwardForEveryChunkSize) {
  const Model m(ModelWeights::random(every_kind(), 11));
  const double expected = direct_bits_per_byte(m, kText);
  ASSERT_GT(expected, 1.0);  // a random model: several bits per byte
  const auto n = static_cast<std::int64_t>(kText.size());
  double by_one = 0;
  for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{7}, n, n + 10}) {
    EvalOptions o;
    o.chunk = chunk;
    std::int64_t calls = 0, last = 0;
    o.on_progress = [&](std::int64_t done, std::int64_t total) {
      EXPECT_EQ(total, n);
      EXPECT_GT(done, last);
      last = done;
      ++calls;
    };
    const EvalResult r = evaluate_text(m, kText, o);
    EXPECT_EQ(r.bytes, n);
    EXPECT_EQ(r.segments, 1);
    EXPECT_EQ(r.forwards, (n + chunk - 1) / chunk);
    EXPECT_EQ(calls, r.forwards);
    EXPECT_EQ(last, n);
    EXPECT_NEAR(r.bits_per_byte(), expected, 1e-9) << "chunk " << chunk;
    // Batch invariance: the chunk size changes no bit of the logits, so the
    // sums are the same doubles.
    if (chunk == 1) by_one = r.bits_per_byte();
    EXPECT_EQ(r.bits_per_byte(), by_one) << "chunk " << chunk;
  }
}

TEST(Eval, ContextSplitsTheTextIntoIndependentSequences) {
  const Model m(ModelWeights::random(every_kind(), 12));
  const std::int64_t context = 20;  // > window 5: eviction inside each segment
  double bits = 0;
  for (std::size_t s = 0; s < kText.size(); s += static_cast<std::size_t>(context)) {
    const std::string seg = kText.substr(s, static_cast<std::size_t>(context));
    bits += direct_bits_per_byte(m, seg) * static_cast<double>(seg.size());
  }
  for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{3}, std::int64_t{64}}) {
    EvalOptions o;
    o.chunk = chunk;
    o.context = context;
    const EvalResult r = evaluate_text(m, kText, o);
    EXPECT_EQ(r.segments, (static_cast<std::int64_t>(kText.size()) + context - 1) / context);
    EXPECT_NEAR(r.bits, bits, 1e-9 * bits) << "chunk " << chunk;
  }
  // A context at least the text's length is the same as 0 (one sequence).
  EvalOptions whole, longer;
  longer.context = 1000;
  EXPECT_EQ(evaluate_text(m, kText, whole).bits, evaluate_text(m, kText, longer).bits);
}

TEST(Eval, NegativeLog2Prob) {
  const std::vector<float> uniform(256, 3.0f);
  EXPECT_NEAR(negative_log2_prob(uniform.data(), 256, 17), 8.0, 1e-12);
  const std::vector<float> two = {0.0f, std::log(3.0f)};  // p = 1/4, 3/4
  EXPECT_NEAR(negative_log2_prob(two.data(), 2, 0), 2.0, 1e-6);
  const std::vector<float> huge = {1e30f, 0.0f};  // no overflow: max subtracted
  EXPECT_EQ(negative_log2_prob(huge.data(), 2, 0), 0.0);
}

TEST(Eval, RejectsBadInput) {
  const Model m(ModelWeights::random(every_kind(), 13));
  EvalOptions o;
  EXPECT_THROW(evaluate_text(m, "", o), InvalidArgument);
  o.chunk = 0;
  EXPECT_THROW(evaluate_text(m, kText, o), InvalidArgument);
  o.chunk = 4;
  o.context = -1;
  EXPECT_THROW(evaluate_text(m, kText, o), InvalidArgument);
}

// ---- tokenized models ------------------------------------------------------

using Ids = std::vector<std::int32_t>;

// A model whose vocabulary (320 rows) covers the tiny tokenizer's 306 ids.
ModelConfig tokenized_config() {
  ModelConfig c = every_kind();
  c.vocab_size = 320;
  c.bos_token_id = 305;
  c.eos_token_id = 300;
  c.eos_token_ids = {300};
  return c;
}

// The tiny tokenizer bare (nothing before a text, as Qwen's) or with
// tokenizer_config.json's add_bos_token (<s> = 305 first, as Llama's).
Tokenizer tiny_tokenizer(bool bos) {
  const nlohmann::json config = {{"bos_token", "<s>"}, {"add_bos_token", true}};
  return Tokenizer::from_json(testing_tokenizer::tiny().dump(), bos ? config.dump() : std::string(), "tiny");
}

// Sum of -log2 p(sequence[i]) for i in [first, size), the model fed one
// token per forward through the public API and the log-softmax taken here
// in long double.
long double token_by_token_bits(const Model& m, const Ids& sequence, std::size_t first) {
  Cache cache = m.make_cache();
  std::vector<float> logits;
  const auto V = static_cast<std::size_t>(m.vocab_size());
  long double bits = 0;
  for (std::size_t i = 0; i + 1 < sequence.size(); ++i) {
    m.forward(std::span<const std::int32_t>(&sequence[i], 1), cache, logits, true);
    if (i + 1 < first) continue;
    long double mx = logits[0], sum = 0;
    for (std::size_t v = 1; v < V; ++v) mx = std::max<long double>(mx, logits[v]);
    for (std::size_t v = 0; v < V; ++v) sum += std::exp(static_cast<long double>(logits[v]) - mx);
    bits += -(logits[static_cast<std::size_t>(sequence[i + 1])] - mx - std::log(sum)) / std::log(2.0L);
  }
  return bits;
}

// Words the tiny tokenizer merges (hello, Ġw, ll), a special token in the
// text, and 2-, 3- and 4-byte UTF-8.
const std::string kTokenized = "hello world, hello<|end|> caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x98\x80 well";

TEST(EvalTokenized, EqualsForwardsOfOneTokenForEveryChunkSize) {
  const Model m(ModelWeights::random(tokenized_config(), 21));
  for (const bool bos : {false, true}) {
    const Tokenizer t = tiny_tokenizer(bos);
    const Ids text = t.encode(kTokenized, false);
    ASSERT_EQ(text.front(), 259);  // "hello", 5 bytes
    ASSERT_EQ(text[1], 260);       // "Ġw"
    ASSERT_EQ(text.size(), 28u);
    // <s> comes first by tokenizer_config.json's add_bos_token.
    ASSERT_EQ(t.encode(kTokenized, true).size(), text.size() + (bos ? 1 : 0));
    Ids sequence = bos ? Ids{305} : Ids{};
    sequence.insert(sequence.end(), text.begin(), text.end());
    // Without BOS the first token has nothing to be predicted from.
    const auto expected = static_cast<double>(token_by_token_bits(m, sequence, 1));
    const auto scored = static_cast<std::int64_t>(sequence.size()) - 1;
    const auto bytes = static_cast<std::int64_t>(kTokenized.size()) - (bos ? 0 : 5);
    const auto n = static_cast<std::int64_t>(text.size());
    double by_one = 0;
    for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{4}, n, n + 3}) {
      EvalOptions o;
      o.chunk = chunk;
      std::int64_t calls = 0, last = 0;
      o.on_progress = [&](std::int64_t done, std::int64_t total) {
        EXPECT_EQ(total, scored);
        EXPECT_GE(done, last);
        last = done;
        ++calls;
      };
      const EvalResult r = evaluate_text(m, t, kTokenized, o);
      EXPECT_EQ(r.text_tokens, n);
      EXPECT_EQ(r.tokens, scored);
      EXPECT_EQ(r.bytes, bytes);
      EXPECT_EQ(r.segments, 1);
      EXPECT_EQ(r.forwards, (scored + chunk - 1) / chunk);
      EXPECT_EQ(calls, r.forwards);
      EXPECT_EQ(last, scored);
      EXPECT_NEAR(r.bits, expected, 1e-9 * expected) << "bos " << bos << " chunk " << chunk;
      EXPECT_NEAR(r.bits_per_byte(), expected / static_cast<double>(bytes), 1e-9);
      EXPECT_NEAR(r.perplexity(), std::exp(expected * std::log(2.0) / static_cast<double>(scored)),
                  1e-9 * r.perplexity());
      if (chunk == 1) by_one = r.bits;
      EXPECT_EQ(r.bits, by_one) << "chunk " << chunk;  // batch invariance
    }
  }
}

// Windows of 4 tokens over a text of 10 one-byte tokens (letters the tiny
// tokenizer neither merges nor adds), each window's scored tokens written
// out by hand: {first fed, first scored, end} in text token indices.
struct HandWindow {
  std::size_t feed, target, end;
};

void expect_windows(const Model& m, bool bos, const std::string& text, std::int64_t context, std::int64_t stride,
                    const std::vector<HandWindow>& windows) {
  const Tokenizer t = tiny_tokenizer(bos);
  const Ids ids = t.encode(text, false);
  ASSERT_EQ(ids.size(), text.size());
  long double bits = 0;
  std::int64_t tokens = 0;
  for (const HandWindow& w : windows) {
    Ids sequence = bos ? Ids{305} : Ids{};
    const std::size_t p = sequence.size();
    sequence.insert(sequence.end(), ids.begin() + static_cast<std::ptrdiff_t>(w.feed),
                    ids.begin() + static_cast<std::ptrdiff_t>(w.end));
    bits += token_by_token_bits(m, sequence, p + (w.target - w.feed));
    tokens += static_cast<std::int64_t>(w.end - w.target);
  }
  for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{3}, std::int64_t{64}}) {
    EvalOptions o;
    o.chunk = chunk;
    o.context = context;
    o.stride = stride;
    const EvalResult r = evaluate_text(m, t, text, o);
    const std::string what = "bos " + std::to_string(bos) + " context " + std::to_string(context) + " stride " +
                             std::to_string(stride) + " chunk " + std::to_string(chunk);
    EXPECT_EQ(r.segments, static_cast<std::int64_t>(windows.size())) << what;
    EXPECT_EQ(r.tokens, tokens) << what;
    EXPECT_EQ(r.bytes, tokens) << what;  // one byte per token
    EXPECT_NEAR(r.bits, static_cast<double>(bits), 1e-9 * static_cast<double>(bits)) << what;
  }
}

TEST(EvalTokenized, WindowsScoreTheTokensWorkedOutByHand) {
  const Model m(ModelWeights::random(tokenized_config(), 22));
  const std::string ten = "qrstuvwxyz", nine = "qrstuvwxy";
  // Disjoint windows (stride 0 = context): without BOS each window's first
  // token goes unscored; with BOS every token is scored.
  expect_windows(m, false, ten, 4, 0, {{0, 1, 4}, {4, 5, 8}, {8, 9, 10}});
  expect_windows(m, true, ten, 4, 0, {{0, 0, 4}, {4, 4, 8}, {8, 8, 10}});
  expect_windows(m, true, ten, 4, 4, {{0, 0, 4}, {4, 4, 8}, {8, 8, 10}});
  // A last window of one token without BOS scores nothing and is not fed.
  expect_windows(m, false, nine, 4, 0, {{0, 1, 4}, {4, 5, 8}});
  // Stride 3: windows start at 0, 3, 6 and score what the last one missed
  // (transformers' recipe: window k is [3k, 3k + 4), targets from the
  // previous window's end).
  expect_windows(m, false, ten, 4, 3, {{0, 1, 4}, {3, 4, 7}, {6, 7, 10}});
  expect_windows(m, true, ten, 4, 3, {{0, 0, 4}, {3, 4, 7}, {6, 7, 10}});
  // Stride 1: every later window scores one token after three of context.
  expect_windows(m, false, nine.substr(0, 6), 4, 1, {{0, 1, 4}, {1, 4, 5}, {2, 5, 6}});
  // Stride 2 with a last window cut short by the text's end.
  expect_windows(m, false, nine, 4, 2, {{0, 1, 4}, {2, 4, 6}, {4, 6, 8}, {6, 8, 9}});
  // A context at least the text's length is one window, stride or not.
  expect_windows(m, false, ten, 10, 3, {{0, 1, 10}});
  expect_windows(m, true, ten, 0, 0, {{0, 0, 10}});
}

TEST(EvalTokenized, ByteLevelIsTheCaseOfOneTokenPerByte) {
  // The byte-level overload is the byte-level tokenizer (BOS first) through
  // the same windows.
  const Model m(ModelWeights::random(every_kind(), 23));
  const Tokenizer bytes = Tokenizer::byte_level(m.vocab_size(), 256, 257);
  EvalOptions o;
  o.context = 20;
  o.stride = 7;
  const EvalResult a = evaluate_text(m, kText, o), b = evaluate_text(m, bytes, kText, o);
  EXPECT_EQ(a.bits, b.bits);
  EXPECT_EQ(a.tokens, static_cast<std::int64_t>(kText.size()));
  EXPECT_EQ(a.bytes, static_cast<std::int64_t>(kText.size()));
  // A family without BOS (config.add_bos false): the first byte is context.
  ModelConfig c = every_kind();
  c.add_bos = false;
  const Model no_bos(ModelWeights::random(c, 23));
  const EvalResult r = evaluate_text(no_bos, kText);
  EXPECT_EQ(r.tokens, static_cast<std::int64_t>(kText.size()) - 1);
  EXPECT_EQ(r.bytes, static_cast<std::int64_t>(kText.size()) - 1);
  const Ids sequence(kText.begin(), kText.end());
  const auto expected = static_cast<double>(token_by_token_bits(no_bos, sequence, 1));
  EXPECT_NEAR(r.bits, expected, 1e-9 * expected);
}

TEST(EvalTokenized, RefusesBeforeAnyForward) {
  ModelConfig c = tokenized_config();
  c.max_position_embeddings = 8;
  const Model m(ModelWeights::random(c, 24));
  const Tokenizer bare = tiny_tokenizer(false), bos = tiny_tokenizer(true);
  std::int64_t calls = 0;
  auto refused = [&](const Tokenizer& t, const std::string& text, std::int64_t context, std::int64_t stride,
                     const std::string& message, std::int64_t chunk = 4) {
    EvalOptions o;
    o.chunk = chunk;
    o.context = context;
    o.stride = stride;
    o.on_progress = [&](std::int64_t, std::int64_t) { ++calls; };
    try {
      evaluate_text(m, t, text, o);
      ADD_FAILURE() << "accepted " << text << " context " << context << " stride " << stride;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  refused(bare, "", 0, 0, "the text is empty");
  refused(bare, "qrs", 0, 0, "chunk must be >= 1, got 0", 0);
  refused(bare, "qrs", -1, 0, "context must be >= 0");
  refused(bare, "qrs", 0, 2, "stride 2 needs a context");
  refused(bare, "qrs", 4, 5, "stride 5 must be in [1, context 4]");
  refused(bare, "qrs", 4, -1, "stride -1 must be in [1, context 4]");
  // One token and nothing before it: nothing to predict.
  refused(bare, "hello", 0, 0, "nothing to score: the text is 1 token, and the tokenizer puts no token");
  refused(bare, "qrstuv", 1, 0, "nothing to score: the text is 6 tokens, windows of 1 token");
  refused(bare, "q\xFFr", 0, 0, "not valid UTF-8");
  // Windows of 8 text tokens fit 8 positions bare, not after BOS.
  EXPECT_EQ(evaluate_text(m, bare, "qrstuvwxyz", EvalOptions{4, 8, 0, {}}).tokens, 8);
  refused(bos, "qrstuvwxyz", 8, 0,
          "context 8 makes windows of 9 positions (1 before the text + 8 tokens), past the model's "
          "max_position_embeddings (8); give a context of at most 7");
  refused(bos, "qrstuvwxyz", 0, 0, "context 0 makes windows of 11 positions");
  // A tokenizer with ids past the model's vocabulary.
  ModelConfig small = tokenized_config();
  small.vocab_size = 300;
  small.bos_token_id = 256;
  small.eos_token_ids = {257};
  const Model s(ModelWeights::random(small, 25));
  try {
    evaluate_text(s, bare, "q<s>", {});
    ADD_FAILURE() << "accepted token 305 in a vocabulary of 300";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("token 305, outside the model's vocabulary [0, 300)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(calls, 0) << "a refused evaluation ran forwards";
  // A scored special token decodes to its content: its bytes count.
  EXPECT_EQ(evaluate_text(m, bare, "q<|end|>", {}).bytes, 7);
}

#ifdef REWIND_CLI_PATH
// `rewind eval` on a model directory with a tokenizer.json prints what
// evaluate_text gives with the directory's tokenizer.
class EvalCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    using cli_test::write_file;
    dir_ = (cli_test::scratch_dir() / "eval_models").string();
    std::filesystem::remove_all(dir_);
    ModelConfig c = tokenized_config();
    c.max_position_embeddings = 32;  // the text (28 tokens) fits whole, twice the text does not
    for (const char* name : {"bos", "bare"}) {
      write_random_model(c, dir_ + "/" + name, 31, DType::F32);
      write_file(dir_ + "/" + name + "/tokenizer.json", testing_tokenizer::tiny().dump());
    }
    write_file(dir_ + "/bos/tokenizer_config.json",
               nlohmann::json{{"bos_token", "<s>"}, {"add_bos_token", true}}.dump());
    text_ = (cli_test::scratch_dir() / "eval_text.txt").string();
    write_file(text_, kTokenized);
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(dir_); }
  static std::string dir_, text_;
};
std::string EvalCli::dir_, EvalCli::text_;

TEST_F(EvalCli, PrintsWhatEvaluateTextGives) {
  for (const char* name : {"bos", "bare"}) {
    const std::string dir = dir_ + "/" + name;
    const Model m = Model::load(dir);
    const Tokenizer t = tokenizer_for_model(dir, m.config());
    for (const auto& [context, stride] : {std::pair{0, 0}, std::pair{8, 3}, std::pair{8, 0}}) {
      EvalOptions o;
      o.context = context;
      o.stride = stride;
      const EvalResult r = evaluate_text(m, t, kTokenized, o);
      const cli_test::CliResult cli = cli_test::run_cli(
          "eval --model " + cli_test::quote(dir) + " --text " + cli_test::quote(text_) + " --context " +
          std::to_string(context) + " --stride " + std::to_string(stride));
      ASSERT_EQ(cli.status, 0) << cli.all();
      char expected[160];
      std::snprintf(expected, sizeof expected,
                    ": %.4f bits per byte, perplexity %.4f per token (%lld bytes, %lld tokens scored of %lld, %lld "
                    "windows",
                    r.bits_per_byte(), r.perplexity(), static_cast<long long>(r.bytes),
                    static_cast<long long>(r.tokens), static_cast<long long>(r.text_tokens),
                    static_cast<long long>(r.segments));
      EXPECT_NE(cli.out.find(expected), std::string::npos) << expected << "\n" << cli.all();
    }
  }
  // Refusals name the flag's value and exit 2, with nothing printed.
  const cli_test::CliResult stride = cli_test::run_cli("eval --model " + cli_test::quote(dir_ + "/bare") + " --text " +
                                                       cli_test::quote(text_) + " --context 4 --stride 5");
  EXPECT_EQ(stride.status, 2) << stride.all();
  EXPECT_NE(stride.err.find("stride 5 must be in [1, context 4]"), std::string::npos) << stride.all();
  EXPECT_EQ(stride.out, "");
  const std::string one = (cli_test::scratch_dir() / "eval_one_token.txt").string();
  cli_test::write_file(one, "hello");
  const cli_test::CliResult nothing = cli_test::run_cli("eval --model " + cli_test::quote(dir_ + "/bare") + " --text " +
                                                        cli_test::quote(one));
  EXPECT_EQ(nothing.status, 2) << nothing.all();
  EXPECT_NE(nothing.err.find("nothing to score: the text is 1 token"), std::string::npos) << nothing.all();
  const std::string twice = (cli_test::scratch_dir() / "eval_twice.txt").string();
  cli_test::write_file(twice, kTokenized + kTokenized);
  const cli_test::CliResult longer = cli_test::run_cli("eval --model " + cli_test::quote(dir_ + "/bos") + " --text " +
                                                       cli_test::quote(twice) + " --context 0");
  EXPECT_EQ(longer.status, 2) << longer.all();
  EXPECT_NE(longer.err.find("context 0 makes windows of 57 positions (1 before the text + 56 tokens), past the "
                            "model's max_position_embeddings (32); give a context of at most 31"),
            std::string::npos)
      << longer.all();
}
#endif

}  // namespace
}  // namespace rwd::runtime
