// rewind serve with n > 1: several choices for one prompt, the prompt
// prefilled once and the other choices forked from it. Every choice i is
// compared with runtime::generate() on the prompt alone with the request's
// seed + i (greedy: every choice equals generate()); the server's counters
// show the forks and that every choice's state goes back.
#include <gtest/gtest.h>

#include <httplib.h>
#include <omp.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
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

constexpr std::int64_t kMaxBatch = 4;

const char* const kPrompt = "And God said, Let there be light";
const char* const kOtherPrompt = "The LORD is my shepherd; I shall not want.";

std::vector<std::string> events(const std::string& body) { return rwt::server::sse_data(body); }

// A stream's choices as the client reassembles them, checked on the way:
// every chunk holds one choice, a choice's chunk with a finish_reason is its
// last, the usage chunk (choices []) comes after every choice's end, then
// [DONE].
struct Stream {
  std::map<std::int64_t, std::string> text;
  std::map<std::int64_t, std::string> finish_reason;
  json usage;
};

Stream reassemble(const std::string& body, bool chat) {
  Stream s;
  const std::vector<std::string> ev = events(body);
  EXPECT_FALSE(ev.empty());
  if (ev.empty()) return s;
  EXPECT_EQ(ev.back(), "[DONE]");
  for (std::size_t i = 0; i + 1 < ev.size(); ++i) {
    const json c = json::parse(ev[i]);
    EXPECT_EQ(c["object"], chat ? "chat.completion.chunk" : "text_completion");
    if (c["choices"].empty()) {  // the usage chunk: after every choice ended
      EXPECT_EQ(i + 2, ev.size()) << "the usage chunk is not the last before [DONE]";
      s.usage = c["usage"];
      continue;
    }
    EXPECT_EQ(c["choices"].size(), 1u) << ev[i];
    const json& choice = c["choices"][0];
    const std::int64_t index = choice["index"];
    EXPECT_EQ(s.finish_reason.count(index), 0u) << "choice " << index << " has a chunk after its end";
    if (chat) {
      const json& delta = choice["delta"];
      if (delta.contains("content")) s.text[index] += delta["content"].get<std::string>();
    } else {
      s.text[index] += choice["text"].get<std::string>();
    }
    if (!choice["finish_reason"].is_null()) s.finish_reason[index] = choice["finish_reason"];
  }
  return s;
}

class ServerNTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);  // as server_test.cc: the test's decoding beside the server's
    load_model(model_dir(), model_, tokenizer_);
    // The model again with a chat template (server_test.cc's ChatServerTest).
    dir_ = std::filesystem::temp_directory_path() / ("rwd_n_server_" + std::to_string(::getpid()));
    rwt::server::make_chat_model(dir_,
                                 "{%- for m in messages %}{{- m.role }}: {{ m.content | trim }}{{ '\\n' }}{%- endfor %}"
                                 "{%- if add_generation_prompt %}assistant:{% endif %}");
    ServerOptions o;
    o.model_dir = dir_.string();
    o.model_name = "kjv";
    o.port = 0;
    o.max_batch = kMaxBatch;
    o.max_prefill_rows = 16;  // the prompts go in several rounds
    o.prefix_interval = 16;   // and store prefix-cache entries: a repeated prompt is restored, then forked
    o.threads = 1;
    port_ = start_server(o, server_);
    baseline_ = new ServerCounters(server_->counters());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete baseline_;
    unload_model(model_, tokenizer_);
    std::filesystem::remove_all(dir_);
  }

  // generate() on `text` alone.
  static std::string solo(const std::string& text, std::int64_t max_tokens, float temperature, std::uint64_t seed,
                          std::vector<std::int32_t>* tokens = nullptr) {
    GenerationOptions options;
    options.max_new_tokens = max_tokens;
    options.sampling.temperature = temperature;
    options.sampling.seed = seed;
    const std::vector<std::int32_t> out = rwd::runtime::generate(*model_, tokenizer_->encode(text, true), options);
    if (tokens) *tokens = out;
    return tokenizer_->decode(out, true);
  }
  static std::int64_t prompt_tokens(const std::string& text) {
    return static_cast<std::int64_t>(tokenizer_->encode(text, true).size());
  }

  static httplib::Result post(const std::string& path, const json& body) {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(120, 0);
    return client.Post(path.c_str(), body.dump(), "application/json");
  }
  static json post_json(const std::string& path, const json& body) {
    const auto res = post(path, body);
    EXPECT_TRUE(res) << "no response from " << path;
    if (!res) return {};
    EXPECT_EQ(res->status, 200) << res->body;
    return json::parse(res->body);
  }

  // The counters once the decode loop has retired every sequence (a
  // response reaches the client a moment before the round that finished it
  // ends); then no state is left behind.
  static ServerCounters idle() {
    ServerCounters c = server_->counters();
    for (int i = 0; i < 6000 && (c.live_sequences != 0 || c.running != 0); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      c = server_->counters();
    }
    EXPECT_EQ(c.live_sequences, 0);
    EXPECT_EQ(c.running, 0);
    EXPECT_EQ(c.cache_bytes_used, baseline_->cache_bytes_used) << "a finished choice left state behind";
    return c;
  }

  static std::filesystem::path dir_;
  static Model* model_;
  static Tokenizer* tokenizer_;
  static Server* server_;
  static ServerCounters* baseline_;
  static int port_;
};

