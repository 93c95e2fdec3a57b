// /v1/chat/completions over a chat template that mentions <think> and
// <tool_call>: the parser's path end to end. The shipped model writes no
// tags, so a plain turn must come back exactly as runtime::generate() wrote
// it; a template whose generation prompt opens <think> makes the whole turn
// reasoning (what a Qwen3 thinking template's model writes before
// </think>). The JSON of parsed tool calls is checked in
// chat_output_test.cc, where the parser's output is fed directly.
#include <gtest/gtest.h>

#include <httplib.h>
#include <omp.h>

#include <filesystem>
#include <string>
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

// "role: content" lines, as server_test.cc's template, that also names the
// Qwen tags (so the server parses them) and opens <think> at the end when
// the request's chat_template_kwargs say open_think.
const char* const kTaggedTemplate =
    "{#- Tools are called in <tool_call></tool_call> blocks; reasoning goes in <think></think>. #}"
    "{%- for m in messages %}"
    "{{- m.role }}: {{ m.content | trim }}{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{% if open_think %}{{ '<think>\\n' }}{% endif %}{% endif %}";

class TaggedChatServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    omp_set_num_threads(1);
    dir_ = std::filesystem::temp_directory_path() / ("rwd_tagged_chat_" + std::to_string(::getpid()));
    make_chat_model(dir_, kTaggedTemplate);
    load_model(model_dir(), model_, tokenizer_);
    ServerOptions o;
    o.model_dir = dir_.string();
    o.model_name = "kjv-tagged";
    o.port = 0;
    o.max_batch = 2;
    o.threads = 1;
    port_ = start_server(o, server_);
  }
  static void TearDownTestSuite() {
    delete server_;
    unload_model(model_, tokenizer_);
    std::filesystem::remove_all(dir_);
  }

  // generate()'s text for the rendered conversation alone.
  static std::string solo(const std::string& rendered, std::int64_t max_tokens) {
    GenerationOptions options;
    options.max_new_tokens = max_tokens;
    return tokenizer_->decode(rwd::runtime::generate(*model_, tokenizer_->encode(rendered, true), options), true);
  }
  static json post(const json& body) {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(120, 0);
    const auto res = client.Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return json();
    EXPECT_EQ(res->status, 200) << res->body;
    if (body.value("stream", false)) {
      json events = json::array();
      for (const std::string& e : sse_data(res->body))
        if (e != "[DONE]") events.push_back(json::parse(e));
      return events;
    }
    return json::parse(res->body);
  }

  static std::filesystem::path dir_;
  static Model* model_;
  static Tokenizer* tokenizer_;
  static Server* server_;
  static int port_;
};

std::filesystem::path TaggedChatServerTest::dir_;
Model* TaggedChatServerTest::model_ = nullptr;
Tokenizer* TaggedChatServerTest::tokenizer_ = nullptr;
Server* TaggedChatServerTest::server_ = nullptr;
int TaggedChatServerTest::port_ = 0;

const json kMessages = json::array({{{"role", "user"}, {"content", "In the beginning"}}});
const std::string kRendered = "user: In the beginning\nassistant:";

TEST_F(TaggedChatServerTest, ATurnWithoutTagsIsTheTextAsBefore) {
  const std::string text = solo(kRendered, 40);
  const json j = post({{"messages", kMessages}, {"max_tokens", 40}, {"temperature", 0}});
  const json& choice = j["choices"][0];
  EXPECT_EQ(choice["message"], json({{"role", "assistant"}, {"content", text}}));  // no other key
  EXPECT_EQ(choice["finish_reason"], "length");

  // Each of n choices has its own parser.
  const json two = post({{"messages", kMessages}, {"max_tokens", 40}, {"temperature", 0}, {"n", 2}});
  ASSERT_EQ(two["choices"].size(), 2u);
  for (const json& c : two["choices"]) EXPECT_EQ(c["message"], json({{"role", "assistant"}, {"content", text}}));

  const json events = post({{"messages", kMessages}, {"max_tokens", 40}, {"temperature", 0}, {"stream", true}});
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[0]["choices"][0]["delta"]["role"], "assistant");
  std::string streamed;
  for (std::size_t i = 1; i + 1 < events.size(); ++i) {
    const json& d = events[i]["choices"][0]["delta"];
    ASSERT_EQ(d.size(), 1u) << d;
    streamed += d["content"].get<std::string>();
  }
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(events.back()["choices"][0]["delta"].empty());
}

TEST_F(TaggedChatServerTest, APromptThatOpensThinkMakesTheTurnReasoning) {
  const std::string text = solo(kRendered + "<think>\n", 40);
  // The parser drops the newlines next to the tags.
  std::string expected = text;
  while (!expected.empty() && expected.front() == '\n') expected.erase(0, 1);
  while (!expected.empty() && expected.back() == '\n') expected.pop_back();
  ASSERT_FALSE(expected.empty());
  ASSERT_EQ(text.find("</think>"), std::string::npos);  // the model never closes it
  const json kwargs = {{"open_think", true}};
  const json j = post(
      {{"messages", kMessages}, {"max_tokens", 40}, {"temperature", 0}, {"chat_template_kwargs", kwargs}});
  const json& m = j["choices"][0]["message"];
  EXPECT_EQ(m["reasoning_content"], expected);
  EXPECT_EQ(m["content"], "");
  EXPECT_FALSE(m.contains("tool_calls"));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");

  const json events = post({{"messages", kMessages},
                            {"max_tokens", 40},
                            {"temperature", 0},
                            {"chat_template_kwargs", kwargs},
                            {"stream", true}});
  std::string reasoning;
  for (std::size_t i = 1; i + 1 < events.size(); ++i) {
    const json& d = events[i]["choices"][0]["delta"];
    ASSERT_EQ(d.size(), 1u) << d;
    reasoning += d["reasoning_content"].get<std::string>();
  }
  EXPECT_EQ(reasoning, expected);
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "length");
}

TEST_F(TaggedChatServerTest, StopStringsCutTheTextBeforeItIsSplit) {
  const std::string text = solo(kRendered + "<think>\n", 40);
  ASSERT_GT(text.size(), 12u);
  const std::string stop = text.substr(8, 3);
  std::string expected = text.substr(0, text.find(stop));
  while (!expected.empty() && expected.front() == '\n') expected.erase(0, 1);
  while (!expected.empty() && expected.back() == '\n') expected.pop_back();
  const json j = post({{"messages", kMessages},
                       {"max_tokens", 40},
                       {"temperature", 0},
                       {"stop", stop},
                       {"chat_template_kwargs", {{"open_think", true}}}});
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"], expected);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

}  // namespace
