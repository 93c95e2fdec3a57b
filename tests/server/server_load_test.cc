// rewind serve under load: 32 concurrent clients (streaming, and one in four
// not) sending 256 requests in all to a batch of 8, three times. Every greedy
// response must equal runtime::generate() on its prompt alone; after each
// load the decode loop holds no sequence and its cache uses what it used
// before; the cache never reserves more than kMaxBatch times what the
// longest request needs alone (freed blocks are reused), and the third
// load, the same as the second, leaves the process no bigger (no
// per-request leak).
#include <gtest/gtest.h>

#include <httplib.h>
#include <omp.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"
#include "server/server.h"
#include "server/server_test_util.h"

namespace {

using namespace rwt::server;  // json, Model, Tokenizer, Server, ServerOptions, ... (server_test_util.h)

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kUnderAddressSanitizer = true;
#else
constexpr bool kUnderAddressSanitizer = false;
#endif
#else
constexpr bool kUnderAddressSanitizer = false;
#endif

constexpr int kClients = 32;
constexpr int kRequestsPerClient = 8;
constexpr std::int64_t kMaxBatch = 8;

const char* const kPrompts[] = {
    "In the beginning God created",        "And the LORD said unto Moses,",
    "Blessed is the man that walketh not", "The LORD is my shepherd;",
    "And it came to pass, when",           "For God so loved the world,",
    "Now these are the generations of",    "Then answered Jesus and said unto them,",
};
constexpr std::int64_t kMaxTokens[] = {4, 9, 16, 23};

// The process's resident set in bytes (/proc/self/statm's second field).
std::size_t resident_bytes() {
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    long size = 0;
    if (std::fscanf(f, "%ld %ld", &size, &pages) != 2) pages = 0;
    std::fclose(f);
  }
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

// One request's text, streamed (server-sent events, joined) or not; "" and a
// failure when the response is not a complete 200.
std::string complete(int port, const std::string& prompt, std::int64_t max_tokens, bool stream) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(300, 0);
  const json body = {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", stream}};
  if (!stream) {
    const auto res = client.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(res && res->status == 200) << (res ? res->body : "no response: " + httplib::to_string(res.error()));
    if (!res || res->status != 200) return {};
    return json::parse(res->body)["choices"][0]["text"].get<std::string>();
  }
  httplib::Request req = completion_request(body);
  std::string events;
  req.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
    events.append(data, n);
    return true;
  };
  const auto res = client.send(req);
  EXPECT_TRUE(res && res->status == 200) << (res ? std::to_string(res->status) : httplib::to_string(res.error()));
  std::string text;
  bool done = false;
  for (std::size_t at = 0; at < events.size();) {
    const std::size_t end = events.find("\n\n", at);
    if (end == std::string::npos) break;
    const std::string data = events.substr(at + 6, end - at - 6);
    if (data == "[DONE]") {
      done = true;
    } else {
      text += json::parse(data)["choices"][0]["text"].get<std::string>();
    }
    at = end + 2;
  }
  EXPECT_TRUE(done) << "the stream ended without [DONE]";
  return text;
}

// The counters once the server is idle: a finished request's sequence
// leaves at the end of the round that finished it, and its response is
// counted once written, both a moment after its last token reaches the
// client. `completions`: the generation requests answered by then.
ServerCounters idle_counters(const Server& server, std::int64_t completions) {
  ServerCounters c = server.counters();
  for (int i = 0; i < 5000 && (c.live_sequences != 0 || c.running != 0 || c.completions < completions); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    c = server.counters();
  }
  return c;
}

// What generate gives alone for each prompt and max_new_tokens.
using SoloTexts = std::map<std::pair<int, std::int64_t>, std::string>;

SoloTexts solo_decodings(const Model& model, const Tokenizer& tokenizer) {
  SoloTexts expected;
  for (int p = 0; p < static_cast<int>(std::size(kPrompts)); ++p) {
    for (const std::int64_t n : kMaxTokens) {
      GenerationOptions g;
      g.max_new_tokens = n;
      expected[{p, n}] = tokenizer.decode(rwd::runtime::generate(model, tokenizer.encode(kPrompts[p], true), g), true);
    }
  }
  return expected;
}

int longest_prompt(const Tokenizer& tokenizer) {
  int longest = 0;
  for (int p = 1; p < static_cast<int>(std::size(kPrompts)); ++p) {
    if (tokenizer.encode(kPrompts[p], true).size() > tokenizer.encode(kPrompts[longest], true).size()) longest = p;
  }
  return longest;
}

