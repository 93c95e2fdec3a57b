// libFuzzer target: the chat server's output parser (server/chat_output.h) on
// arbitrary model text. Byte 0 picks the syntax (think, tool_calls,
// in_reasoning) and whether the parameter types come from a fixed table of
// every JSON Schema type or from the input; byte 1 is the length of a
// `tools` JSON prefix (parsed without exceptions; whatever it holds,
// tool_parameter_types must not throw); byte 2 seeds the split points; the
// rest is the text. Checked:
//   - the parser's promise: the text pushed whole, byte by byte, and in
//     seeded pieces gives the same reasoning, content and tool calls;
//   - the assistant message and the stream deltas serialize (bytes that are
//     not UTF-8 replaced, as the server writes them).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/chat_output.h"

namespace {

using rwd::server::ChatOutput;
using rwd::server::ChatOutputParser;
using rwd::server::ChatSyntax;

ChatOutput parse(const ChatSyntax& syntax, std::string_view text, const std::vector<std::size_t>& cuts) {
  ChatOutputParser p(syntax);
  ChatOutput out;
  std::size_t at = 0;
  for (std::size_t cut : cuts) {
    out.append(p.push(text.substr(at, cut - at)));
    at = cut;
  }
  out.append(p.push(text.substr(at)));
  out.append(p.finish());
  return out;
}

bool same(const ChatOutput& a, const ChatOutput& b) {
  if (a.reasoning != b.reasoning || a.content != b.content || a.tool_calls.size() != b.tool_calls.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.tool_calls.size(); ++i) {
    if (a.tool_calls[i].name != b.tool_calls[i].name || a.tool_calls[i].arguments != b.tool_calls[i].arguments) {
      return false;
    }
  }
  return true;
}

rwd::server::ToolParameterTypes every_type() {
  return {{"f",
           {{"i", "integer"},
            {"n", "number"},
            {"b", "boolean"},
            {"o", "object"},
            {"a", "array"},
            {"s", "string"},
            {"z", "null"}}}};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 3, size - 3);
  const std::size_t tools_len = std::min<std::size_t>(data[1], input.size());
  ChatSyntax syntax;
  syntax.think = data[0] & 1;
  syntax.tool_calls = data[0] & 2;
  syntax.in_reasoning = data[0] & 4;
  if (data[0] & 8) {
    syntax.parameter_types = every_type();
  } else {
    const nlohmann::json tools = nlohmann::json::parse(input.substr(0, tools_len), nullptr, false);
    if (!tools.is_discarded()) syntax.parameter_types = rwd::server::tool_parameter_types(tools);
  }
  const std::string_view text = input.substr(tools_len);

  const ChatOutput whole = parse(syntax, text, {});
  std::vector<std::size_t> bytes;
  for (std::size_t i = 1; i < text.size(); ++i) bytes.push_back(i);
  if (!same(parse(syntax, text, bytes), whole)) std::abort();
  std::vector<std::size_t> pieces;
  std::uint32_t s = data[2] * 2654435761u + 1;
  for (std::size_t at = 0;;) {
    s = s * 1103515245u + 12345u;
    at += 1 + (s >> 16) % 9;
    if (at >= text.size()) break;
    pieces.push_back(at);
  }
  if (!same(parse(syntax, text, pieces), whole)) std::abort();

  std::vector<std::string> ids;
  for (std::size_t i = 0; i < whole.tool_calls.size(); ++i) {
    const auto& call = whole.tool_calls[i];
    ids.push_back("call_" + std::to_string(i));
    (void)rwd::server::tool_call_json(call, ids.back(), static_cast<int>(i))
        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  (void)rwd::server::chat_message_json(whole, ids).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return 0;
}
