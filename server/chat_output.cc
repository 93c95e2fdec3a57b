#include "server/chat_output.h"

#include <algorithm>
#include <utility>

namespace rwd::server {
namespace {

constexpr std::string_view kThink = "<think>";
constexpr std::string_view kEndThink = "</think>";
constexpr std::string_view kToolCall = "<tool_call>";
constexpr std::string_view kEndToolCall = "</tool_call>";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// The length of the longest tail of s that is a proper prefix of `tag`.
std::size_t tag_prefix_tail(const std::string& s, std::string_view tag) {
  for (std::size_t n = std::min(tag.size() - 1, s.size()); n > 0; --n) {
    if (s.compare(s.size() - n, n, tag.data(), n) == 0) return n;
  }
  return 0;
}

// The bytes at the end of s[0, end) that begin a UTF-8 sequence not yet
// complete: held, so that every piece emitted is whole characters.
std::size_t incomplete_utf8(const std::string& s, std::size_t end) {
  for (std::size_t back = 1; back <= 3 && back <= end; ++back) {
    const auto c = static_cast<unsigned char>(s[end - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return len > back ? back : 0;
  }
  return 0;
}

// `text` as the JSON value a parameter of schema type `type` takes, or as
// the string when it is not one (ChatSyntax::parameter_types).
nlohmann::ordered_json typed_argument(const std::string& text, const std::string* type) {
  if (type == nullptr || *type == "string") return text;
  std::size_t b = 0, e = text.size();
  while (b < e && is_space(text[b])) ++b;
  while (e > b && is_space(text[e - 1])) --e;
  const std::string_view t = std::string_view(text).substr(b, e - b);
  if (t == "null") return nullptr;
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(t, nullptr, false);
  if (j.is_discarded()) return text;
  const bool fits = (*type == "integer" && (j.is_number_integer() || j.is_number_unsigned())) ||
                    (*type == "number" && j.is_number()) || (*type == "boolean" && j.is_boolean()) ||
                    (*type == "object" && j.is_object()) || (*type == "array" && j.is_array());
  return fits ? j : nlohmann::ordered_json(text);
}

// Skips whitespace, then `tag` if it comes next.
bool take(std::string_view& s, std::string_view tag) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  if (!s.starts_with(tag)) return false;
  s.remove_prefix(tag.size());
  return true;
}

// The NAME of `<tag=NAME>` at the front of `s` (after whitespace), which
// is then consumed; empty when `s` does not start so.
std::string take_named(std::string_view& s, std::string_view tag) {
  std::string_view rest = s;
  if (!take(rest, tag)) return {};
  const std::size_t close = rest.find('>');
  if (close == std::string_view::npos || close == 0) return {};
  const std::string_view name = rest.substr(0, close);
  if (name.find_first_of("<\n") != std::string_view::npos) return {};
  s = rest.substr(close + 1);
  return std::string(name);
}

// Qwen3-Coder's XML body: <function=NAME> (<parameter=KEY>\nVALUE\n
// </parameter>)* </function>, whitespace around the tags; the model's
// parameter order kept.
bool parse_xml_tool_call(std::string_view body, const ToolParameterTypes& types, ToolCall& call) {
  const std::string name = take_named(body, "<function=");
  if (name.empty()) return false;
  const auto fn = types.find(name);
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  for (;;) {
    if (take(body, "</function>")) break;
    const std::string key = take_named(body, "<parameter=");
    if (key.empty() || args.contains(key)) return false;
    const std::size_t end = body.find("</parameter>");
    if (end == std::string_view::npos) return false;
    std::string_view value = body.substr(0, end);
    if (value.starts_with('\n')) value.remove_prefix(1);
    if (value.ends_with('\n')) value.remove_suffix(1);
    body.remove_prefix(end + std::string_view("</parameter>").size());
    const std::string* type = nullptr;
    if (fn != types.end()) {
      const auto t = fn->second.find(key);
      if (t != fn->second.end()) type = &t->second;
    }
    args[key] = typed_argument(std::string(value), type);
  }
  while (!body.empty() && is_space(body.front())) body.remove_prefix(1);
  if (!body.empty()) return false;
  call.name = name;
  // A byte-level model can write bytes that are not UTF-8; JSON text cannot
  // hold them, so they become U+FFFD, as the server writes content.
  call.arguments = args.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  return true;
}

// A tool call's body when it is {"name": string, "arguments": object or
// string (optional)}, or the XML form; the model's key order kept in the
// arguments.
bool parse_tool_call(std::string_view body, const ToolParameterTypes& types, ToolCall& call) {
  if (std::string_view rest = body; take(rest, "<function=")) return parse_xml_tool_call(body, types, call);
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return false;
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return false;
  const auto args = j.find("arguments");
  if (args == j.end()) {
    call.arguments = "{}";
  } else if (args->is_object()) {
    call.arguments = args->dump();
  } else if (args->is_string()) {
    call.arguments = args->get<std::string>();
  } else {
    return false;
  }
  call.name = name->get<std::string>();
  return true;
}

}  // namespace

ToolParameterTypes tool_parameter_types(const nlohmann::json& tools) {
  ToolParameterTypes out;
  if (!tools.is_array()) return out;
  for (const nlohmann::json& tool : tools) {
    if (!tool.is_object()) continue;
    const auto fn = tool.find("function");
    if (fn == tool.end() || !fn->is_object()) continue;
    const auto name = fn->find("name");
    const auto params = fn->find("parameters");
    if (name == fn->end() || !name->is_string() || params == fn->end() || !params->is_object()) continue;
    const auto props = params->find("properties");
    if (props == params->end() || !props->is_object()) continue;
    auto& types = out[name->get<std::string>()];
    for (const auto& [key, schema] : props->items()) {
      if (!schema.is_object()) continue;
      const auto type = schema.find("type");
      if (type == schema.end()) continue;
      if (type->is_string()) {
        types[key] = type->get<std::string>();
        continue;
      }
      if (!type->is_array()) continue;
      for (const nlohmann::json& t : *type) {
        if (t.is_string() && t.get_ref<const std::string&>() != "null") {
          types[key] = t.get<std::string>();
          break;
        }
      }
    }
  }
  return out;
}

ChatSyntax chat_syntax(std::string_view template_source, std::string_view prompt) {
  ChatSyntax s;
  s.think = template_source.find(kEndThink) != std::string_view::npos;
  s.tool_calls = template_source.find(kToolCall) != std::string_view::npos &&
                 template_source.find(kEndToolCall) != std::string_view::npos;
  if (s.think) {
    std::size_t end = prompt.size();
    while (end > 0 && is_space(prompt[end - 1])) --end;
    s.in_reasoning = prompt.substr(0, end).ends_with(kThink);
  }
  return s;
}

void ChatOutput::append(ChatOutput&& more) {
  reasoning += more.reasoning;
  content += more.content;
  for (ToolCall& c : more.tool_calls) tool_calls.push_back(std::move(c));
}

ChatOutputParser::ChatOutputParser(ChatSyntax syntax)
    : syntax_(syntax), state_(syntax.think && syntax.in_reasoning ? State::kReasoning
                              : syntax.think                      ? State::kStart
                                                                  : State::kContent) {}

ChatOutput ChatOutputParser::push(std::string_view text) {
  ChatOutput out;
  if (!syntax_.any()) {
    out.content.assign(text);
    return out;
  }
  held_.append(text);
  drain(false, out);
  return out;
}

ChatOutput ChatOutputParser::finish() {
  ChatOutput out;
  if (syntax_.any()) drain(true, out);
  return out;
}

void ChatOutputParser::emit_reasoning(std::string_view s, ChatOutput& out) {
  if (!reasoning_started_) {
    while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
    if (!s.empty()) reasoning_started_ = true;
  }
  out.reasoning += s;
}

// Content, less the whitespace next to a tool call: a whitespace tail is
// held in space_, dropped if a tool call follows it, emitted with the next
// content otherwise (so text on both sides of a call keeps its separator);
// whitespace after a call that no content preceded is dropped.
void ChatOutputParser::emit_content(std::string_view s, ChatOutput& out) {
  if (!syntax_.tool_calls) {
    out.content += s;
    return;
  }
  if (tool_calls_ > 0 && !content_started_) {
    while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  }
  std::size_t last = s.size();
  while (last > 0 && is_space(s[last - 1])) --last;
  if (last == 0) {
    space_ += s;
    return;
  }
  out.content += space_;
  out.content += s.substr(0, last);
  space_.assign(s.substr(last));
  content_started_ = true;
}

bool ChatOutputParser::drain_start(bool final) {
  std::size_t i = 0;
  while (i < held_.size() && is_space(held_[i])) ++i;
  const std::string_view rest = std::string_view(held_).substr(i);
  if (rest.starts_with(kThink)) {
    held_.erase(0, i + kThink.size());
    state_ = State::kReasoning;
    return true;
  }
  if (!final && kThink.starts_with(rest)) return false;  // may still become <think>
  state_ = State::kContent;
  return true;
}

bool ChatOutputParser::drain_reasoning(bool final, ChatOutput& out) {
  const std::size_t at = held_.find(kEndThink);
  std::size_t end = at != std::string::npos ? at
                    : final                 ? held_.size()
                                            : held_.size() - tag_prefix_tail(held_, kEndThink);
  while (end > 0 && held_[end - 1] == '\n') --end;
  if (at == std::string::npos && !final) end -= incomplete_utf8(held_, end);
  emit_reasoning(std::string_view(held_).substr(0, end), out);
  if (at != std::string::npos) {
    held_.erase(0, at + kEndThink.size());
    state_ = State::kContent;
    after_think_ = true;
    return true;
  }
  held_.erase(0, final ? held_.size() : end);
  return false;
}

bool ChatOutputParser::drain_content(bool final, ChatOutput& out) {
  if (after_think_) {
    std::size_t i = 0;
    while (i < held_.size() && held_[i] == '\n') ++i;
    held_.erase(0, i);
    if (held_.empty() && !final) return false;
    after_think_ = false;
  }
  const std::size_t at = syntax_.tool_calls ? held_.find(kToolCall) : std::string::npos;
  if (at != std::string::npos) {
    emit_content(std::string_view(held_).substr(0, at), out);
    held_.erase(0, at + kToolCall.size());
    state_ = State::kToolCall;
    return true;
  }
  if (final) {
    emit_content(held_, out);
    held_.clear();
    if (tool_calls_ == 0) out.content += space_;
    space_.clear();
    return false;
  }
  std::size_t end = held_.size() - (syntax_.tool_calls ? tag_prefix_tail(held_, kToolCall) : 0);
  end -= incomplete_utf8(held_, end);
  emit_content(std::string_view(held_).substr(0, end), out);
  held_.erase(0, end);
  return false;
}

bool ChatOutputParser::drain_tool_call(bool final, ChatOutput& out) {
  const std::size_t at = held_.find(kEndToolCall);
  if (at == std::string::npos) {
    if (!final) return false;
    emit_content(std::string(kToolCall) + held_, out);  // unterminated: the model's text as it is
    held_.clear();
    state_ = State::kContent;
    return true;
  }
  ToolCall call;
  if (parse_tool_call(std::string_view(held_).substr(0, at), syntax_.parameter_types, call)) {
    out.tool_calls.push_back(std::move(call));
    ++tool_calls_;
    space_.clear();
  } else {
    emit_content(std::string(kToolCall) + held_.substr(0, at + kEndToolCall.size()), out);
  }
  held_.erase(0, at + kEndToolCall.size());
  state_ = State::kContent;
  return true;
}

void ChatOutputParser::drain(bool final, ChatOutput& out) {
  for (bool more = true; more;) {
    switch (state_) {
      case State::kStart: more = drain_start(final); break;
      case State::kReasoning: more = drain_reasoning(final, out); break;
      case State::kContent: more = drain_content(final, out); break;
      case State::kToolCall: more = drain_tool_call(final, out); break;
    }
  }
}

nlohmann::json tool_call_json(const ToolCall& call, const std::string& id, int index) {
  nlohmann::json j = {
      {"id", id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
  if (index >= 0) j["index"] = index;
  return j;
}

nlohmann::json chat_message_json(const ChatOutput& out, const std::vector<std::string>& ids) {
  nlohmann::json m = {{"role", "assistant"}};
  m["content"] = out.content.empty() && !out.tool_calls.empty() ? nlohmann::json(nullptr) : nlohmann::json(out.content);
  if (!out.reasoning.empty()) m["reasoning_content"] = out.reasoning;
  if (!out.tool_calls.empty()) {
    nlohmann::json calls = nlohmann::json::array();
    for (std::size_t i = 0; i < out.tool_calls.size(); ++i) calls.push_back(tool_call_json(out.tool_calls[i], ids[i]));
    m["tool_calls"] = std::move(calls);
  }
  return m;
}

}  // namespace rwd::server