// kClients clients at once, kRequestsPerClient requests each, streaming
// three in four; the number of responses that differ from solo decoding.
int run_load(int port, const SoloTexts& expected) {
  std::atomic<int> mismatches{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      for (int r = 0; r < kRequestsPerClient; ++r) {
        const int p = (c + r) % static_cast<int>(std::size(kPrompts));
        const std::int64_t n = kMaxTokens[(c * 3 + r) % std::size(kMaxTokens)];
        const std::string got = complete(port, kPrompts[p], n, (c + r) % 4 != 0);
        if (got != expected.at({p, n})) {
          ++mismatches;
          ADD_FAILURE() << "client " << c << " request " << r << " (prompt " << p << ", " << n << " tokens): got '"
                        << got << "', solo decoding gives '" << expected.at({p, n}) << "'";
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  return mismatches.load();
}

TEST(ServerLoad, EveryResponseEqualsSoloDecodingAndMemoryComesBack) {
  omp_set_num_threads(1);
  const Model model = Model::load(model_dir());
  const Tokenizer tokenizer = rwd::runtime::tokenizer_for_model(model_dir(), model.config());
  const SoloTexts expected = solo_decodings(model, tokenizer);

  ServerOptions o;
  o.model_dir = model_dir();
  o.port = 0;
  o.threads = 1;
  o.max_batch = kMaxBatch;
  o.http_threads = kClients + 4;  // a streaming client holds its thread
  o.max_prefill_rows = 8;         // prompts join in pieces beside decoding sequences
  Server server(o);
  const int port = server.start();

  const auto load = [&] { return run_load(port, expected); };

  const ServerCounters before = idle_counters(server, 0);
  // The memory of the longest request alone: the pool allocates block by
  // block and keeps freed blocks, so no load of at most kMaxBatch sequences
  // at once can need more than kMaxBatch times it.
  const int longest = longest_prompt(tokenizer);
  const std::int64_t most = kMaxTokens[std::size(kMaxTokens) - 1];
  EXPECT_EQ(complete(port, kPrompts[longest], most, true), expected.at({longest, most}));
  const std::size_t alone = idle_counters(server, before.completions + 1).cache_bytes_reserved;
  // Builds with REWIND_DEBUG_VIEWS (the sanitizer builds) free a released
  // block at once, so that a stale view's read is reported; the others keep
  // it for the next request.
  const bool keeps_blocks = alone > before.cache_bytes_reserved;
  EXPECT_EQ(load(), 0);
  const ServerCounters first = idle_counters(server, before.completions + 1 + kClients * kRequestsPerClient);
  // The allocator's arenas and the thread stacks' pages settle over the
  // first loads (about 1 MiB more after the second here, then level): the
  // leak check compares the third load with the second.
  EXPECT_EQ(load(), 0);
  const std::size_t rss_second = resident_bytes();
  EXPECT_EQ(load(), 0);
  const ServerCounters third = idle_counters(server, before.completions + 1 + 3 * kClients * kRequestsPerClient);
  const std::size_t rss_third = resident_bytes();

  EXPECT_EQ(third.completions - before.completions, 3 * kClients * kRequestsPerClient + 1);
  EXPECT_EQ(third.cancelled, before.cancelled);
  EXPECT_GT(first.peak_batch, 1) << "the load never batched";
  EXPECT_LE(third.peak_batch, kMaxBatch);
  for (const ServerCounters* c : {&first, &third}) {
    EXPECT_EQ(c->live_sequences, 0);
    EXPECT_EQ(c->running, 0);
    EXPECT_EQ(c->waiting, 0);
    EXPECT_EQ(c->cache_bytes_used, before.cache_bytes_used) << "a finished request left state behind";
  }
  if (keeps_blocks) {
    EXPECT_LE(third.cache_bytes_reserved, static_cast<std::size_t>(kMaxBatch) * alone)
        << "the loads reserved more than " << kMaxBatch << " times the longest request alone (" << alone
        << " bytes): freed blocks were not reused";
  } else {
    EXPECT_EQ(third.cache_bytes_reserved, before.cache_bytes_reserved) << "a released block was kept";
  }
  // 256 requests: a leak of even 16 KiB each would be 4 MiB. (ASan keeps
  // freed memory in quarantine and reports leaks itself.)
  if (!kUnderAddressSanitizer) {
    EXPECT_LT(rss_third, rss_second + (4u << 20))
        << "resident memory grew by " << (rss_third - rss_second) << " bytes over a load that the one before equalled";
  }
  std::printf(
      "load: %lld forwards, peak batch %lld, cache reserved %zu bytes (longest request alone: %zu), resident "
      "%zu -> %zu bytes\n",
      static_cast<long long>(third.forwards), static_cast<long long>(third.peak_batch), third.cache_bytes_reserved,
      alone, rss_second, rss_third);
}

}  // namespace