std::filesystem::path ServerNTest::dir_;
Model* ServerNTest::model_ = nullptr;
Tokenizer* ServerNTest::tokenizer_ = nullptr;
Server* ServerNTest::server_ = nullptr;
ServerCounters* ServerNTest::baseline_ = nullptr;
int ServerNTest::port_ = 0;

TEST_F(ServerNTest, GreedyChoicesEachEqualGenerateAndForkOnce) {
  std::vector<std::int32_t> tokens;
  const std::string expected = solo(kPrompt, 24, 0.0f, 0, &tokens);
  const ServerCounters before = server_->counters();
  const json j = post_json("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 24}, {"temperature", 0}, {"n", 3}});
  ASSERT_EQ(j["choices"].size(), 3u) << j;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], expected) << "choice " << i;
    EXPECT_EQ(j["choices"][i]["finish_reason"], "length");
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens(kPrompt));  // the prompt once
  EXPECT_EQ(j["usage"]["completion_tokens"], 3 * tokens.size());
  EXPECT_EQ(j["usage"]["total_tokens"], prompt_tokens(kPrompt) + 3 * static_cast<std::int64_t>(tokens.size()));
  const ServerCounters after = idle();
  EXPECT_EQ(after.forks - before.forks, 2);
  EXPECT_EQ(after.prompt_tokens - before.prompt_tokens, prompt_tokens(kPrompt)) << "the prompt was admitted twice";
  EXPECT_EQ(after.generated_tokens - before.generated_tokens, 3 * static_cast<std::int64_t>(tokens.size()));
  EXPECT_LE(after.peak_batch, kMaxBatch);
}

TEST_F(ServerNTest, SampledChoiceIEqualsGenerateWithSeedPlusI) {
  constexpr std::uint64_t kSeed = 4321;
  std::vector<std::string> expected;
  std::int64_t tokens = 0;
  for (std::uint64_t i = 0; i < 4; ++i) {
    std::vector<std::int32_t> t;
    expected.push_back(solo(kPrompt, 32, 0.9f, kSeed + i, &t));
    tokens += static_cast<std::int64_t>(t.size());
  }
  EXPECT_NE(expected[0], expected[1]) << "seeds 4321 and 4322 should sample other continuations";
  const ServerCounters before = server_->counters();
  const json j = post_json("/v1/completions",
                           {{"prompt", kPrompt}, {"max_tokens", 32}, {"temperature", 0.9}, {"seed", kSeed}, {"n", 4}});
  ASSERT_EQ(j["choices"].size(), 4u) << j;
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], expected[i]) << "choice " << i;
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens(kPrompt));
  EXPECT_EQ(j["usage"]["completion_tokens"], tokens);
  EXPECT_EQ(idle().forks - before.forks, 3);
  // Choice 0 of an n = 4 request is the n = 1 request with that seed.
  const json one = post_json(
      "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 32}, {"temperature", 0.9}, {"seed", kSeed}, {"n", 1}});
  ASSERT_EQ(one["choices"].size(), 1u);
  EXPECT_EQ(one["choices"][0]["text"], expected[0]);
  EXPECT_EQ(idle().forks - before.forks, 3) << "n = 1 forked";
}

