// rewind serve: the server started in-process on 127.0.0.1 (a free port)
// over the shipped model, driven through HTTP by httplib's client. Every
// greedy or seeded response is compared with runtime::generate() on the
// same prompt alone; chat requests (ChatServerTest, a copy of the model with
// a chat template) with generate() on the conversation the template renders.
#include <gtest/gtest.h>

#include <httplib.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
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

// What generate() gives for one prompt alone.
struct Solo {
  std::vector<std::int32_t> prompt;
  std::vector<std::int32_t> tokens;
  std::string text;
};

class ServerTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    // One OpenMP thread for the test's own decoding and the server's: two
    // teams spinning at their barriers on a loaded machine take turns for
    // each core (correctness does not depend on it: batch invariance).
    omp_set_num_threads(1);
    load_model(model_dir(), model_, tokenizer_);
    ServerOptions o;
    o.model_dir = model_dir();
    o.port = 0;
    o.max_batch = 4;  // fewer than the concurrent test's clients: some wait and join
    o.max_body_bytes = 256 * 1024;
    o.max_prefill_rows = 16;  // long prompts go in several rounds, beside decoding sequences
    o.threads = 1;
    port_ = start_server(o, server_);
  }
  static void TearDownTestSuite() {
    delete server_;
    unload_model(model_, tokenizer_);
  }

  static Solo solo(const std::string& text, std::int64_t max_tokens, float temperature = 0.0f, std::uint64_t seed = 0) {
    Solo s;
    s.prompt = tokenizer_->encode(text, true);
    GenerationOptions options;
    options.max_new_tokens = max_tokens;
    options.sampling.temperature = temperature;
    options.sampling.seed = seed;
    s.tokens = rwd::runtime::generate(*model_, s.prompt, options);
    s.text = tokenizer_->decode(s.tokens, true);
    return s;
  }

  static httplib::Result post(const std::string& path, const std::string& body) {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(120, 0);
    return client.Post(path.c_str(), body, "application/json");
  }
  static json post_json(const std::string& path, const json& body, int expected_status) {
    const auto res = post(path, body.dump());
    EXPECT_TRUE(res) << "no response from " << path;
    if (!res) return {};
    EXPECT_EQ(res->status, expected_status) << res->body;
    return json::parse(res->body);
  }

  static std::vector<std::string> events(const std::string& body) { return rwt::server::sse_data(body); }

  // Checks an OpenAI-style error body.
  static void expect_error(const httplib::Result& res, int status, const std::string& param, const std::string& code) {
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, status) << res->body;
    const json j = json::parse(res->body);
    ASSERT_TRUE(j.contains("error")) << res->body;
    const json& e = j["error"];
    EXPECT_TRUE(e["message"].is_string());
    EXPECT_FALSE(e["message"].get<std::string>().empty());
    EXPECT_TRUE(e["type"].is_string());
    EXPECT_TRUE(e.contains("param"));
    EXPECT_TRUE(e.contains("code"));
    if (param.empty()) {
      EXPECT_TRUE(e["param"].is_null()) << res->body;
    } else {
      EXPECT_EQ(e["param"], param) << res->body;
    }
    if (!code.empty()) {
      EXPECT_EQ(e["code"], code) << res->body;
    }
  }

  static Model* model_;
  static Tokenizer* tokenizer_;
  static Server* server_;
  static int port_;
};

Model* ServerTest::model_ = nullptr;
Tokenizer* ServerTest::tokenizer_ = nullptr;
Server* ServerTest::server_ = nullptr;
int ServerTest::port_ = 0;

const char* const kPrompts[] = {
    "In the beginning",
    "And God said, Let there be light",
    "The LORD is my shepherd; I shall not want.",
    "And it came to pass, when men began to multiply on the face of the earth, and daughters were born unto them,",
    "Blessed are",
    "For God so loved the world",
    "A",
    "Now the serpent was more subtil than any beast of the field which the LORD God had made.",
};

TEST_F(ServerTest, HealthAndModels) {
  httplib::Client client("127.0.0.1", port_);
  const auto health = client.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(json::parse(health->body)["status"], "ok");
  const auto models = client.Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  const json j = json::parse(models->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "kjv-hybrid");
  EXPECT_EQ(j["data"][0]["object"], "model");
  EXPECT_EQ(server_->model_name(), "kjv-hybrid");
}

