// rewind serve with speculation (ServerOptions::lookup / draft_dir): every
// greedy response, whatever else is in the batch, equals runtime::generate()
// on its prompt alone; a seeded sampled one equals
// runtime::speculative_generate() with the same draft source and seed alone
// (so it is reproducible); max_tokens and stop strings hold inside an
// accepted run of drafts.
#include <gtest/gtest.h>

#include <httplib.h>
#include <omp.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"
#include "server/server.h"
#include "server/server_test_util.h"

namespace {

using namespace rwt::server;  // json, Model, Tokenizer, Server, ServerOptions, ... (server_test_util.h)

std::string target_dir() { return rwt::server::model_dir(); }
std::string small_draft_dir() { return std::string(REWIND_SOURCE_DIR) + "/models/kjv-draft"; }

// Prompts whose continuations repeat what came before (prompt lookup finds
// them) and others.
const char* const kPrompts[] = {
    "And God said, Let there be light: and there was light. And God saw the light, that it was good. And God said, "
    "Let there be light",
    "In the beginning",
    "the LORD, the LORD, the LORD, the LORD, the LORD, the LORD,",
    "And it came to pass, when men began to multiply on the face of the earth, and daughters were born unto them,",
    "Blessed are the poor in spirit. Blessed are they that mourn. Blessed are the meek. Blessed are",
    "A",
};
constexpr int kNumPrompts = 6;

struct SpecServer {
  std::unique_ptr<Server> server;
  int port = 0;
};

// A server over the shipped target (or o.model_dir) with the speculation
// `o` asks for.
SpecServer start(ServerOptions o) {
  if (o.model_dir.empty()) o.model_dir = target_dir();
  o.port = 0;
  o.threads = 1;
  o.max_batch = 3;          // fewer than the concurrent tests' clients: some wait and join
  o.max_prefill_rows = 16;  // long prompts go in several rounds, beside verifying sequences
  SpecServer s;
  s.server = std::make_unique<Server>(o);
  s.port = s.server->start();
  return s;
}

httplib::Result post(int port, const json& body) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(120, 0);
  return client.Post("/v1/completions", body.dump(), "application/json");
}

// The text and finish reason of a response, streamed (the chunks joined) or not.
struct Answer {
  std::string text;
  std::string finish_reason;
  std::int64_t completion_tokens = -1;
  bool ok = false;
};

Answer complete(int port, json body, bool stream) {
  body["stream"] = stream;
  if (stream) body["stream_options"] = {{"include_usage", true}};
  const auto res = post(port, body);
  Answer a;
  if (!res || res->status != 200) return a;
  if (!stream) {
    const json j = json::parse(res->body);
    a.text = j["choices"][0]["text"];
    a.finish_reason = j["choices"][0]["finish_reason"];
    a.completion_tokens = j["usage"]["completion_tokens"];
    a.ok = true;
    return a;
  }
  std::size_t at = 0;
  const std::string& b = res->body;
  while (at < b.size()) {
    const std::size_t end = b.find("\n\n", at);
    if (end == std::string::npos || b.compare(at, 6, "data: ") != 0) return a;
    const std::string data = b.substr(at + 6, end - at - 6);
    at = end + 2;
    if (data == "[DONE]") {
      a.ok = true;
      break;
    }
    const json c = json::parse(data);
    if (c.contains("usage") && c["usage"].is_object()) a.completion_tokens = c["usage"]["completion_tokens"];
    if (c["choices"].empty()) continue;
    a.text += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) a.finish_reason = c["choices"][0]["finish_reason"];
  }
  return a;
}