TEST_F(ServerNTest, ARestoredPromptForksAsAComputedOne) {
  const std::string prompt = "And the evening and the morning were the first day. And God said,";
  std::vector<std::string> expected;
  for (std::uint64_t i = 0; i < 3; ++i) expected.push_back(solo(prompt, 24, 0.9f, 500 + i));
  const json body = {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0.9}, {"seed", 500}, {"n", 3}};
  for (const bool restored : {false, true}) {
    SCOPED_TRACE(restored ? "restored" : "computed");
    const ServerCounters before = server_->counters();
    const json j = post_json("/v1/completions", body);
    ASSERT_EQ(j["choices"].size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(j["choices"][i]["text"], expected[i]) << "choice " << i;
    const ServerCounters after = idle();
    EXPECT_EQ(after.forks - before.forks, 2);
    EXPECT_EQ(after.prefix_lookups - before.prefix_lookups, 1) << "the prompt was looked up once per request";
    // The first request stored its prompt but the last token (entries every
    // 16 tokens and one at its end); the second restores all of it.
    const std::int64_t head = prompt_tokens(prompt) - 1;
    EXPECT_EQ(after.prefix_hit_tokens - before.prefix_hit_tokens, restored ? head : 0);
  }
}

TEST_F(ServerNTest, StreamedChoicesReassembleToTheNonStreamedOnes) {
  const json body = {{"prompt", kOtherPrompt}, {"max_tokens", 30}, {"temperature", 0.9}, {"seed", 77}, {"n", 3}};
  const json whole = post_json("/v1/completions", body);
  ASSERT_EQ(whole["choices"].size(), 3u);
  json streamed = body;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const auto res = post("/v1/completions", streamed);
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  const Stream s = reassemble(res->body, false);
  ASSERT_EQ(s.text.size(), 3u);
  for (std::int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(s.text.at(i), whole["choices"][i]["text"]) << "choice " << i;
    EXPECT_EQ(s.text.at(i), solo(kOtherPrompt, 30, 0.9f, 77 + static_cast<std::uint64_t>(i))) << "choice " << i;
    ASSERT_EQ(s.finish_reason.count(i), 1u) << "choice " << i << " has no final chunk";
    EXPECT_EQ(s.finish_reason.at(i), whole["choices"][i]["finish_reason"]);
  }
  EXPECT_EQ(s.usage, whole["usage"]);
  idle();
}

TEST_F(ServerNTest, AStopStringEndsItsChoiceOnly) {
  constexpr std::uint64_t kSeed = 99;
  std::vector<std::string> full;
  for (std::uint64_t i = 0; i < 3; ++i) full.push_back(solo(kPrompt, 40, 0.9f, kSeed + i));
  // Four characters of choice 0 that neither other choice holds.
  std::string stop;
  for (std::size_t at = 4; at + 4 <= full[0].size() && stop.empty(); ++at) {
    const std::string s = full[0].substr(at, 4);
    if (full[1].find(s) == std::string::npos && full[2].find(s) == std::string::npos) stop = s;
  }
  ASSERT_FALSE(stop.empty()) << "no stop string only choice 0 holds in: " << full[0];
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streaming" : "one response");
    const json body = {{"prompt", kPrompt}, {"max_tokens", 40}, {"temperature", 0.9}, {"seed", kSeed}, {"n", 3},
                       {"stop", stop},      {"stream", stream}};
    std::vector<std::string> text(3), reason(3);
    if (stream) {
      const auto res = post("/v1/completions", body);
      ASSERT_TRUE(res);
      ASSERT_EQ(res->status, 200) << res->body;
      const Stream s = reassemble(res->body, false);
      ASSERT_EQ(s.finish_reason.size(), 3u);
      for (std::int64_t i = 0; i < 3; ++i) {
        text[static_cast<std::size_t>(i)] = s.text.count(i) ? s.text.at(i) : "";
        reason[static_cast<std::size_t>(i)] = s.finish_reason.at(i);
      }
    } else {
      const json j = post_json("/v1/completions", body);
      ASSERT_EQ(j["choices"].size(), 3u);
      for (std::size_t i = 0; i < 3; ++i) {
        text[i] = j["choices"][i]["text"];
        reason[i] = j["choices"][i]["finish_reason"];
      }
    }
    EXPECT_EQ(text[0], full[0].substr(0, full[0].find(stop)));
    EXPECT_EQ(reason[0], "stop");
    for (std::size_t i = 1; i < 3; ++i) {
      EXPECT_EQ(text[i], full[i]) << "choice " << i;
      EXPECT_EQ(reason[i], "length") << "choice " << i;
    }
    idle();
  }
}

