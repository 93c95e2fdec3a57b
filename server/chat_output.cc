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

// A tool call's body when it is {"name": string, "arguments": object or
// string (optional)}; the model's key order kept in the arguments.
bool parse_tool_call(std::string_view body, ToolCall& call) {
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

void ChatOutputParser::drain(bool final, ChatOutput& out) {
  const auto reasoning = [&](std::string_view s) {
    if (!reasoning_started_) {
      while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
      if (!s.empty()) reasoning_started_ = true;
    }
    out.reasoning += s;
  };
  // Content, less the whitespace next to a tool call: a whitespace tail is
  // held in space_, dropped if a tool call follows it, emitted with the
  // next content otherwise (so text on both sides of a call keeps its
  // separator); whitespace after a call that no content preceded is dropped.
  const auto content = [&](std::string_view s) {
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
  };
  for (;;) {
    switch (state_) {
      case State::kStart: {
        std::size_t i = 0;
        while (i < held_.size() && is_space(held_[i])) ++i;
        const std::string_view rest = std::string_view(held_).substr(i);
        if (rest.starts_with(kThink)) {
          held_.erase(0, i + kThink.size());
          state_ = State::kReasoning;
          continue;
        }
        if (!final && kThink.starts_with(rest)) return;  // may still become <think>
        state_ = State::kContent;
        continue;
      }
      case State::kReasoning: {
        const std::size_t at = held_.find(kEndThink);
        std::size_t end = at != std::string::npos ? at
                          : final                 ? held_.size()
                                                  : held_.size() - tag_prefix_tail(held_, kEndThink);
        while (end > 0 && held_[end - 1] == '\n') --end;
        if (at == std::string::npos && !final) end -= incomplete_utf8(held_, end);
        reasoning(std::string_view(held_).substr(0, end));
        if (at != std::string::npos) {
          held_.erase(0, at + kEndThink.size());
          state_ = State::kContent;
          after_think_ = true;
          continue;
        }
        held_.erase(0, final ? held_.size() : end);
        return;
      }
      case State::kContent: {
        if (after_think_) {
          std::size_t i = 0;
          while (i < held_.size() && held_[i] == '\n') ++i;
          held_.erase(0, i);
          if (held_.empty() && !final) return;
          after_think_ = false;
        }
        const std::size_t at = syntax_.tool_calls ? held_.find(kToolCall) : std::string::npos;
        if (at != std::string::npos) {
          content(std::string_view(held_).substr(0, at));
          held_.erase(0, at + kToolCall.size());
          state_ = State::kToolCall;
          continue;
        }
        if (final) {
          content(held_);
          held_.clear();
          if (tool_calls_ == 0) out.content += space_;
          space_.clear();
          return;
        }
        std::size_t end = held_.size() - (syntax_.tool_calls ? tag_prefix_tail(held_, kToolCall) : 0);
        end -= incomplete_utf8(held_, end);
        content(std::string_view(held_).substr(0, end));
        held_.erase(0, end);
        return;
      }
      case State::kToolCall: {
        const std::size_t at = held_.find(kEndToolCall);
        if (at == std::string::npos) {
          if (!final) return;
          content(std::string(kToolCall) + held_);  // unterminated: the model's text as it is
          held_.clear();
          state_ = State::kContent;
          continue;
        }
        ToolCall call;
        if (parse_tool_call(std::string_view(held_).substr(0, at), call)) {
          out.tool_calls.push_back(std::move(call));
          ++tool_calls_;
          space_.clear();
        } else {
          content(std::string(kToolCall) + held_.substr(0, at + kEndToolCall.size()));
        }
        held_.erase(0, at + kEndToolCall.size());
        state_ = State::kContent;
        continue;
      }
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
