// rewind serve's prefix reuse: the server started in-process on 127.0.0.1
// over the shipped model, with its in-process prefix cache, a directory or
// a Redis server (tests/store/redis_server.h; label redis) shared by two
// Server instances. Every response is compared with runtime::generate() on
// its prompt alone, and the restored token counts with the boundaries the
// prefix cache stores entries at (every prefix_interval tokens and at the
// end of each prompt but its last token).
#include <gtest/gtest.h>

#include <httplib.h>
#include <omp.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "rewind/prefix_cache.h"
#include "rewind/store.h"
#include "rewind/warnings.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"
#include "server/server.h"
#include "server/server_test_util.h"
#if REWIND_HAVE_REDIS
#include "store/redis_server.h"
#endif

namespace {

using namespace rwt::server;  // json, Model, Tokenizer, Server, ServerOptions, ... (server_test_util.h)

constexpr std::int64_t kInterval = 32;

// Long enough for several entries (byte level: one token a byte, plus BOS).
const std::string kGenesis =
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness "
    "was upon the face of the deep. And the Spirit of God moved upon the face of the waters.";
const std::string kGenesisMore =
    " And God said, Let there be light: and there was light. And God saw the light, that it was good.";
const std::string kPsalm = "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures.";

class ServerPrefix : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    load_model(model_dir(), model_, tokenizer_);
  }
  static void TearDownTestSuite() { unload_model(model_, tokenizer_); }
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("rwd_server_prefix_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static ServerOptions options(const std::string& prefix_cache = {}) {
    ServerOptions o;
    o.model_dir = model_dir();
    o.port = 0;
    o.threads = 1;
    o.max_batch = 4;
    o.max_prefill_rows = 16;  // pieces shorter than the interval: boundaries inside and between rounds
    o.prefix_cache = prefix_cache;
    o.prefix_interval = kInterval;
    return o;
  }

  static std::vector<std::int32_t> encode(const std::string& text) { return tokenizer_->encode(text, true); }

  // generate() on `text` alone, greedy or seeded sampling.
  static std::string solo(const std::string& text, std::int64_t max_tokens, float temperature = 0.0f,
                          std::uint64_t seed = 0) {
    GenerationOptions g;
    g.max_new_tokens = max_tokens;
    g.sampling.temperature = temperature;
    g.sampling.seed = seed;
    return tokenizer_->decode(rwd::runtime::generate(*model_, encode(text), g), true);
  }

  static std::string complete(int port, const std::string& prompt, std::int64_t max_tokens, float temperature = 0.0f,
                              std::uint64_t seed = 0) {
    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(120, 0);
    const json body = {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", temperature}, {"seed", seed}};
    const auto res = client.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(res) << "no response";
    if (!res) return {};
    EXPECT_EQ(res->status, 200) << res->body;
    return json::parse(res->body)["choices"][0]["text"];
  }

  // The tokens a lookup of `now` restores when the prompt `before` was seen
  // (its entries: multiples of the interval and the end of its prompt but
  // the last token), `now` looked up but its last token: the longest entry
  // that is a prefix of that, tried at its own end, one before, then the
  // multiples of the interval.
  static std::int64_t expected_hit(const std::vector<std::int32_t>& before, const std::vector<std::int32_t>& now) {
    const auto head_before = static_cast<std::int64_t>(before.size()) - 1;
    const auto head = static_cast<std::int64_t>(now.size()) - 1;
    std::int64_t common = 0;
    while (common < head && common < head_before && before[common] == now[common]) ++common;
    const auto stored = [&](std::int64_t b) {
      return b > 0 && b <= common && (b % kInterval == 0 || b == head_before);
    };
    for (const std::int64_t b : {head, head - 1}) {
      if (stored(b)) return b;
    }
    for (std::int64_t b = head / kInterval * kInterval; b > 0; b -= kInterval) {
      if (stored(b)) return b;
    }
    return 0;
  }

  std::filesystem::path dir_;
  static Model* model_;
  static Tokenizer* tokenizer_;
};

Model* ServerPrefix::model_ = nullptr;
Tokenizer* ServerPrefix::tokenizer_ = nullptr;