TEST_F(ServerTest, GreedyCompletionEqualsGenerateAlone) {
  for (const char* prompt : {kPrompts[0], kPrompts[3]}) {
    const Solo s = solo(prompt, 40);
    const json j = post_json(
        "/v1/completions", {{"model", "kjv-hybrid"}, {"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0}}, 200);
    EXPECT_EQ(j["object"], "text_completion");
    EXPECT_EQ(j["model"], "kjv-hybrid");
    ASSERT_EQ(j["choices"].size(), 1u);
    EXPECT_EQ(j["choices"][0]["text"], s.text) << prompt;
    const bool eos = !s.tokens.empty() && model_->config().is_eos(s.tokens.back());
    EXPECT_EQ(j["choices"][0]["finish_reason"], eos ? "stop" : "length");
    EXPECT_EQ(j["usage"]["prompt_tokens"], s.prompt.size());
    EXPECT_EQ(j["usage"]["completion_tokens"], s.tokens.size());
    EXPECT_EQ(j["usage"]["total_tokens"], s.prompt.size() + s.tokens.size());
  }
}

TEST_F(ServerTest, TokenListPromptEqualsItsText) {
  const Solo s = solo(kPrompts[1], 24);
  const json j = post_json("/v1/completions", {{"prompt", s.prompt}, {"max_tokens", 24}, {"temperature", 0}}, 200);
  EXPECT_EQ(j["choices"][0]["text"], s.text);
  EXPECT_EQ(j["usage"]["prompt_tokens"], s.prompt.size());
}

TEST_F(ServerTest, SeededSamplingIsReproducibleAndEqualsGenerate) {
  const Solo s = solo(kPrompts[2], 32, 0.8f, 1234);
  const json body = {{"prompt", kPrompts[2]}, {"max_tokens", 32}, {"temperature", 0.8}, {"seed", 1234}};
  const json a = post_json("/v1/completions", body, 200);
  const json b = post_json("/v1/completions", body, 200);
  EXPECT_EQ(a["choices"][0]["text"], s.text);
  EXPECT_EQ(b["choices"][0]["text"], s.text);
  const Solo greedy = solo(kPrompts[2], 32);
  EXPECT_NE(s.text, greedy.text) << "temperature 0.8 should sample another continuation for this prompt";
}

TEST_F(ServerTest, StreamingChunksConcatenateToTheSoloText) {
  const Solo s = solo(kPrompts[0], 40);
  const auto res = post("/v1/completions", json{{"prompt", kPrompts[0]},
                                                {"max_tokens", 40},
                                                {"temperature", 0},
                                                {"stream", true},
                                                {"stream_options", {{"include_usage", true}}}}
                                               .dump());
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  const std::vector<std::string> ev = events(res->body);
  ASSERT_GE(ev.size(), 3u);  // text chunks, the finish chunk, the usage chunk, [DONE]
  EXPECT_EQ(ev.back(), "[DONE]");
  std::string text;
  for (std::size_t i = 0; i + 2 < ev.size(); ++i) {
    const json c = json::parse(ev[i]);
    EXPECT_EQ(c["object"], "text_completion");
    text += c["choices"][0]["text"].get<std::string>();
    if (i + 3 < ev.size()) {
      EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
    }
  }
  EXPECT_EQ(text, s.text);
  const json last = json::parse(ev[ev.size() - 3]);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  const json usage = json::parse(ev[ev.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], s.tokens.size());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], s.prompt.size());
}

TEST_F(ServerTest, StopStringsCutAcrossTokensAndAreNeverEmitted) {
  const Solo s = solo(kPrompts[0], 60);
  ASSERT_GE(s.text.size(), 30u);
  // Byte-level model: a 3-character stop spans 3 tokens.
  const std::string stop = s.text.substr(20, 3);
  const std::string expected = s.text.substr(0, s.text.find(stop));
  const json j = post_json("/v1/completions",
                           {{"prompt", kPrompts[0]}, {"max_tokens", 60}, {"temperature", 0}, {"stop", {"zzzz", stop}}},
                           200);
  EXPECT_EQ(j["choices"][0]["text"], expected);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_LT(j["usage"]["completion_tokens"].get<std::size_t>(), s.tokens.size());

  const auto res = post(
      "/v1/completions",
      json{{"prompt", kPrompts[0]}, {"max_tokens", 60}, {"temperature", 0}, {"stop", stop}, {"stream", true}}.dump());
  ASSERT_TRUE(res);
  const std::vector<std::string> ev = events(res->body);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(ev.back(), "[DONE]");
  std::string text;
  for (std::size_t i = 0; i + 1 < ev.size(); ++i) text += json::parse(ev[i])["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, expected);
  EXPECT_EQ(json::parse(ev[ev.size() - 2])["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerTest, ConcurrentRequestsEachEqualTheirSoloDecoding) {
  constexpr int kClients = 8;
  std::vector<Solo> expected;
  for (int i = 0; i < kClients; ++i) expected.push_back(solo(kPrompts[i], 30 + 3 * i));
  std::vector<std::string> got(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const bool stream = i % 2 == 1;
      const auto res = post(
          "/v1/completions",
          json{{"prompt", kPrompts[i]}, {"max_tokens", 30 + 3 * i}, {"temperature", 0}, {"stream", stream}}.dump());
      if (!res || res->status != 200) return;
      if (!stream) {
        got[i] = json::parse(res->body)["choices"][0]["text"];
        return;
      }
      for (const std::string& e : events(res->body)) {
        if (e != "[DONE]") got[i] += json::parse(e)["choices"][0]["text"].get<std::string>();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(got[i], expected[i].text) << "client " << i;
}

TEST_F(ServerTest, ClientThatLeavesMidStreamHasItsSequenceRemoved) {
  const rwd::server::ServerCounters before = server_->counters();
  httplib::Client client("127.0.0.1", port_);
  httplib::Request req = completion_request(
      json{{"prompt", kPrompts[0]}, {"max_tokens", 3000}, {"temperature", 0}, {"stream", true}});
  int chunks = 0;
  req.content_receiver = [&](const char*, std::size_t, std::uint64_t, std::uint64_t) { return ++chunks < 2; };
  client.send(req);  // the receiver's false closes the connection
  EXPECT_EQ(chunks, 2);
  // The server notices at its next write; wait for the decode loop to drop it.
  rwd::server::ServerCounters now;
  for (int i = 0; i < 6000; ++i) {
    now = server_->counters();
    if (now.cancelled > before.cancelled && now.live_sequences == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(now.cancelled, before.cancelled);
  EXPECT_EQ(now.live_sequences, 0);
  EXPECT_EQ(now.running, 0);
  EXPECT_LT(now.generated_tokens - before.generated_tokens, 3000) << "the sequence ran to its end";
}

TEST_F(ServerTest, MalformedRequestsGetOpenAIErrors) {
  expect_error(post("/v1/completions", "{\"prompt\": \"x\", "), 400, "", "invalid_json");
  expect_error(post("/v1/completions", "[1, 2]"), 400, "", "invalid_json");
  const auto bad = [&](const json& body, const std::string& param) {
    SCOPED_TRACE(body.dump());
    expect_error(post("/v1/completions", body.dump()), 400, param, "");
  };
  bad({{"prompt", "x"}, {"max_tokens", "ten"}}, "max_tokens");
  bad({{"prompt", "x"}, {"max_tokens", 1.5}}, "max_tokens");
  bad({{"prompt", "x"}, {"max_tokens", -1}}, "max_tokens");
  bad({{"prompt", "x"}, {"temperature", "hot"}}, "temperature");
  bad({{"prompt", "x"}, {"temperature", 3}}, "temperature");
  bad({{"prompt", "x"}, {"top_p", 0}}, "top_p");
  bad({{"prompt", "x"}, {"top_k", true}}, "top_k");
  bad({{"prompt", "x"}, {"seed", "7"}}, "seed");
  bad({{"prompt", "x"}, {"stream", "yes"}}, "stream");
  bad({{"prompt", "x"}, {"stop", 5}}, "stop");
  bad({{"prompt", "x"}, {"stop", {"a", 1}}}, "stop");
  bad({{"prompt", "x"}, {"stop", ""}}, "stop");
  bad({{"prompt", "x"}, {"n", 0}}, "n");
  bad({{"prompt", "x"}, {"n", "2"}}, "n");
  bad({{"prompt", "x"}, {"n", 5}}, "n");  // past max_batch (4)
  bad({{"prompt", 5}}, "prompt");
  bad({{"prompt", json::array()}}, "prompt");
  bad({{"prompt", {1, 2, 100000}}}, "prompt");
  bad({{"prompt", {1, -2}}}, "prompt");
  bad({{"max_tokens", 4}}, "prompt");
  bad({{"prompt", "x"}, {"model", 7}}, "model");
  expect_error(post("/v1/completions", json{{"prompt", "x"}, {"model", "gpt-4"}}.dump()), 404, "model",
               "model_not_found");
  // Past the context (4096 for a config without max_position_embeddings).
  expect_error(post("/v1/completions", json{{"prompt", std::vector<int>(5000, 65)}, {"max_tokens", 1}}.dump()), 400,
               "prompt", "context_length_exceeded");
  expect_error(post("/v1/completions", json{{"prompt", "In"}, {"max_tokens", 4096}}.dump()), 400, "max_tokens",
               "context_length_exceeded");
  // Past max_body_bytes (256 KiB here).
  expect_error(post("/v1/completions", json{{"prompt", std::string(300 * 1024, 'a')}}.dump()), 413, "",
               "request_too_large");
  expect_error(post("/v1/nothing", "{}"), 404, "", "unknown_endpoint");
  expect_error(post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}.dump()), 400,
               "messages", "chat_template_unsupported");
  expect_error(post("/v1/chat/completions", "{"), 400, "", "invalid_json");
  // Nothing refused left anything behind.
  const rwd::server::ServerCounters c = server_->counters();
  EXPECT_EQ(c.live_sequences, 0);
  EXPECT_EQ(c.waiting, 0);
}

TEST_F(ServerTest, UnknownFieldsAreIgnoredAndNullMeansUnset) {
  const Solo s = solo(kPrompts[4], 12);
  const json j = post_json("/v1/completions",
                           {{"prompt", kPrompts[4]},
                            {"max_tokens", 12},
                            {"temperature", 0},
                            {"frequency_penalty", 0},
                            {"user", "someone"},
                            {"top_p", nullptr},
                            {"stop", nullptr},
                            {"something_new", {{"nested", true}}}},
                           200);
  EXPECT_EQ(j["choices"][0]["text"], s.text);
}

TEST_F(ServerTest, ZeroMaxTokensReturnsNothing) {
  const json j = post_json("/v1/completions", {{"prompt", kPrompts[0]}, {"max_tokens", 0}}, 200);
  EXPECT_EQ(j["choices"][0]["text"], "");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 0);
}

TEST_F(ServerTest, MetricsArePrometheusText) {
  post_json("/v1/completions", {{"prompt", kPrompts[6]}, {"max_tokens", 5}, {"temperature", 0}}, 200);
  httplib::Client client("127.0.0.1", port_);
  const auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  for (const char* metric : {"rewind_http_requests_total ", "rewind_generated_tokens_total ", "rewind_queue_waiting ",
                             "rewind_batch_running ", "# TYPE rewind_completions_total counter"}) {
    EXPECT_NE(res->body.find(metric), std::string::npos) << metric << " in\n" << res->body;
  }
  EXPECT_GE(server_->counters().generated_tokens, 5);
}

// stop() drains: a stream under way runs to its end, then the server is gone.
// ---- /v1/chat/completions over a copy of the model with a chat template ----

// The shipped model (byte level, BOS 256) beside a tokenizer_config.json
// whose template writes "role: content" lines and refuses a role "bad".
const char* const kChatTemplate =
    "{%- for m in messages %}"
    "{%- if m.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
    "{{- m.role }}: {{ m.content | trim }}{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}";

class ChatServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    dir_ = std::filesystem::temp_directory_path() / ("rwd_chat_server_" + std::to_string(::getpid()));
    rwt::server::make_chat_model(dir_, kChatTemplate);
    load_model(model_dir(), model_, tokenizer_);
    ServerOptions o;
    o.model_dir = dir_.string();
    o.model_name = "kjv-chat";
    o.port = 0;
    o.max_batch = 4;
    o.threads = 1;
    port_ = start_server(o, server_);
  }
  static void TearDownTestSuite() {
    delete server_;
    unload_model(model_, tokenizer_);
    std::filesystem::remove_all(dir_);
  }

  // The template's text for `messages`, written out by hand, and what
  // generate() gives for it alone: BOS, then its bytes.
  static Solo solo(const std::string& rendered, std::int64_t max_tokens) {
    Solo s;
    s.prompt = tokenizer_->encode(rendered, true);
    EXPECT_EQ(s.prompt.front(), 256);  // BOS once, then the bytes
    EXPECT_EQ(s.prompt.size(), rendered.size() + 1);
    GenerationOptions options;
    options.max_new_tokens = max_tokens;
    s.tokens = rwd::runtime::generate(*model_, s.prompt, options);
    s.text = tokenizer_->decode(s.tokens, true);
    return s;
  }
  static httplib::Result post(const json& body) {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(120, 0);
    return client.Post("/v1/chat/completions", body.dump(), "application/json");
  }

  static std::filesystem::path dir_;
  static Model* model_;
  static Tokenizer* tokenizer_;
  static Server* server_;
  static int port_;
};

std::filesystem::path ChatServerTest::dir_;
Model* ChatServerTest::model_ = nullptr;
Tokenizer* ChatServerTest::tokenizer_ = nullptr;
Server* ChatServerTest::server_ = nullptr;
int ChatServerTest::port_ = 0;

const json kConversation = json::array({{{"role", "system"}, {"content", "  Answer in the words of the book.  "}},
                                        {{"role", "user"}, {"content", "In the beginning"}},
                                        {{"role", "assistant"}, {"content", "God created the heaven"}},
                                        {{"role", "user"}, {"content", "And the earth?"}}});
const std::string kConversationText =
    "system: Answer in the words of the book.\nuser: In the beginning\nassistant: God created the heaven\n"
    "user: And the earth?\nassistant:";

TEST_F(ChatServerTest, GreedyChatEqualsGenerateOnTheRenderedConversation) {
  const Solo s = solo(kConversationText, 24);
  const auto res = post({{"model", "kjv-chat"}, {"messages", kConversation}, {"max_tokens", 24}, {"temperature", 0}});
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json j = json::parse(res->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "kjv-chat");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  const json& choice = j["choices"][0];
  EXPECT_EQ(choice["index"], 0);
  EXPECT_EQ(choice["message"]["role"], "assistant");
  EXPECT_EQ(choice["message"]["content"], s.text);
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], s.prompt.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 24);
  EXPECT_EQ(j["usage"]["total_tokens"], s.prompt.size() + 24);
}

TEST_F(ChatServerTest, StreamingChatSendsRoleThenContentThenFinish) {
  const json messages = json::array({{{"role", "user"}, {"content", "And God said, Let there be light"}}});
  const Solo s = solo("user: And God said, Let there be light\nassistant:", 30);
  const auto res = post({{"messages", messages},
                         {"max_tokens", 30},
                         {"temperature", 0},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  const std::vector<std::string> ev = ServerTest::events(res->body);
  ASSERT_GE(ev.size(), 4u);  // role, content..., finish, usage, [DONE]
  EXPECT_EQ(ev.back(), "[DONE]");
  const json first = json::parse(ev[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  std::string text;
  for (std::size_t i = 1; i + 3 < ev.size(); ++i) {
    const json c = json::parse(ev[i]);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_FALSE(c["choices"][0]["delta"].contains("role"));
    EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
    text += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text, s.text);
  const json finish = json::parse(ev[ev.size() - 3]);
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(finish["choices"][0]["delta"].empty());
  const json usage = json::parse(ev[ev.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], s.prompt.size());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 30);
}

TEST_F(ChatServerTest, StopStringsAndTextPartsWork) {
  // Content as a list of text parts is joined before rendering.
  const json parts = json::array({{{"role", "user"},
                                   {"content", json::array({{{"type", "text"}, {"text", "In the "}},
                                                            {{"type", "text"}, {"text", "beginning"}}})}}});
  const Solo s = solo("user: In the beginning\nassistant:", 40);
  ASSERT_GT(s.text.size(), 6u);
  const std::string stop = s.text.substr(4, 3);
  const auto res = post({{"messages", parts}, {"max_tokens", 40}, {"temperature", 0}, {"stop", stop}});
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json j = json::parse(res->body);
  EXPECT_EQ(j["choices"][0]["message"]["content"], s.text.substr(0, s.text.find(stop)));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST_F(ChatServerTest, MalformedMessagesGetOpenAIErrors) {
  const auto bad = [&](const json& body, const std::string& param, const std::string& code) {
    SCOPED_TRACE(body.dump());
    ServerTest::expect_error(post(body), 400, param, code);
  };
  const json user = {{"role", "user"}, {"content", "hi"}};
  bad(json::object(), "messages", "missing_field");
  bad({{"messages", "hi"}}, "messages", "invalid_type");
  bad({{"messages", json::array()}}, "messages", "invalid_value");
  bad({{"messages", {1}}}, "messages", "invalid_type");
  bad({{"messages", {{{"content", "hi"}}}}}, "messages", "missing_field");
  bad({{"messages", {{{"role", 3}, {"content", "hi"}}}}}, "messages", "invalid_type");
  bad({{"messages", {{{"role", "user"}}}}}, "messages", "missing_field");
  bad({{"messages", {{{"role", "user"}, {"content", 5}}}}}, "messages", "invalid_type");
  bad({{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", "x"}}}}}}}}, "messages",
      "unsupported_value");
  bad({{"messages", {{{"role", "assistant"}, {"content", nullptr}, {"tool_calls", "x"}}}}}, "messages", "invalid_type");
  bad({{"messages", {{{"role", "bad"}, {"content", "x"}}}}}, "messages", "invalid_value");  // raise_exception
  bad({{"messages", {user}}, {"tools", "x"}}, "tools", "invalid_type");
  bad({{"messages", {user}}, {"max_tokens", "x"}}, "max_tokens", "invalid_type");
  bad({{"messages", {user}}, {"max_tokens", 5000}}, "max_tokens", "");
  bad({{"messages", {user}}, {"temperature", 5}}, "temperature", "");
  ServerTest::expect_error(post({{"messages", {user}}, {"model", "other"}}), 404, "model", "model_not_found");
  // The template's refusal is in the message.
  const auto res = post({{"messages", {{{"role", "bad"}, {"content", "x"}}}}});
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("role bad is not allowed"), std::string::npos) << res->body;
  // Nothing refused left anything behind (the stop-string test's sequence
  // is dropped within a round: waited for, not timed).
  for (int k = 0; k < 1000 && server_->counters().live_sequences != 0; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const rwd::server::ServerCounters c = server_->counters();
  EXPECT_EQ(c.live_sequences, 0);
  EXPECT_EQ(c.waiting, 0);
  // An assistant turn with tool_calls and no content renders ("" content).
  const auto ok = post(
      {{"messages", {user, {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", json::array()}}, user}},
       {"max_tokens", 2},
       {"temperature", 0}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

TEST_F(ChatServerTest, CompletionsStillWorkBesideChat) {
  const auto res = post({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"max_tokens", 0}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body)["choices"][0]["message"]["content"], "");
  httplib::Client client("127.0.0.1", port_);
  const auto c = client.Post("/v1/completions", json{{"prompt", "In"}, {"max_tokens", 3}}.dump(), "application/json");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->status, 200) << c->body;
}

TEST(ServerLifecycle, StopDrainsTheStreamUnderWay) {
  omp_set_num_threads(1);
  ServerOptions o;
  o.model_dir = model_dir();
  o.port = 0;
  o.threads = 1;
  Server server(o);
  const int port = server.start();
  EXPECT_GT(port, 0);
  EXPECT_THROW(server.start(), rwd::StateError);

  const Model model = Model::load(model_dir());
  const Tokenizer tokenizer = rwd::runtime::tokenizer_for_model(model_dir(), model.config());
  GenerationOptions g;
  g.max_new_tokens = 200;
  const std::string expected = tokenizer.decode(rwd::runtime::generate(model, tokenizer.encode(kPrompts[0], true), g),
                                                true);

  std::atomic<bool> first_chunk{false};
  std::string body;
  std::thread client_thread([&] {
    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(120, 0);
    httplib::Request req = completion_request(
        json{{"prompt", kPrompts[0]}, {"max_tokens", 200}, {"temperature", 0}, {"stream", true}});
    req.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
      body.append(data, n);
      first_chunk = true;
      return true;
    };
    client.send(req);
    first_chunk = true;  // also when no chunk came: the wait below ends
  });
  while (!first_chunk) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  server.stop();
  client_thread.join();
  std::string text;
  bool done = false;
  std::size_t at = 0;
  while (at < body.size()) {
    const std::size_t end = body.find("\n\n", at);
    ASSERT_NE(end, std::string::npos);
    const std::string data = body.substr(at + 6, end - at - 6);
    if (data == "[DONE]") {
      done = true;
    } else {
      text += json::parse(data)["choices"][0]["text"].get<std::string>();
    }
    at = end + 2;
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(text, expected);
  httplib::Client late("127.0.0.1", port);
  EXPECT_FALSE(late.Get("/health")) << "the server still answers after stop()";
  EXPECT_EQ(server.counters().live_sequences, 0);
}

// The shipped model on a free port, one sequence in the batch at a time and
// `queue_limit` requests waiting, one OpenMP thread.
ServerOptions one_at_a_time(std::int64_t queue_limit) {
  omp_set_num_threads(1);
  ServerOptions o;
  o.model_dir = model_dir();
  o.port = 0;
  o.threads = 1;
  o.max_batch = 1;
  o.queue_limit = queue_limit;
  o.context = 1 << 14;
  return o;
}

// A full queue refuses with 429 and changes nothing: with one sequence
// decoding (a stream held open) and one request waiting, a third is refused;
// the waiting one then runs as it would alone.
TEST(ServerLifecycle, FullQueueGets429) {
  Server server(one_at_a_time(1));
  const int port = server.start();
  const Model model = Model::load(model_dir());
  const Tokenizer tokenizer = rwd::runtime::tokenizer_for_model(model_dir(), model.config());
  GenerationOptions g;
  g.max_new_tokens = 8;
  const std::string expected = tokenizer.decode(rwd::runtime::generate(model, tokenizer.encode(kPrompts[2], true), g),
                                                true);
  const auto post_to = [port](const json& body) {
    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(120, 0);
    return client.Post("/v1/completions", body.dump(), "application/json");
  };

  std::atomic<bool> streaming{false}, release{false}, holder_done{false};
  std::thread holder([&] {  // the sequence that keeps the batch full until released
    httplib::Client client("127.0.0.1", port);
    // httplib's default 5 s read timeout would drop this client on a loaded
    // machine before its first token, leaving its job queued: the wait for
    // `waiting == 1` below would then see the holder, not the waiter.
    client.set_read_timeout(120, 0);
    httplib::Request req = completion_request(
        json{{"prompt", kPrompts[0]}, {"max_tokens", 16000}, {"temperature", 0}, {"stream", true}});
    req.content_receiver = [&](const char*, std::size_t, std::uint64_t, std::uint64_t) {
      streaming = true;
      return !release;
    };
    client.send(req);
    holder_done = true;
  });
  while (!streaming && !holder_done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!streaming) {
    holder.join();
    FAIL() << "the holding stream ended before its first token";
  }
  std::string waiting_text;
  std::thread waiter([&] {
    const auto res = post_to({{"prompt", kPrompts[2]}, {"max_tokens", 8}, {"temperature", 0}});
    if (res && res->status == 200) waiting_text = json::parse(res->body)["choices"][0]["text"];
  });
  for (int i = 0; i < 60000 && server.counters().waiting < 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(server.counters().waiting, 1);
  const auto refused = post_to({{"prompt", "x"}, {"max_tokens", 1}});
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 429) << refused->body;
  EXPECT_EQ(json::parse(refused->body)["error"]["code"], "queue_full");
  release = true;
  holder.join();
  waiter.join();
  EXPECT_EQ(waiting_text, expected);
}

// POSTs `body` to /v1/completions on a socket of its own and returns it
// open, unread, for the test to close: httplib's client cannot leave while
// it waits for a whole answer.
int post_raw(int port, const json& body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string b = body.dump();
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(b.size()) + "\r\n\r\n" + b;
  EXPECT_EQ(write(fd, req.data(), req.size()), static_cast<ssize_t>(req.size()));
  return fd;
}

// Clients that leave while their request waits in the queue (streaming or
// not) or while a whole answer is being generated are noticed without a
// write: their requests leave the queue or the batch, counted as cancelled,
// and the others go on.
TEST(ServerLifecycle, ClientsThatLeaveBeforeTheirAnswerAreDropped) {
  Server server(one_at_a_time(2));
  const int port = server.start();
  const ServerCounters before = server.counters();
  const auto wait_until = [&](const auto& done) {
    ServerCounters now = server.counters();
    for (int i = 0; i < 60000 && !done(now); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      now = server.counters();
    }
    return now;
  };

  const int whole = post_raw(port, {{"prompt", kPrompts[0]}, {"max_tokens", 16000}, {"temperature", 0}});
  const ServerCounters running = wait_until(
      [&](const ServerCounters& c) { return c.running == 1 && c.generated_tokens > before.generated_tokens; });
  ASSERT_EQ(running.running, 1) << "the whole-answer request never ran";
  const int queued_stream = post_raw(port, {{"prompt", kPrompts[1]}, {"max_tokens", 8}, {"stream", true}});
  const int queued_whole = post_raw(port, {{"prompt", kPrompts[2]}, {"max_tokens", 8}});
  ASSERT_EQ(wait_until([](const ServerCounters& c) { return c.waiting == 2; }).waiting, 2);
  close(queued_stream);
  close(queued_whole);
  const ServerCounters left_queue = wait_until(
      [&](const ServerCounters& c) { return c.waiting == 0 && c.cancelled == before.cancelled + 2; });
  EXPECT_EQ(left_queue.waiting, 0);
  EXPECT_EQ(left_queue.cancelled - before.cancelled, 2);
  EXPECT_EQ(left_queue.running, 1) << "the running request went with the queued ones";
  EXPECT_EQ(left_queue.prompt_tokens, running.prompt_tokens) << "a request whose client left was admitted";

  close(whole);
  const ServerCounters after = wait_until([&](const ServerCounters& c) {
    return c.cancelled == before.cancelled + 3 && c.running == 0 && c.live_sequences == 0;
  });
  EXPECT_EQ(after.cancelled - before.cancelled, 3);
  EXPECT_EQ(after.running, 0);
  EXPECT_EQ(after.live_sequences, 0);
  EXPECT_LT(after.generated_tokens - before.generated_tokens, 16000) << "the whole answer ran to its end";

  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(120, 0);
  const auto res = client.Post("/v1/completions", json{{"prompt", kPrompts[2]}, {"max_tokens", 4}}.dump(),
                               "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(server.counters().cancelled, after.cancelled);
}

TEST(ServerLifecycle, BadOptionsAreRefused) {
  ServerOptions o;
  o.model_dir = model_dir();
  o.max_batch = 0;
  EXPECT_THROW(Server{o}, rwd::InvalidArgument);
  o.max_batch = 1;
  o.http_threads = 0;
  EXPECT_THROW(Server{o}, rwd::InvalidArgument);
  o.http_threads = 1;
  o.queue_limit = 0;
  EXPECT_THROW(Server{o}, rwd::InvalidArgument);
  o.queue_limit = 1;
  o.model_dir = model_dir() + "/does-not-exist";
  EXPECT_THROW(Server{o}, rwd::Error);
}

TEST(ServerLifecycle, BusyPortIsRefused) {
  ServerOptions o;
  o.model_dir = model_dir();
  o.port = 0;
  Server first(o);
  o.port = first.start();
  Server second(o);
  EXPECT_THROW(second.start(), rwd::InvalidArgument);
}

}  // namespace