TEST_F(ServerNTest, NOutOfRangeOrOfTheWrongTypeIsRefused) {
  for (const json& n : {json(0), json(-1), json(kMaxBatch + 1), json(std::uint64_t{1} << 63), json("2"), json(1.5),
                        json(true), json::array({2})}) {
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      const json body = {{"prompt", kPrompt}, {"messages", {{{"role", "user"}, {"content", "x"}}}}, {"n", n}};
      const auto res = post(path, body);
      ASSERT_TRUE(res);
      EXPECT_EQ(res->status, 400) << path << " n = " << n.dump() << ": " << res->body;
      const json e = json::parse(res->body)["error"];
      EXPECT_EQ(e["param"], "n") << res->body;
      EXPECT_EQ(e["code"], n.is_number_integer() ? "invalid_value" : "invalid_type") << res->body;
    }
  }
  // n = max_batch is allowed, null is the default.
  const json j = post_json("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 2}, {"n", kMaxBatch}});
  EXPECT_EQ(j["choices"].size(), static_cast<std::size_t>(kMaxBatch));
  EXPECT_EQ(post_json("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 2}, {"n", nullptr}})["choices"].size(),
            1u);
  idle();
}

TEST_F(ServerNTest, MaxTokensZeroGivesNEmptyChoices) {
  const json j = post_json("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 0}, {"n", 3}});
  ASSERT_EQ(j["choices"].size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], "");
    EXPECT_EQ(j["choices"][i]["finish_reason"], "length");
  }
  EXPECT_EQ(j["usage"]["completion_tokens"], 0);
}

TEST_F(ServerNTest, ChatWithNTwoEqualsGenerateOnTheRenderedConversation) {
  const std::string rendered = "user: In the beginning\nassistant:";
  const json messages = json::array({{{"role", "user"}, {"content", "In the beginning"}}});
  const json body = {{"model", "kjv"}, {"messages", messages}, {"max_tokens", 20}, {"temperature", 0.9}, {"seed", 5},
                     {"n", 2}};
  const json j = post_json("/v1/chat/completions", body);
  EXPECT_EQ(j["object"], "chat.completion");
  ASSERT_EQ(j["choices"].size(), 2u) << j;
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["message"]["role"], "assistant");
    EXPECT_EQ(j["choices"][i]["message"]["content"], solo(rendered, 20, 0.9f, 5 + i)) << "choice " << i;
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens(rendered));
  json streamed = body;
  streamed["stream"] = true;
  const auto res = post("/v1/chat/completions", streamed);
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const std::vector<std::string> ev = events(res->body);
  ASSERT_GE(ev.size(), 3u);
  for (std::size_t i = 0; i < 2; ++i) {  // a role chunk per choice first
    const json c = json::parse(ev[i]);
    EXPECT_EQ(c["choices"][0]["index"], i);
    EXPECT_EQ(c["choices"][0]["delta"]["role"], "assistant");
  }
  const Stream s = reassemble(res->body, true);
  ASSERT_EQ(s.text.size(), 2u);
  for (std::int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(s.text.at(i), j["choices"][i]["message"]["content"]) << "choice " << i;
    EXPECT_EQ(s.finish_reason.at(i), j["choices"][i]["finish_reason"]);
  }
  idle();
}