TEST_F(ServerPrefix, RepeatedPromptHitsAndGivesTheSameText) {
  Server server(options());  // the in-process store
  const int port = server.start();
  const std::string want = solo(kGenesis, 24);
  EXPECT_EQ(complete(port, kGenesis, 24), want);
  const ServerCounters cold = server.counters();
  EXPECT_EQ(cold.prefix_lookups, 1);
  EXPECT_EQ(cold.prefix_hits, 0);
  EXPECT_EQ(cold.prefix_hit_tokens, 0);
  const auto head = static_cast<std::int64_t>(encode(kGenesis).size()) - 1;
  EXPECT_EQ(cold.prefix_entries_written, (head - 1) / kInterval + 1);  // the multiples below head, and head
  EXPECT_EQ(complete(port, kGenesis, 24), want);
  const ServerCounters warm = server.counters();
  EXPECT_EQ(warm.prefix_hits, 1);
  EXPECT_EQ(warm.prefix_hit_tokens, head);
  // A seeded sampled request on the stored prompt: the same tokens as generate() with that seed.
  EXPECT_EQ(complete(port, kGenesis, 16, 0.9f, 7), solo(kGenesis, 16, 0.9f, 7));
  EXPECT_EQ(server.counters().prefix_hit_tokens, 2 * head);
  httplib::Client client("127.0.0.1", port);
  const auto metrics = client.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("rewind_prefix_hits_total 2\n"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("rewind_prefix_hit_tokens_total " + std::to_string(2 * head) + "\n"), std::string::npos)
      << metrics->body;
}

TEST_F(ServerPrefix, ConversationTurnRestoresTheEarlierPrompt) {
  Server server(options());
  const int port = server.start();
  const std::string turn2 = kGenesis + kGenesisMore;
  EXPECT_EQ(complete(port, kGenesis, 12), solo(kGenesis, 12));
  EXPECT_EQ(complete(port, turn2, 12), solo(turn2, 12));
  const std::int64_t hit = expected_hit(encode(kGenesis), encode(turn2));
  ASSERT_GT(hit, 0);
  EXPECT_EQ(server.counters().prefix_hits, 1);
  EXPECT_EQ(server.counters().prefix_hit_tokens, hit);
  // An unrelated prompt shares BOS alone: computed, the same text.
  EXPECT_EQ(complete(port, kPsalm, 12), solo(kPsalm, 12));
  EXPECT_EQ(server.counters().prefix_hits, 1);
}

TEST_F(ServerPrefix, ConcurrentRequestsOnSharedPrefixesEqualTheirSoloText) {
  Server server(options());
  const int port = server.start();
  const std::vector<std::string> prompts = {kGenesis, kGenesis + kGenesisMore, kPsalm, kGenesis + " And"};
  std::vector<std::string> want;
  for (const std::string& p : prompts) want.push_back(solo(p, 10));
  for (int round = 0; round < 2; ++round) {
    std::vector<std::string> got(prompts.size());
    std::vector<std::thread> clients;
    for (std::size_t i = 0; i < prompts.size(); ++i)
      clients.emplace_back([&, i] { got[i] = complete(port, prompts[i], 10); });
    for (std::thread& t : clients) t.join();
    for (std::size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], want[i]) << "round " << round << ", " << i;
  }
  EXPECT_GT(server.counters().prefix_hits, 0);
}

TEST_F(ServerPrefix, OffComputesEveryPrompt) {
  ServerOptions o = options();
  o.prefix_reuse = false;
  Server server(o);
  const int port = server.start();
  for (int i = 0; i < 2; ++i) EXPECT_EQ(complete(port, kGenesis, 8), solo(kGenesis, 8));
  EXPECT_EQ(server.counters().prefix_lookups, 0);
  EXPECT_EQ(server.counters().prefix_hit_tokens, 0);
}

// Two replicas on one store: the second restores what only the first computed.
TEST_F(ServerPrefix, TwoServersShareADirectory) {
  const std::string store = (dir_ / "cache").string();
  const std::string want = solo(kGenesis, 16);
  const auto head = static_cast<std::int64_t>(encode(kGenesis).size()) - 1;
  {
    Server first(options(store));
    EXPECT_EQ(complete(first.start(), kGenesis, 16), want);
    EXPECT_EQ(first.counters().prefix_hit_tokens, 0);
  }
  Server second(options(store));
  const int port = second.start();
  EXPECT_EQ(complete(port, kGenesis, 16), want);
  EXPECT_EQ(second.counters().prefix_hits, 1);
  EXPECT_EQ(second.counters().prefix_hit_tokens, head);

  // The runtime reads the servers' entries and the servers the runtime's:
  // generate() with a prefix cache on the directory restores the prompt but
  // its last token and gives the same tokens ...
  rwd::PrefixCache pc(std::shared_ptr<rwd::BlobStore>(rwd::make_directory_store(store)),
                      rwd::runtime::prefix_cache_options(*model_, kInterval));
  GenerationOptions g;
  g.max_new_tokens = 16;
  g.prefix_cache = &pc;
  rwd::runtime::GenerationStats st;
  EXPECT_EQ(tokenizer_->decode(rwd::runtime::generate(*model_, encode(kGenesis), g, &st), true), want);
  EXPECT_EQ(st.prefix_hit_tokens, head);
  // ... and on that prompt but its last token, a whole hit, decoded from the
  // logits the server stored with the entry ...
  std::vector<std::int32_t> cut = encode(kGenesis);
  cut.pop_back();
  GenerationOptions plain = g;
  plain.prefix_cache = nullptr;
  rwd::runtime::GenerationStats cut_stats;
  EXPECT_EQ(rwd::runtime::generate(*model_, cut, g, &cut_stats), rwd::runtime::generate(*model_, cut, plain));
  EXPECT_EQ(cut_stats.prefix_hit_tokens, head);
  // ... and a prompt only generate() has seen (entries at the multiples of
  // the interval and at its whole length) is restored by the server as far
  // as those entries go.
  EXPECT_EQ(tokenizer_->decode(rwd::runtime::generate(*model_, encode(kPsalm), g), true), solo(kPsalm, 16));
  EXPECT_EQ(complete(port, kPsalm, 16), solo(kPsalm, 16));
  const auto psalm = static_cast<std::int64_t>(encode(kPsalm).size());
  EXPECT_EQ(second.counters().prefix_hit_tokens, head + (psalm - 1) / kInterval * kInterval);
}

