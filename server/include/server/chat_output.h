// server/chat_output.h: the assistant's text split into reasoning, content
// and tool calls, as Qwen3-family chat templates lay them out.
//
// Reasoning is `<think>...</think>` at the start of the turn (or everything
// up to `</think>` when the generation prompt already opened `<think>`);
// a tool call is a `<tool_call>\n{"name": ..., "arguments": {...}}\n
// </tool_call>` block (the Hermes format), or the same block around
// Qwen3-Coder's XML form, `<function=NAME>` then per argument
// `<parameter=KEY>\nVALUE\n</parameter>`, then `</function>`. Text arrives in pieces split
// anywhere, even inside a tag or a UTF-8 sequence: ChatOutputParser emits
// only what can no longer belong to a tag, holds back the rest, and the
// pieces it returns add up to the same result however the text was split.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace rwd::server {

// Per function name, per parameter name: the JSON Schema type the request
// declared for it ("integer", "number", "boolean", "object", "array",
// "string", ...).
using ToolParameterTypes = std::map<std::string, std::map<std::string, std::string>>;

// The parameter types that a request's `tools` (OpenAI's
// [{"type": "function", "function": {"name", "parameters": {"properties":
// {KEY: {"type": ...}}}}}]) declare. Entries of another shape are skipped
// (the template saw them as sent); a type given as a list counts by its
// first entry other than "null".
ToolParameterTypes tool_parameter_types(const nlohmann::json& tools);

// Which of the tags a model's turns use.
struct ChatSyntax {
  bool think = false;         // <think>...</think> at the start of the turn
  bool tool_calls = false;    // <tool_call>...</tool_call> blocks
  bool in_reasoning = false;  // the generation prompt ended inside <think>
  // What an XML-form argument's text is read as: a declared integer,
  // number, boolean, object or array as that JSON value when the text is
  // one ("null" as null), anything else (a string, undeclared, or text that
  // is not such a value) as the string.
  ToolParameterTypes parameter_types;

  bool any() const { return think || tool_calls; }
};

// The syntax of a model whose chat template has `template_source`, for a
// turn whose rendered prompt is `prompt`: a tag counts when the template's
// source contains it; in_reasoning when the prompt ends with "<think>" and
// whitespace.
ChatSyntax chat_syntax(std::string_view template_source, std::string_view prompt);

struct ToolCall {
  std::string name;
  // JSON text, as OpenAI's function.arguments (an XML-form value's bytes
  // that are not UTF-8 become U+FFFD there); a Hermes call's string
  // arguments as the model wrote them.
  std::string arguments;
};

// Parts of an assistant turn, in the order each kind arrived.
struct ChatOutput {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;

  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
  void append(ChatOutput&& more);
};

class ChatOutputParser {
 public:
  // With a syntax whose any() is false, every byte goes to content as it
  // comes (nothing is held back).
  explicit ChatOutputParser(ChatSyntax syntax);

  // Appends `text`; returns what is now known. Reasoning drops the newlines
  // next to its tags, content the newlines right after </think> (as the
  // templates' own strip('\n') does when the turn is sent back). A
  // <tool_call> block whose body is neither a JSON object with a string
  // "name" (and, if present, "arguments" an object or a string) nor the
  // whole XML form (a name, each parameter once, one newline next to each
  // value dropped, nothing else but whitespace between the tags) stays
  // content, tags and all. Whitespace next to a tool call is the template's layout,
  // not content: it is dropped, except one run between text before and
  // text after a call.
  ChatOutput push(std::string_view text);
  // The end of the turn: what was held back. An unterminated <think> is
  // reasoning, an unterminated <tool_call> content; whitespace held before a
  // tool call that never came is content unless the turn had tool calls.
  ChatOutput finish();
  // True once a tool call was returned.
  bool had_tool_calls() const { return tool_calls_ > 0; }

 private:
  enum class State { kStart, kReasoning, kContent, kToolCall };
  void drain(bool final, ChatOutput& out);
  // drain's work in each state; false when it waits for more text (or, at
  // the end of the turn, is done).
  bool drain_start(bool final);
  bool drain_reasoning(bool final, ChatOutput& out);
  bool drain_content(bool final, ChatOutput& out);
  bool drain_tool_call(bool final, ChatOutput& out);
  void emit_reasoning(std::string_view s, ChatOutput& out);
  void emit_content(std::string_view s, ChatOutput& out);

  ChatSyntax syntax_;
  State state_;
  std::string held_;                // bytes not yet decided
  std::string space_;               // content whitespace held before a possible tool call
  bool reasoning_started_ = false;  // a reasoning byte other than '\n' went out
  bool after_think_ = false;        // content has not begun since </think>
  bool content_started_ = false;    // content other than whitespace went out
  std::size_t tool_calls_ = 0;
};

// OpenAI's tool_calls entry for `call`: {"id", "type": "function",
// "function": {"name", "arguments"}}, with `index` when index >= 0 (stream
// deltas carry it).
nlohmann::json tool_call_json(const ToolCall& call, const std::string& id, int index = -1);

// The assistant message of a finished turn: content (null when empty and
// there are tool calls), reasoning_content when there was reasoning,
// tool_calls (ids[i] for call i) when there were any.
// REQUIRES: ids.size() == out.tool_calls.size().
nlohmann::json chat_message_json(const ChatOutput& out, const std::vector<std::string>& ids);

}  // namespace rwd::server