// A request of n choices takes n places: beside another it waits until
// they are free, and the batch never holds more than max_batch.
TEST_F(ServerNTest, ConcurrentRequestsWithForksStayWithinMaxBatch) {
  const ServerCounters before = server_->counters();
  const json a = {{"prompt", kPrompt}, {"max_tokens", 40}, {"temperature", 0.9}, {"seed", 11}, {"n", 3}};
  const json b = {{"prompt", kOtherPrompt}, {"max_tokens", 40}, {"temperature", 0.9}, {"seed", 12}, {"n", 2}};
  json ra, rb;
  std::thread ta([&] { ra = post_json("/v1/completions", a); });
  std::thread tb([&] { rb = post_json("/v1/completions", b); });
  ta.join();
  tb.join();
  ASSERT_EQ(ra["choices"].size(), 3u);
  ASSERT_EQ(rb["choices"].size(), 2u);
  for (std::uint64_t i = 0; i < 3; ++i) EXPECT_EQ(ra["choices"][i]["text"], solo(kPrompt, 40, 0.9f, 11 + i));
  for (std::uint64_t i = 0; i < 2; ++i) EXPECT_EQ(rb["choices"][i]["text"], solo(kOtherPrompt, 40, 0.9f, 12 + i));
  const ServerCounters after = idle();
  EXPECT_EQ(after.forks - before.forks, 3);
  EXPECT_LE(after.peak_batch, kMaxBatch);
}

TEST_F(ServerNTest, AClientThatLeavesCancelsEveryChoice) {
  const ServerCounters before = server_->counters();
  httplib::Client client("127.0.0.1", port_);
  httplib::Request req = completion_request(
      json{{"prompt", kPrompt}, {"max_tokens", 3000}, {"temperature", 0}, {"n", 3}, {"stream", true}});
  int chunks = 0;
  req.content_receiver = [&](const char*, std::size_t, std::uint64_t, std::uint64_t) { return ++chunks < 2; };
  client.send(req);  // the receiver's false closes the connection
  ServerCounters now;
  for (int i = 0; i < 6000; ++i) {
    now = server_->counters();
    if (now.cancelled > before.cancelled && now.live_sequences == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(now.cancelled - before.cancelled, 1);
  EXPECT_LT(now.generated_tokens - before.generated_tokens, 3 * 3000) << "the choices ran to their end";
  idle();
}

TEST_F(ServerNTest, MetricsCountForks) {
  const ServerCounters c = server_->counters();
  httplib::Client client("127.0.0.1", port_);
  const auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("# TYPE rewind_forks_total counter\nrewind_forks_total " + std::to_string(c.forks) + "\n"),
            std::string::npos)
      << res->body;
}

// n > 1 on a speculating server: each choice forks from the first once its
// prompt but the last token is in, with its own rollback record, K and
// draft-model slot, and speculates on its own. Greedy choices each equal
// generate(); a seeded sampled choice i equals speculative_generate() with
// the same draft source and seed + i on the prompt alone.
class ServerNSpeculationTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    model_ = new Model(Model::load(model_dir()));
    draft_ = new Model(Model::load(draft_dir()));
    tokenizer_ = new Tokenizer(rwd::runtime::tokenizer_for_model(model_dir(), model_->config()));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete draft_;
    delete model_;
  }
  static std::string draft_dir() { return std::string(REWIND_SOURCE_DIR) + "/models/kjv-draft"; }

  // A server speculating with prompt lookup (model_draft false) or the
  // small draft model, K = 4, prompts fed 16 rows at a time and stored in
  // the prefix cache every `prefix_interval` tokens.
  struct Spec {
    std::unique_ptr<Server> server;
    int port = 0;
    ServerCounters baseline;
  };
  static Spec start(bool model_draft, std::int64_t prefix_interval = 256) {
    ServerOptions o;
    o.model_dir = model_dir();
    o.port = 0;
    o.threads = 1;
    o.max_batch = kMaxBatch;
    o.max_prefill_rows = 16;
    o.prefix_interval = prefix_interval;
    o.num_draft = 4;
    if (model_draft) {
      o.draft_dir = draft_dir();
    } else {
      o.lookup = 3;
    }
    Spec s;
    s.server = std::make_unique<Server>(o);
    s.port = s.server->start();
    s.baseline = s.server->counters();
    return s;
  }

  static std::string text(const std::vector<std::int32_t>& tokens) { return tokenizer_->decode(tokens, true); }
  static std::string greedy(const std::string& prompt, std::int64_t max_tokens) {
    GenerationOptions options;
    options.max_new_tokens = max_tokens;
    return text(rwd::runtime::generate(*model_, tokenizer_->encode(prompt, true), options));
  }
  // speculative_generate on `prompt` alone with the server's draft source
  // (its draft model drafts greedily) and `seed`.
  static std::string speculated(bool model_draft, const std::string& prompt, std::int64_t max_tokens, float temperature,
                                std::uint64_t seed) {
    GenerationOptions options;
    options.max_new_tokens = max_tokens;
    options.sampling.temperature = temperature;
    options.sampling.seed = seed;
    options.speculation.num_draft = 4;
    const std::vector<std::int32_t> prompt_ids = tokenizer_->encode(prompt, true);
    if (model_draft) {
      rwd::runtime::ModelDraft source(*draft_, rwd::runtime::SamplingParams{}, 4);
      return text(rwd::runtime::speculative_generate(*model_, source, prompt_ids, options));
    }
    rwd::runtime::LookupDraft source(3);
    return text(rwd::runtime::speculative_generate(*model_, source, prompt_ids, options));
  }

  static httplib::Result post(int port, const json& body) {
    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(120, 0);
    return client.Post("/v1/completions", body.dump(), "application/json");
  }
  // The choices' texts, in index order, streamed (reassembled) or not.
  static std::vector<std::string> choices(int port, json body, bool stream) {
    body["stream"] = stream;
    const auto res = post(port, body);
    EXPECT_TRUE(res);
    if (!res) return {};
    EXPECT_EQ(res->status, 200) << res->body;
    std::vector<std::string> out;
    if (stream) {
      const Stream s = reassemble(res->body, false);
      for (const auto& [index, t] : s.text) {
        EXPECT_EQ(index, static_cast<std::int64_t>(out.size()));
        out.push_back(t);
      }
      return out;
    }
    const json j = json::parse(res->body);
    for (std::size_t i = 0; i < j["choices"].size(); ++i) {
      EXPECT_EQ(j["choices"][i]["index"], i);
      out.push_back(j["choices"][i]["text"]);
    }
    return out;
  }
  // The counters once every sequence is retired; then none is left and
  // the cache holds what it held before the first request.
  static ServerCounters idle(const Spec& s) {
    ServerCounters c = s.server->counters();
    for (int i = 0; i < 6000 && (c.live_sequences != 0 || c.running != 0); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      c = s.server->counters();
    }
    EXPECT_EQ(c.live_sequences, 0);
    EXPECT_EQ(c.running, 0);
    EXPECT_EQ(c.cache_bytes_used, s.baseline.cache_bytes_used) << "a finished choice left state behind";
    return c;
  }

  static Model* model_;
  static Model* draft_;
  static Tokenizer* tokenizer_;
};