TEST_F(ServerPrefix, BadPrefixCacheOptionsAreRefused) {
  const auto refused = [&](const ServerOptions& o, const std::string& names) {
    try {
      Server server(o);
      ADD_FAILURE() << "accepted " << o.prefix_cache;
    } catch (const rwd::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
    }
  };
  for (const char* bad : {"rediss://127.0.0.1:6379", "file:///tmp/x", "redis:/x", "ro:", "redis://127.0.0.1:notaport"})
    refused(options(bad), "--prefix-cache");
  ServerOptions o = options("redis://127.0.0.1:6379");
  o.prefix_cache_bytes = 1 << 20;
  refused(o, "--prefix-cache-bytes");
  o = options();
  o.prefix_interval = 0;
  refused(o, "prefix_interval");
}

#if REWIND_HAVE_REDIS

// The store-failure warnings among `messages` (not those of a slow call,
// which a loaded machine may also cause).
std::vector<std::string> failures(const std::vector<std::string>& messages) {
  std::vector<std::string> out;
  for (const std::string& m : messages) {
    if (m.find("a call took") == std::string::npos) out.push_back(m);
  }
  return out;
}

// Counts the warnings rewind emits while alive (PrefixCache's store
// warnings), passing them on to stderr as the default handler does.
class WarningLog {
 public:
  WarningLog() {
    previous_ = rwd::set_warning_handler([this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mu_);
      messages_.push_back(m);
      std::fprintf(stderr, "%s\n", m.c_str());
    });
  }
  ~WarningLog() { rwd::set_warning_handler(previous_); }
  std::vector<std::string> messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_;
  }

 private:
  rwd::WarningHandler previous_;
  std::mutex mu_;
  std::vector<std::string> messages_;
};

TEST_F(ServerPrefix, RedisSharedByTwoServers) {
  rwd::test::RedisServer redis;
  const std::string want = solo(kGenesis, 16);
  const auto head = static_cast<std::int64_t>(encode(kGenesis).size()) - 1;
  Server first(options(redis.url()));
  Server second(options(redis.url()));
  EXPECT_EQ(complete(first.start(), kGenesis, 16), want);
  EXPECT_EQ(first.counters().prefix_hit_tokens, 0);
  EXPECT_GT(first.counters().prefix_entries_written, 0);
  EXPECT_EQ(complete(second.start(), kGenesis, 16), want);
  EXPECT_EQ(second.counters().prefix_hits, 1);
  EXPECT_EQ(second.counters().prefix_hit_tokens, head);
}

TEST_F(ServerPrefix, RedisKilledMidwayIsAWarningAndRecomputation) {
  WarningLog log;
  auto redis = std::make_unique<rwd::test::RedisServer>();
  Server server(options(redis->url()));
  const int port = server.start();
  const std::string want = solo(kGenesis, 16);
  EXPECT_EQ(complete(port, kGenesis, 16), want);
  EXPECT_EQ(complete(port, kGenesis, 16), want);
  EXPECT_EQ(server.counters().prefix_hits, 1);
  EXPECT_TRUE(failures(log.messages()).empty());
  redis->stop();
  const std::string turn2 = kGenesis + kGenesisMore;
  EXPECT_EQ(complete(port, turn2, 16), solo(turn2, 16));
  EXPECT_EQ(complete(port, kGenesis, 16), want);
  EXPECT_EQ(complete(port, kPsalm, 16), solo(kPsalm, 16));
  EXPECT_EQ(server.counters().prefix_hits, 1);  // nothing restored while the store is down
  EXPECT_GT(server.counters().prefix_store_errors, 0);
  const std::vector<std::string> warnings = failures(log.messages());
  ASSERT_EQ(warnings.size(), 1u);  // once, however many requests
  EXPECT_NE(warnings[0].find("prefix cache"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find(redis->url()), std::string::npos) << warnings[0];
}

#endif  // REWIND_HAVE_REDIS

}  // namespace
