// rwd::runtime::evaluate_text (runtime/eval.h): bits per byte by teacher
// forcing through the cache, checked against a direct single forward.
#include "runtime/eval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "rewind/error.h"
#include "runtime/model.h"
#include "test_configs.h"

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

}  // namespace
}  // namespace rwd::runtime