Model* ServerNSpeculationTest::model_ = nullptr;
Model* ServerNSpeculationTest::draft_ = nullptr;
Tokenizer* ServerNSpeculationTest::tokenizer_ = nullptr;

// Repeats that prompt lookup finds, and a prompt of plain text.
const char* const kRepetitive = "the LORD, the LORD, the LORD, the LORD, the LORD, the LORD,";

TEST_F(ServerNSpeculationTest, GreedyChoicesEachEqualGenerateWithLookupAndWithADraftModel) {
  for (const bool model_draft : {false, true}) {
    SCOPED_TRACE(model_draft ? "draft model" : "lookup");
    Spec s = start(model_draft);
    for (const char* prompt : {kRepetitive, kOtherPrompt}) {
      const std::string expected = greedy(prompt, 30);
      for (const bool stream : {false, true}) {
        SCOPED_TRACE(std::string(prompt) + (stream ? " (streamed)" : ""));
        const ServerCounters before = s.server->counters();
        const std::vector<std::string> got = choices(
            s.port, {{"prompt", prompt}, {"max_tokens", 30}, {"temperature", 0}, {"n", 3}}, stream);
        ASSERT_EQ(got.size(), 3u);
        for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], expected) << "choice " << i;
        const ServerCounters after = idle(s);
        EXPECT_EQ(after.forks - before.forks, 2);
        EXPECT_GT(after.drafted - before.drafted, 0);
        EXPECT_EQ(after.generated_tokens - before.generated_tokens, 90);
      }
    }
    const ServerCounters c = idle(s);
    EXPECT_GT(c.accepted, 0);
    EXPECT_LE(c.accepted, c.drafted);
  }
}