// The counters once the decode loop has released every sequence (its
// gauges follow at the end of a round, after the responses went out).
ServerCounters settled(const Server& server) {
  ServerCounters c;
  for (int i = 0; i < 6000; ++i) {
    c = server.counters();
    if (c.live_sequences == 0 && c.running == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return c;
}

class ServerSpeculationTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);  // the test's own decoding beside the server's (as server_test.cc)
    load_model(target_dir(), model_, tokenizer_);
  }
  static void TearDownTestSuite() { unload_model(model_, tokenizer_); }

  std::vector<std::int32_t> encode(const std::string& text) { return tokenizer_->encode(text, true); }

  // runtime::generate() on `text` alone.
  std::vector<std::int32_t> solo(const std::string& text, std::int64_t max_tokens) {
    GenerationOptions options;
    options.max_new_tokens = max_tokens;
    return rwd::runtime::generate(*model_, encode(text), options);
  }
  std::string text(const std::vector<std::int32_t>& tokens) { return tokenizer_->decode(tokens, true); }

  // Several concurrent clients, every other one streamed, each asking for
  // a greedy completion of its prompt; each response must be generate()'s.
  void expect_concurrent_greedy_equal_solo(int port) {
    constexpr int kClients = 8;
    std::vector<std::string> expected;
    std::vector<std::int64_t> max_tokens;
    for (int i = 0; i < kClients; ++i) {
      max_tokens.push_back(23 + 5 * i);
      expected.push_back(text(solo(kPrompts[i % kNumPrompts], max_tokens.back())));
    }
    std::vector<Answer> got(kClients);
    std::vector<std::thread> threads;
    for (int i = 0; i < kClients; ++i) {
      threads.emplace_back([&, i] {
        got[i] = complete(port,
                          {{"prompt", kPrompts[i % kNumPrompts]}, {"max_tokens", max_tokens[i]}, {"temperature", 0}},
                          i % 2 == 1);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < kClients; ++i) {
      EXPECT_TRUE(got[i].ok) << "client " << i;
      EXPECT_EQ(got[i].text, expected[i]) << "client " << i << (i % 2 == 1 ? " (streamed)" : "");
    }
  }

  static Model* model_;
  static Tokenizer* tokenizer_;
};

Model* ServerSpeculationTest::model_ = nullptr;
Tokenizer* ServerSpeculationTest::tokenizer_ = nullptr;

TEST_F(ServerSpeculationTest, LookupGreedyClientsEachEqualGenerateAlone) {
  ServerOptions o;
  o.lookup = 3;
  o.num_draft = 4;
  SpecServer s = start(o);
  expect_concurrent_greedy_equal_solo(s.port);
  const ServerCounters c = settled(*s.server);
  EXPECT_GT(c.drafted, 0);
  EXPECT_GT(c.accepted, 0) << "the repetitive prompts should have drafts accepted";
  EXPECT_LE(c.accepted, c.drafted);
  EXPECT_EQ(c.live_sequences, 0);
}

// Speculation on a prompt restored from the prefix cache: with an entry
// every 8 tokens and prompts fed 16 rows at a time, a repeated prompt starts
// from its stored prefix (all but its last token), a longer one that
// extends it from the shorter's boundaries, and each still speculates and
// equals generate() alone, with the lookup draft and with the draft model.
TEST_F(ServerSpeculationTest, PromptsRestoredFromThePrefixCacheSpeculateAndEqualGenerateAlone) {
  for (const bool model_draft : {false, true}) {
    SCOPED_TRACE(model_draft ? "draft model" : "lookup");
    ServerOptions o;
    if (model_draft) {
      o.draft_dir = small_draft_dir();
    } else {
      o.lookup = 3;
    }
    o.prefix_interval = 8;
    SpecServer s = start(o);
    const std::string first = kPrompts[3];
    const std::string longer = first + " that the sons of God saw the daughters of men";
    for (const std::string& prompt : {first, first, longer, longer}) {
      const Answer a = complete(s.port, {{"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0}}, false);
      EXPECT_TRUE(a.ok);
      EXPECT_EQ(a.text, text(solo(prompt, 40))) << prompt;
    }
    const ServerCounters c = settled(*s.server);
    const auto head = [&](const std::string& p) { return static_cast<std::int64_t>(encode(p).size()) - 1; };
    // The first `first` computes; the second restores all of its head; the
    // first `longer` restores `first`'s last boundary at or below its head
    // (a multiple of 8: the entries end there), the second all of its head.
    const std::int64_t shared = head(first) / 8 * 8;
    EXPECT_EQ(c.prefix_hits, 3);
    EXPECT_EQ(c.prefix_hit_tokens, head(first) + shared + head(longer));
    EXPECT_GT(c.drafted, 0);
    EXPECT_GT(c.accepted, 0);
    EXPECT_EQ(c.live_sequences, 0);
  }
}

TEST_F(ServerSpeculationTest, LookupOnARepetitivePromptCountsDraftsInMetrics) {
  ServerOptions o;
  o.lookup = 2;
  SpecServer s = start(o);
  const Answer a = complete(s.port, {{"prompt", kPrompts[2]}, {"max_tokens", 40}, {"temperature", 0}}, false);
  EXPECT_EQ(a.text, text(solo(kPrompts[2], 40)));
  const ServerCounters c = s.server->counters();
  EXPECT_GT(c.drafted, 0);
  EXPECT_GT(c.accepted, 0);
  EXPECT_LT(c.forwards, 40) << "accepted drafts should save forwards";
  httplib::Client client("127.0.0.1", s.port);
  const auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  const auto value = [&](const std::string& metric) {
    std::smatch m;
    const std::regex line("\n" + metric + " (\\d+)\n");
    return std::regex_search(res->body, m, line) ? std::stoll(m[1]) : -1;
  };
  EXPECT_EQ(value("rewind_draft_tokens_total"), c.drafted) << res->body;
  EXPECT_EQ(value("rewind_accepted_tokens_total"), c.accepted) << res->body;
  EXPECT_EQ(value("rewind_generated_tokens_total"), 40) << res->body;
  EXPECT_NE(res->body.find("# TYPE rewind_draft_tokens_total counter"), std::string::npos);
}

TEST_F(ServerSpeculationTest, DraftModelGreedyClientsEachEqualGenerateAlone) {
  ServerOptions o;
  o.draft_dir = small_draft_dir();  // a smaller model with the same vocabulary
  o.num_draft = 3;
  o.adaptive = true;
  SpecServer s = start(o);
  expect_concurrent_greedy_equal_solo(s.port);
  const ServerCounters c = settled(*s.server);
  EXPECT_GT(c.drafted, 0);
  EXPECT_EQ(c.live_sequences, 0);
}

TEST_F(ServerSpeculationTest, TheModelAsItsOwnDraftHasEveryGreedyDraftAccepted) {
  ServerOptions o;
  o.draft_dir = target_dir();
  o.num_draft = 5;
  SpecServer s = start(o);
  expect_concurrent_greedy_equal_solo(s.port);
  const ServerCounters c = settled(*s.server);
  EXPECT_GT(c.drafted, 0);
  EXPECT_EQ(c.accepted, c.drafted) << "a perfect draft";
}

TEST_F(ServerSpeculationTest, MaxTokensCutsInsideAnAcceptedRun) {
  // A perfect draft accepts every draft: with K = 5 the first verify emits 6
  // tokens; max_tokens 4 and 8 end inside such runs.
  ServerOptions o;
  o.draft_dir = target_dir();
  o.num_draft = 5;
  SpecServer s = start(o);
  for (const std::int64_t max_tokens : {1, 4, 8}) {
    const std::vector<std::int32_t> expected = solo(kPrompts[1], max_tokens);
    ASSERT_FALSE(model_->config().is_eos(expected.back()));
    for (const bool stream : {false, true}) {
      SCOPED_TRACE("max_tokens " + std::to_string(max_tokens) + (stream ? " streamed" : ""));
      const ServerCounters before = s.server->counters();
      const Answer a = complete(s.port, {{"prompt", kPrompts[1]}, {"max_tokens", max_tokens}, {"temperature", 0}},
                                stream);
      EXPECT_EQ(a.text, text(expected));
      EXPECT_EQ(a.completion_tokens, max_tokens);
      EXPECT_EQ(a.finish_reason, "length");
      EXPECT_EQ(s.server->counters().generated_tokens - before.generated_tokens, max_tokens);
    }
  }
  // The same through prompt lookup on a prompt whose drafts are accepted.
  ServerOptions l;
  l.lookup = 3;
  l.num_draft = 8;
  SpecServer ls = start(l);
  const std::vector<std::int32_t> expected = solo(kPrompts[2], 13);
  const Answer a = complete(ls.port, {{"prompt", kPrompts[2]}, {"max_tokens", 13}, {"temperature", 0}}, false);
  EXPECT_EQ(a.text, text(expected));
  EXPECT_EQ(a.completion_tokens, 13);
  EXPECT_EQ(ls.server->counters().generated_tokens, 13);
}

// A copy of the shipped model (never trained to emit its EOS) whose config
// names `eos` as its EOS instead; removed with the object.
struct ModelWithEos {
  std::filesystem::path dir;
  explicit ModelWithEos(std::int32_t eos) {
    dir = std::filesystem::temp_directory_path() / ("rwd_spec_eos_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    std::filesystem::copy_file(target_dir() + "/model.safetensors", dir / "model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    std::ifstream in(target_dir() + "/config.json");
    json config = json::parse(in);
    config["eos_token_id"] = eos;
    std::ofstream(dir / "config.json") << config.dump();
  }
  ~ModelWithEos() { std::filesystem::remove_all(dir); }
};

TEST_F(ServerSpeculationTest, EosEndsTheResponseInsideAnAcceptedRun) {
  // The model, with ' ' as its EOS, drafting for itself: every draft is
  // accepted, so the first round verifies 6 drafts and the EOS (the first
  // space the model writes) comes inside that run; the response ends with
  // it, as generate() ends.
  const ModelWithEos copy(' ');
  const Model model = Model::load(copy.dir.string());
  const std::vector<std::int32_t> prompt = encode("And God said, Let there be light: and");
  GenerationOptions options;
  options.max_new_tokens = 40;
  const std::vector<std::int32_t> expected = rwd::runtime::generate(model, prompt, options);
  ASSERT_TRUE(model.config().is_eos(expected.back()));
  ASSERT_LT(expected.size(), 7u) << "the EOS should come within the first round";
  const Tokenizer tokenizer = rwd::runtime::tokenizer_for_model(copy.dir.string(), model.config());
  ServerOptions o;
  o.model_dir = copy.dir.string();
  o.draft_dir = copy.dir.string();
  o.num_draft = 6;
  SpecServer s = start(o);
  for (const bool stream : {false, true}) {
    const Answer a = complete(s.port, {{"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0}}, stream);
    EXPECT_EQ(a.text, tokenizer.decode(expected, true)) << stream;
    EXPECT_EQ(a.completion_tokens, static_cast<std::int64_t>(expected.size())) << stream;
    EXPECT_EQ(a.finish_reason, "stop") << stream;
  }
  EXPECT_EQ(settled(*s.server).generated_tokens, 2 * static_cast<std::int64_t>(expected.size()));
}

TEST_F(ServerSpeculationTest, SeededSampledRequestsAreReproducibleAndExact) {
  const std::string prompt = kPrompts[0];
  const json body = {{"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0.8}, {"seed", 4321}};
  GenerationOptions options;
  options.max_new_tokens = 40;
  options.sampling.temperature = 0.8f;
  options.sampling.seed = 4321;
  options.speculation.num_draft = 4;
  {
    ServerOptions o;
    o.lookup = 3;
    o.num_draft = 4;
    SpecServer s = start(o);
    rwd::runtime::LookupDraft lookup(3);
    const std::string expected = text(rwd::runtime::speculative_generate(*model_, lookup, encode(prompt), options));
    // Twice, the second time beside other requests.
    EXPECT_EQ(complete(s.port, body, false).text, expected);
    std::thread other([&] { complete(s.port, {{"prompt", kPrompts[3]}, {"max_tokens", 30}}, true); });
    EXPECT_EQ(complete(s.port, body, true).text, expected);
    other.join();
    EXPECT_NE(expected, text(solo(prompt, 40))) << "temperature 0.8 should sample another continuation";
  }
  {
    // The server's draft model drafts greedily for sampled requests too.
    ServerOptions o;
    o.draft_dir = small_draft_dir();
    o.num_draft = 4;
    SpecServer s = start(o);
    const Model draft = Model::load(small_draft_dir());
    rwd::runtime::ModelDraft source(draft, rwd::runtime::SamplingParams{}, 4);
    const std::string expected = text(rwd::runtime::speculative_generate(*model_, source, encode(prompt), options));
    EXPECT_EQ(complete(s.port, body, false).text, expected);
    EXPECT_EQ(complete(s.port, body, false).text, expected);
  }
}

TEST_F(ServerSpeculationTest, StopStringsAndCancellationStillWork) {
  ServerOptions o;
  o.lookup = 3;
  SpecServer s = start(o);
  const std::string full = text(solo(kPrompts[0], 60));
  ASSERT_GE(full.size(), 30u);
  const std::string stop = full.substr(20, 3);
  const Answer a = complete(s.port, {{"prompt", kPrompts[0]}, {"max_tokens", 60}, {"temperature", 0}, {"stop", stop}},
                            true);
  EXPECT_EQ(a.text, full.substr(0, full.find(stop)));
  EXPECT_EQ(a.finish_reason, "stop");
  // A client that leaves mid-stream: its sequence (and its draft state) goes.
  httplib::Client client("127.0.0.1", s.port);
  httplib::Request req = completion_request(
      json{{"prompt", kPrompts[2]}, {"max_tokens", 3000}, {"temperature", 0}, {"stream", true}});
  int chunks = 0;
  req.content_receiver = [&](const char*, std::size_t, std::uint64_t, std::uint64_t) { return ++chunks < 2; };
  client.send(req);
  ServerCounters now;
  for (int i = 0; i < 6000; ++i) {
    now = s.server->counters();
    if (now.cancelled > 0 && now.live_sequences == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(now.cancelled, 0);
  EXPECT_EQ(now.live_sequences, 0);
  EXPECT_LT(now.generated_tokens, 3000);
  // And the server still answers exactly afterwards.
  EXPECT_EQ(complete(s.port, {{"prompt", kPrompts[1]}, {"max_tokens", 20}, {"temperature", 0}}, false).text,
            text(solo(kPrompts[1], 20)));
}

TEST(ServerSpeculationOptions, BadOptionsAreRefusedNamingTheOption) {
  const auto refused = [](ServerOptions o, const std::string& named) {
    o.model_dir = target_dir();
    o.port = 0;
    try {
      Server s(o);
      ADD_FAILURE() << "accepted; expected a refusal naming " << named;
    } catch (const rwd::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  };
  ServerOptions o;
  o.lookup = 2;
  o.num_draft = 0;
  refused(o, "num_draft");
  o.num_draft = rwd::runtime::kMaxDraft + 1;
  refused(o, "num_draft");
  o = {};
  o.lookup = -1;
  refused(o, "lookup");
  o.lookup = rwd::runtime::kMaxDraft + 1;
  refused(o, "lookup");
  o = {};
  o.lookup = 2;
  o.draft_dir = small_draft_dir();
  refused(o, "draft_dir");
  // A draft whose EOS is another id: its tokens would not mean the model's.
  const auto other = std::filesystem::temp_directory_path() / ("rwd_spec_draft_" + std::to_string(::getpid()));
  std::filesystem::create_directories(other);
  for (const auto& entry : std::filesystem::directory_iterator(small_draft_dir())) {
    std::filesystem::copy(entry.path(), other / entry.path().filename(),
                          std::filesystem::copy_options::overwrite_existing | std::filesystem::copy_options::recursive);
  }
  {
    std::ifstream in(other / "config.json");
    json config = json::parse(in);
    config["eos_token_id"] = 0;
    std::ofstream(other / "config.json") << config.dump();
  }
  o = {};
  o.draft_dir = other.string();
  refused(o, "draft_dir");
  std::filesystem::remove_all(other);
}

}  // namespace