TEST_F(ServerNSpeculationTest, SeededSampledChoiceIEqualsSpeculativeGenerateWithSeedPlusI) {
  constexpr std::uint64_t kSeed = 911;
  for (const bool model_draft : {false, true}) {
    SCOPED_TRACE(model_draft ? "draft model" : "lookup");
    std::vector<std::string> expected;
    for (std::uint64_t i = 0; i < 3; ++i) expected.push_back(speculated(model_draft, kRepetitive, 32, 0.8f, kSeed + i));
    EXPECT_NE(expected[0], expected[1]) << "seeds 911 and 912 should sample other continuations";
    Spec s = start(model_draft);
    const json body = {{"prompt", kRepetitive}, {"max_tokens", 32}, {"temperature", 0.8}, {"seed", kSeed}, {"n", 3}};
    for (const bool stream : {false, true}) {
      SCOPED_TRACE(stream ? "streamed" : "whole");
      const ServerCounters before = s.server->counters();
      const std::vector<std::string> got = choices(s.port, body, stream);
      ASSERT_EQ(got.size(), 3u);
      for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], expected[i]) << "choice " << i;
      const ServerCounters after = idle(s);
      EXPECT_EQ(after.forks - before.forks, 2);
      EXPECT_GT(after.drafted - before.drafted, 0);
      EXPECT_GT(after.accepted - before.accepted, 0);
    }
  }
}

// A prompt restored from the prefix cache (all but its last token) and a
// one-token prompt are prefilled at admission: their choices fork there and
// draft in the same round, and still equal the computed ones.
TEST_F(ServerNSpeculationTest, ChoicesForkedAtAdmissionEqualTheOthers) {
  for (const bool model_draft : {false, true}) {
    SCOPED_TRACE(model_draft ? "draft model" : "lookup");
    Spec s = start(model_draft, 8);
    for (const char* prompt : {kRepetitive, kRepetitive, "A"}) {
      SCOPED_TRACE(prompt);
      std::vector<std::string> expected;
      for (std::uint64_t i = 0; i < 3; ++i) expected.push_back(speculated(model_draft, prompt, 24, 0.8f, 60 + i));
      const ServerCounters before = s.server->counters();
      const std::vector<std::string> got = choices(
          s.port, {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0.8}, {"seed", 60}, {"n", 3}}, false);
      ASSERT_EQ(got.size(), 3u);
      for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], expected[i]) << "choice " << i;
      EXPECT_EQ(idle(s).forks - before.forks, 2);
    }
    EXPECT_EQ(idle(s).prefix_hits, 1) << "the repeated prompt should have been restored";
  }
}

// Concurrent requests whose choices fill max_batch (4) together: one waits
// until all of its places (and draft-model slots) are free; every choice is
// still generate()'s.
TEST_F(ServerNSpeculationTest, ConcurrentRequestsWithForksShareTheDraftSlots) {
  Spec s = start(true);
  const std::vector<std::int64_t> n = {3, 2, 2, 1};
  const char* prompts[] = {kRepetitive, kOtherPrompt, kPrompt, kRepetitive};
  std::vector<std::vector<std::string>> got(n.size());
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < n.size(); ++r) {
    threads.emplace_back([&, r] {
      got[r] = choices(s.port,
                       {{"prompt", prompts[r]},
                        {"max_tokens", 20 + 4 * static_cast<std::int64_t>(r)},
                        {"temperature", 0},
                        {"n", n[r]}},
                       r % 2 == 1);
    });
  }
  for (std::thread& t : threads) t.join();
  for (std::size_t r = 0; r < n.size(); ++r) {
    const std::string expected = greedy(prompts[r], 20 + 4 * static_cast<std::int64_t>(r));
    ASSERT_EQ(got[r].size(), static_cast<std::size_t>(n[r])) << "request " << r;
    for (const std::string& t : got[r]) EXPECT_EQ(t, expected) << "request " << r;
  }
  const ServerCounters c = idle(s);
  EXPECT_LE(c.peak_batch, kMaxBatch);
  EXPECT_EQ(c.forks, 2 + 1 + 1);
}

}  // namespace
