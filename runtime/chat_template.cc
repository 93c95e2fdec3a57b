// The chat-template renderer (runtime/chat_template.h): a lexer that applies
// transformers' whitespace settings while it cuts the source into text and
// tag tokens, a recursive-descent parser to a small tree, and a tree walker
// over JSON values. Value semantics follow @huggingface/jinja where it and
// Python's Jinja differ (none renders empty, booleans lower case, strip()
// ignores its argument), since that renderer is the reference.
#include "runtime/chat_template.h"

#include <unicode/uchar.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace rwd::runtime {

namespace {

using Json = nlohmann::ordered_json;

struct Pos {
  int line = 1, column = 1;
};

std::string where(Pos p) { return "line " + std::to_string(p.line) + ", column " + std::to_string(p.column); }

[[noreturn]] void fail(Pos p, const std::string& what) {
  throw TemplateError("chat template, " + where(p) + ": " + what);
}

// ---- UTF-8 helpers ----------------------------------------------------------

// Code points of `s` (invalid bytes pass as themselves, U+DC80 + byte style
// is not needed: the input came through a JSON parser, so it is UTF-8).
std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t n = 1;
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0xF0)
      n = 4;
    else if (c >= 0xE0)
      n = 3;
    else if (c >= 0xC0)
      n = 2;
    n = std::min(n, s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

char32_t decode_at(const std::string& s, std::size_t i, std::size_t& len) {
  const auto c = static_cast<unsigned char>(s[i]);
  auto cont = [&](std::size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) & 0x3F : 0; };
  if (c < 0x80) {
    len = 1;
    return c;
  }
  if (c < 0xE0) {
    len = 2;
    return (char32_t(c & 0x1F) << 6) | cont(1);
  }
  if (c < 0xF0) {
    len = 3;
    return (char32_t(c & 0x0F) << 12) | (cont(1) << 6) | cont(2);
  }
  len = 4;
  return (char32_t(c & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

// JavaScript's white space (String.prototype.trim): WhiteSpace and LineTerminator.
bool js_space(char32_t c) {
  return c == 32 || (c >= 9 && c <= 13) || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000 || c == 0xFEFF;
}

std::string trim_start(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    std::size_t n;
    if (!js_space(decode_at(s, i, n))) break;
    i += n;
  }
  return s.substr(i);
}

std::string trim_end(const std::string& s) {
  std::size_t end = 0;  // one past the last non-space code point
  for (std::size_t i = 0; i < s.size();) {
    std::size_t n;
    const bool space = js_space(decode_at(s, i, n));
    i += n;
    if (!space) end = i;
  }
  return s.substr(0, end);
}

std::string trim(const std::string& s) { return trim_end(trim_start(s)); }

// Length in UTF-16 code units, as JavaScript's String.length counts.
std::int64_t utf16_length(const std::string& s) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t len;
    const char32_t c = decode_at(s, i, len);
    n += c >= 0x10000 ? 2 : 1;
    i += len;
  }
  return n;
}

// Full Unicode case mapping (ß -> SS), as JavaScript's toUpperCase / toLowerCase.
std::string change_case(const std::string& s, bool upper) {
  UErrorCode err = U_ZERO_ERROR;
  std::int32_t n16 = 0;
  u_strFromUTF8(nullptr, 0, &n16, s.data(), static_cast<std::int32_t>(s.size()), &err);
  err = U_ZERO_ERROR;
  std::u16string in(static_cast<std::size_t>(n16), u'\0');
  u_strFromUTF8(in.data(), n16, nullptr, s.data(), static_cast<std::int32_t>(s.size()), &err);
  std::u16string out(in.size() * 3 + 4, u'\0');
  err = U_ZERO_ERROR;
  const std::int32_t m = upper
                             ? u_strToUpper(out.data(), static_cast<std::int32_t>(out.size()), in.data(), n16, "", &err)
                             : u_strToLower(out.data(), static_cast<std::int32_t>(out.size()), in.data(), n16, "",
                                            &err);
  if (U_FAILURE(err)) return s;
  std::int32_t n8 = 0;
  err = U_ZERO_ERROR;
  u_strToUTF8(nullptr, 0, &n8, out.data(), m, &err);
  std::string r(static_cast<std::size_t>(n8), '\0');
  err = U_ZERO_ERROR;
  u_strToUTF8(r.data(), n8, nullptr, out.data(), m, &err);
  return r;
}

// JavaScript's Number.prototype.toString for a finite double.
std::string js_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  if (v == 0) return "0";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const std::size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int n = std::stoi(sci.substr(e + 1)) + 1;  // decimal point position
  const int k = static_cast<int>(digits.size());
  std::string out;
  if (k <= n && n <= 21) {
    out = digits + std::string(static_cast<std::size_t>(n - k), '0');
  } else if (0 < n && n <= 21) {
    out = digits.substr(0, static_cast<std::size_t>(n)) + "." + digits.substr(static_cast<std::size_t>(n));
  } else if (-6 < n && n <= 0) {
    out = "0." + std::string(static_cast<std::size_t>(-n), '0') + digits;
  } else {
    out = digits.substr(0, 1);
    if (k > 1) out += "." + digits.substr(1);
    out += (n - 1 >= 0 ? "e+" : "e-") + std::to_string(std::abs(n - 1));
  }
  return sign + out;
}

// ---- values -----------------------------------------------------------------

struct Node;

// A template value: undefined, a JSON value (shared, so member access and
// loops do not copy), a namespace (mutable, shared by every copy), or a
// macro (its definition in the parsed tree, which outlives every render).
struct Value {
  enum class Kind { Undefined, Data, Namespace, Macro };
  Kind kind = Kind::Undefined;
  std::shared_ptr<const Json> data;
  std::shared_ptr<Json> ns;
  const Node* macro = nullptr;

  static Value of(Json j) {
    Value v;
    v.kind = Kind::Data;
    v.data = std::make_shared<const Json>(std::move(j));
    return v;
  }
  // A part of `parent`'s data, sharing its ownership.
  static Value part(const Value& parent, const Json& j) {
    Value v;
    v.kind = Kind::Data;
    v.data = std::shared_ptr<const Json>(
        parent.kind == Kind::Namespace ? std::shared_ptr<const Json>(parent.ns) : parent.data, &j);
    return v;
  }
  bool undefined() const { return kind == Kind::Undefined; }
  const Json& j() const {
    static const Json null_json;
    if (kind == Kind::Namespace) return *ns;
    return data ? *data : null_json;
  }
  bool is_null() const { return kind == Kind::Data && j().is_null(); }
  bool is_string() const { return kind == Kind::Data && j().is_string(); }
  bool is_int() const { return kind == Kind::Data && j().is_number_integer(); }
  bool is_float() const { return kind == Kind::Data && j().is_number_float(); }
  bool is_number() const { return is_int() || is_float(); }
  bool is_bool() const { return kind == Kind::Data && j().is_boolean(); }
  bool is_list() const { return kind == Kind::Data && j().is_array(); }
  bool is_dict() const { return kind == Kind::Namespace || (kind == Kind::Data && j().is_object()); }
  double num() const { return j().get<double>(); }
  const std::string& str() const { return j().get_ref<const std::string&>(); }
};

const char* type_name(const Value& v) {
  if (v.undefined()) return "undefined";
  if (v.kind == Value::Kind::Namespace) return "namespace";
  if (v.kind == Value::Kind::Macro) return "macro";
  switch (v.j().type()) {
    case Json::value_t::null: return "none";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "list";
    case Json::value_t::object: return "dict";
    case Json::value_t::number_float: return "float";
    default: return "integer";
  }
}

bool truthy(const Value& v) {
  if (v.undefined()) return false;
  if (v.kind == Value::Kind::Namespace || v.kind == Value::Kind::Macro) return true;
  const Json& j = v.j();
  switch (j.type()) {
    case Json::value_t::null: return false;
    case Json::value_t::boolean: return j.get<bool>();
    case Json::value_t::string: return !j.get_ref<const std::string&>().empty();
    case Json::value_t::array:
    case Json::value_t::object: return !j.empty();
    case Json::value_t::number_float: return j.get<double>() != 0;
    default: return j.get<std::int64_t>() != 0;
  }
}

std::string json_string(const std::string& s) { return Json(s).dump(-1, ' ', false, Json::error_handler_t::replace); }

// tojson as @huggingface/jinja writes it: ", " and ": " separators (","
// with an indent), numbers as JavaScript writes them.
void to_json(const Json& j, int indent, int depth, std::string& out) {
  const std::string item_sep = indent > 0 ? "," : ", ";
  const std::string pad = "\n" + std::string(static_cast<std::size_t>(indent * depth), ' ');
  const std::string child_pad = pad + std::string(static_cast<std::size_t>(indent), ' ');
  switch (j.type()) {
    case Json::value_t::null: out += "null"; break;
    case Json::value_t::boolean: out += j.get<bool>() ? "true" : "false"; break;
    case Json::value_t::string: out += json_string(j.get_ref<const std::string&>()); break;
    case Json::value_t::number_float: out += js_number(j.get<double>()); break;
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: out += j.dump(); break;
    case Json::value_t::array: {
      out += '[';
      bool first = true;
      for (const Json& e : j) {
        if (!first) out += item_sep;
        if (indent > 0) out += child_pad;
        first = false;
        to_json(e, indent, depth + 1, out);
      }
      if (indent > 0 && !j.empty()) out += pad;
      out += ']';
      break;
    }
    case Json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, e] : j.items()) {
        if (!first) out += item_sep;
        if (indent > 0) out += child_pad;
        first = false;
        out += json_string(k) + ": ";
        to_json(e, indent, depth + 1, out);
      }
      if (indent > 0 && !j.empty()) out += pad;
      out += '}';
      break;
    }
    default: out += j.dump(); break;
  }
}

std::string to_json(const Value& v, int indent = 0) {
  if (v.undefined()) return "null";
  std::string out;
  to_json(v.j(), indent, 0, out);
  return out;
}

// How {{ v }} renders v.
std::string render_value(const Value& v) {
  if (v.undefined()) return "";
  if (v.kind == Value::Kind::Namespace) return to_json(v);
  if (v.kind == Value::Kind::Macro) return "";
  const Json& j = v.j();
  switch (j.type()) {
    case Json::value_t::null: return "";
    case Json::value_t::boolean: return j.get<bool>() ? "true" : "false";
    case Json::value_t::string: return j.get_ref<const std::string&>();
    case Json::value_t::number_float: {
      const double d = j.get<double>();
      if (d == 0 && std::signbit(d)) return "-0.0";
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e21) return js_number(d) + ".0";
      return js_number(d);
    }
    case Json::value_t::array:
    case Json::value_t::object: return to_json(v);
    default: return j.dump();
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.undefined() || b.undefined()) return a.undefined() && b.undefined();
  if (a.is_number() && b.is_number()) return a.num() == b.num();
  return a.j() == b.j();
}

// JavaScript's input numbers carry no integer / float distinction: an
// integral float (2.0 in the JSON) is an integer to the reference.
void normalize(Json& j) {
  if (j.is_number_float()) {
    const double d = j.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9007199254740992.0) {
      j = static_cast<std::int64_t>(d);
    }
  } else if (j.is_array() || j.is_object()) {
    for (auto& e : j) normalize(e);
  }
}

// ---- lexer ------------------------------------------------------------------

enum class Tok { Text, OpenStmt, CloseStmt, OpenExpr, CloseExpr, Name, Int, Float, String, Op, End };

struct Token {
  Tok type;
  std::string s;
  Pos pos;
};

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(source) {
    // transformers' keep_trailing_newline=False drops one final newline.
    if (!src_.empty() && src_.back() == '\n') src_.remove_suffix(1);
  }

  std::vector<Token> run() {
    while (i_ < src_.size()) {
      if (!in_tag_) {
        lex_text();
      } else {
        lex_tag_token();
      }
    }
    if (in_tag_) fail(tag_pos_, std::string("unclosed ") + (tag_is_stmt_ ? "{%" : "{{"));
    out_.push_back({Tok::End, "", pos()});
    return std::move(out_);
  }

 private:
  Pos pos() const { return pos_; }
  void advance(std::size_t n) {
    for (std::size_t k = 0; k < n && i_ < src_.size(); ++k, ++i_) {
      const auto c = static_cast<unsigned char>(src_[i_]);
      if (c == '\n') {
        ++pos_.line;
        pos_.column = 1;
      } else if ((c & 0xC0) != 0x80) {
        ++pos_.column;
      }
    }
  }
  bool at(std::string_view s) const { return src_.substr(i_, s.size()) == s; }

  void skip_leading_space() {
    while (i_ < src_.size()) {
      std::size_t n;
      const std::string rest(src_.substr(i_, 4));
      if (!js_space(decode_at(rest, 0, n))) break;
      advance(n);
    }
  }

  void push_text(std::string text) {
    if (!text.empty()) out_.push_back({Tok::Text, std::move(text), text_pos_});
  }

  void lex_text() {
    const std::size_t start = i_;
    text_pos_ = pos();
    // trim_blocks: the newline right after a block tag or comment is dropped.
    if (after_block_ && i_ < src_.size() && src_[i_] == '\n') advance(1);
    after_block_ = false;
    const std::size_t text_start = i_;
    std::size_t end = i_;
    while (true) {
      end = src_.find('{', end);
      if (end == std::string_view::npos) {
        end = src_.size();
        break;
      }
      if (end + 1 < src_.size() && (src_[end + 1] == '%' || src_[end + 1] == '{' || src_[end + 1] == '#')) break;
      ++end;
    }
    std::string text(src_.substr(text_start, end - text_start));
    advance(end - text_start);
    if (i_ >= src_.size()) {
      push_text(std::move(text));
      return;
    }
    const char kind = src_[i_ + 1];
    const bool strip_before = i_ + 2 < src_.size() && src_[i_ + 2] == '-';
    // lstrip_blocks: spaces and tabs from the start of a line up to a block
    // tag or a comment are dropped (the line start as in the source).
    if ((kind == '%' || kind == '#') && !strip_before) {
      std::size_t line_start = text.rfind('\n');
      bool at_line_start = true;
      if (line_start == std::string::npos) {
        line_start = 0;
        at_line_start = start == 0 || src_[start - 1] == '\n';
        // the trim_blocks newline counts as the previous line's end
        if (text_start != start) at_line_start = true;
      } else {
        ++line_start;
      }
      if (at_line_start && text.find_first_not_of(" \t", line_start) == std::string::npos) text.resize(line_start);
    }
    if (strip_before) text = trim_end(text);
    push_text(std::move(text));
    tag_pos_ = pos();
    if (kind == '#') {
      const std::size_t close = src_.find("#}", i_ + 2);
      if (close == std::string_view::npos) fail(tag_pos_, "unclosed comment {#");
      const bool strip_after = close > i_ + 2 && src_[close - 1] == '-';
      advance(close + 2 - i_);
      if (strip_after) skip_leading_space();
      after_block_ = true;
      return;
    }
    tag_is_stmt_ = kind == '%';
    out_.push_back({tag_is_stmt_ ? Tok::OpenStmt : Tok::OpenExpr, "", tag_pos_});
    advance(strip_before ? 3 : 2);
    in_tag_ = true;
  }

  void lex_tag_token() {
    while (i_ < src_.size() && (src_[i_] == ' ' || src_[i_] == '\t' || src_[i_] == '\n' || src_[i_] == '\r')) {
      advance(1);
    }
    if (i_ >= src_.size()) return;
    const Pos p = pos();
    const std::string close = tag_is_stmt_ ? "%}" : "}}";
    if (at("-" + close) || at(close)) {
      const bool strip_after = src_[i_] == '-';
      advance(strip_after ? 3 : 2);
      out_.push_back({tag_is_stmt_ ? Tok::CloseStmt : Tok::CloseExpr, "", p});
      in_tag_ = false;
      if (strip_after) skip_leading_space();
      after_block_ = tag_is_stmt_;
      return;
    }
    const char c = src_[i_];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t n = 0;
      while (i_ + n < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[i_ + n])) || src_[i_ + n] == '_'))
        ++n;
      out_.push_back({Tok::Name, std::string(src_.substr(i_, n)), p});
      advance(n);
      return;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      std::size_t n = 0;
      while (i_ + n < src_.size() && std::isdigit(static_cast<unsigned char>(src_[i_ + n]))) ++n;
      bool is_float = false;
      if (i_ + n + 1 < src_.size() && src_[i_ + n] == '.' &&
          std::isdigit(static_cast<unsigned char>(src_[i_ + n + 1]))) {
        is_float = true;
        ++n;
        while (i_ + n < src_.size() && std::isdigit(static_cast<unsigned char>(src_[i_ + n]))) ++n;
      }
      out_.push_back({is_float ? Tok::Float : Tok::Int, std::string(src_.substr(i_, n)), p});
      advance(n);
      return;
    }
    if (c == '\'' || c == '"') {
      out_.push_back({Tok::String, lex_string(c, p), p});
      return;
    }
    static const char* const ops[] = {"**", "//", "==", "!=", "<=", ">=", "(", ")", "[", "]", "{", "}", ",",
                                      ".",  ":",  "|",  "+",  "-",  "*",  "/", "%", "~", "<", ">", "="};
    for (const char* op : ops) {
      if (at(op)) {
        out_.push_back({Tok::Op, op, p});
        advance(std::char_traits<char>::length(op));
        return;
      }
    }
    fail(p, std::string("unexpected character '") + c + "' in a " + (tag_is_stmt_ ? "{% %}" : "{{ }}") + " tag");
  }

  std::string lex_string(char quote, Pos p) {
    advance(1);
    std::string s;
    while (true) {
      if (i_ >= src_.size()) fail(p, "unterminated string literal");
      const char c = src_[i_];
      if (c == quote) {
        advance(1);
        return s;
      }
      if (c != '\\') {
        s += c;
        advance(1);
        continue;
      }
      if (i_ + 1 >= src_.size()) fail(p, "unterminated string literal");
      const char e = src_[i_ + 1];
      const Pos ep = pos();
      advance(2);
      switch (e) {
        case 'n': s += '\n'; break;
        case 't': s += '\t'; break;
        case 'r': s += '\r'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'v': s += '\v'; break;
        case '\'': s += '\''; break;
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case 'x':
        case 'u': {
          const std::size_t n = e == 'x' ? 2 : 4;
          const std::string hex(src_.substr(i_, n));
          if (hex.size() != n || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
            fail(ep, "invalid \\" + std::string(1, e) + " escape in a string literal");
          }
          advance(n);
          const auto cp = static_cast<char32_t>(std::stoul(hex, nullptr, 16));
          if (cp < 0x80) {
            s += static_cast<char>(cp);
          } else if (cp < 0x800) {
            s += static_cast<char>(0xC0 | (cp >> 6));
            s += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            s += static_cast<char>(0xE0 | (cp >> 12));
            s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            s += static_cast<char>(0x80 | (cp & 0x3F));
          }
          break;
        }
        default: fail(ep, std::string("unknown escape \\") + e + " in a string literal");
      }
    }
  }

  std::string_view src_;
  std::size_t i_ = 0;
  Pos pos_;
  Pos text_pos_, tag_pos_;
  bool in_tag_ = false, tag_is_stmt_ = false, after_block_ = false;
  std::vector<Token> out_;
};

// ---- tree -------------------------------------------------------------------

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum class K { Literal, Name, List, Dict, Member, Index, Slice, Call, Filter, Test, Unary, Binary, And, Or, Cond };
  K k;
  Pos pos;
  std::string s;  // name, attribute, operator, filter or test
  Json lit;
  std::vector<ExprP> a;  // operands (null for an omitted slice bound)
  std::vector<std::pair<std::string, ExprP>> kwargs;
  bool negate = false;  // `is not`
};

using Body = std::vector<Node>;

struct Node {
  enum class K { Text, Output, If, For, Set, SetBlock, Break, Continue, Macro };
  K k;
  Pos pos;
  std::string text;
  ExprP e;                                            // Output, Set value, For iterable
  std::vector<std::string> targets;                   // For / Set names
  std::string attr;                                   // Set ns.attr
  std::vector<std::pair<ExprP, Body>> branches;       // If: (condition, body)
  Body body, else_body;                               // For, SetBlock; If's else, For's else
  ExprP filter;                                       // For ... if cond
  std::vector<std::pair<std::string, ExprP>> params;  // Macro: parameters and defaults (null: none)
};

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_all() {
    std::string stop;
    Body body = parse_body({}, stop);
    return body;
  }

 private:
  const Token& peek(std::size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool is_op(const char* op, std::size_t k = 0) const { return peek(k).type == Tok::Op && peek(k).s == op; }
  bool is_name(const char* n, std::size_t k = 0) const { return peek(k).type == Tok::Name && peek(k).s == n; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::End: return "the end of the template";
      case Tok::CloseStmt: return "'%}'";
      case Tok::CloseExpr: return "'}}'";
      case Tok::Text: return "text";
      case Tok::String: return "a string";
      default: return "'" + t.s + "'";
    }
  }
  [[noreturn]] void unexpected(const std::string& wanted) const {
    fail(peek().pos, "expected " + wanted + ", found " + describe(peek()));
  }
  void expect_op(const char* op) {
    if (!is_op(op)) unexpected(std::string("'") + op + "'");
    ++i_;
  }
  void expect_close_stmt() {
    if (peek().type != Tok::CloseStmt) unexpected("'%}'");
    ++i_;
  }
  std::string expect_name() {
    if (peek().type != Tok::Name) unexpected("a name");
    return next().s;
  }

  // Parses nodes until a {% tag %} whose keyword is in `stops`; leaves the
  // keyword in `stop` and the parser after the keyword.
  Body parse_body(const std::vector<std::string>& stops, std::string& stop) {
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::End) {
        if (!stops.empty()) {
          std::string list;
          for (const auto& s : stops) list += (list.empty() ? "{% " : " or {% ") + s + " %}";
          fail(t.pos, "expected " + list + " before the end of the template");
        }
        return body;
      }
      if (t.type == Tok::Text) {
        Node n{};
        n.k = Node::K::Text;
        n.pos = t.pos;
        n.text = t.s;
        body.push_back(std::move(n));
        ++i_;
        continue;
      }
      if (t.type == Tok::OpenExpr) {
        ++i_;
        Node n{};
        n.k = Node::K::Output;
        n.pos = t.pos;
        n.e = parse_expr();
        if (peek().type != Tok::CloseExpr) unexpected("'}}'");
        ++i_;
        body.push_back(std::move(n));
        continue;
      }
      if (t.type != Tok::OpenStmt) unexpected("text, '{{' or '{%'");
      ++i_;
      const Token& kw = peek();
      if (kw.type != Tok::Name) unexpected("a statement keyword");
      for (const auto& s : stops) {
        if (kw.s == s) {
          ++i_;
          stop = s;
          return body;
        }
      }
      body.push_back(parse_statement());
    }
  }

  Node parse_statement() {
    const Token kw = next();
    Node n{};
    n.pos = kw.pos;
    if (kw.s == "if") return parse_if(std::move(n));
    if (kw.s == "for") return parse_for(std::move(n));
    if (kw.s == "set") return parse_set(std::move(n));
    if (kw.s == "break" || kw.s == "continue") {
      n.k = kw.s == "break" ? Node::K::Break : Node::K::Continue;
      expect_close_stmt();
      return n;
    }
    if (kw.s == "generation") {  // transformers' assistant-mask marker: renders its body
      n.k = Node::K::If;
      n.branches.emplace_back(literal(Json(true), kw.pos), parse_block("endgeneration"));
      return n;
    }
    if (kw.s == "macro") return parse_macro(std::move(n));
    fail(kw.pos, "unsupported statement {% " + kw.s +
                     " %} (supported: if, elif, else, endif, for, endfor, set, endset, macro, endmacro, break, "
                     "continue)");
  }

  // The body of a statement whose tag is parsed up to its '%}', through its
  // {% end %} tag.
  Body parse_block(const char* end) {
    expect_close_stmt();
    std::string stop;
    Body body = parse_body({end}, stop);
    expect_close_stmt();
    return body;
  }

  // The parse_* statement helpers start after the keyword and end after the
  // statement's closing tag.
  Node parse_if(Node n) {
    n.k = Node::K::If;
    ExprP cond = parse_expr();
    expect_close_stmt();
    while (true) {
      std::string stop;
      Body b = parse_body({"elif", "else", "endif"}, stop);
      n.branches.emplace_back(std::move(cond), std::move(b));
      if (stop == "elif") {
        cond = parse_expr();
        expect_close_stmt();
        continue;
      }
      if (stop == "else") {
        expect_close_stmt();
        std::string end;
        n.else_body = parse_body({"endif"}, end);
      }
      expect_close_stmt();
      return n;
    }
  }

  Node parse_for(Node n) {
    n.k = Node::K::For;
    n.targets.push_back(expect_name());
    while (is_op(",")) {
      ++i_;
      n.targets.push_back(expect_name());
    }
    if (!is_name("in")) unexpected("'in'");
    ++i_;
    n.e = parse_or_level();  // `if` after the iterable filters it
    if (is_name("if")) {
      ++i_;
      n.filter = parse_or_level();
    }
    expect_close_stmt();
    std::string stop;
    n.body = parse_body({"else", "endfor"}, stop);
    if (stop == "else") {
      expect_close_stmt();
      n.else_body = parse_body({"endfor"}, stop);
    }
    expect_close_stmt();
    return n;
  }

  Node parse_set(Node n) {
    n.targets.push_back(expect_name());
    if (is_op(".")) {
      ++i_;
      n.attr = expect_name();
    } else {
      while (is_op(",")) {
        ++i_;
        n.targets.push_back(expect_name());
      }
    }
    if (is_op("=")) {
      ++i_;
      n.k = Node::K::Set;
      n.e = parse_expr_or_tuple();
      expect_close_stmt();
      return n;
    }
    if (n.targets.size() != 1 || !n.attr.empty()) unexpected("'='");
    n.k = Node::K::SetBlock;
    n.body = parse_block("endset");
    return n;
  }

  Node parse_macro(Node n) {
    n.k = Node::K::Macro;
    n.targets.push_back(expect_name());
    expect_op("(");
    while (!is_op(")")) {
      std::string param = expect_name();
      ExprP dflt;
      if (is_op("=")) {
        ++i_;
        dflt = parse_expr();
      }
      n.params.emplace_back(std::move(param), std::move(dflt));
      if (is_op(",")) {
        ++i_;
      } else if (!is_op(")")) {
        unexpected("',' or ')'");
      }
    }
    ++i_;
    n.body = parse_block("endmacro");
    return n;
  }

  static ExprP make(Expr::K k, Pos p, std::string s = {}) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->pos = p;
    e->s = std::move(s);
    return e;
  }
  static ExprP literal(Json j, Pos p) {
    ExprP e = make(Expr::K::Literal, p);
    e->lit = std::move(j);
    return e;
  }

  // `a, b` at the top of a set is a list.
  ExprP parse_expr_or_tuple() {
    const Pos p = peek().pos;
    ExprP first = parse_expr();
    if (!is_op(",")) return first;
    ExprP list = make(Expr::K::List, p);
    list->a.push_back(std::move(first));
    while (is_op(",")) {
      ++i_;
      list->a.push_back(parse_expr());
    }
    return list;
  }

 public:
  ExprP parse_expr() {
    ExprP value = parse_or_level();
    if (is_name("if")) {
      const Pos p = next().pos;
      ExprP cond = parse_or_level();
      ExprP e = make(Expr::K::Cond, p);
      e->a.push_back(std::move(value));
      e->a.push_back(std::move(cond));
      if (is_name("else")) {
        ++i_;
        e->a.push_back(parse_expr());
      }
      return e;
    }
    return value;
  }

 private:
  ExprP parse_or_level() {
    ExprP l = parse_and();
    while (is_name("or")) {
      const Pos p = next().pos;
      ExprP e = make(Expr::K::Or, p);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_and());
      l = std::move(e);
    }
    return l;
  }
  ExprP parse_and() {
    ExprP l = parse_not();
    while (is_name("and")) {
      const Pos p = next().pos;
      ExprP e = make(Expr::K::And, p);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_not());
      l = std::move(e);
    }
    return l;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      const Pos p = next().pos;
      ExprP e = make(Expr::K::Unary, p, "not");
      e->a.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP l = parse_additive();
    while (true) {
      std::string op;
      const Pos p = peek().pos;
      if (peek().type == Tok::Op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" || peek().s == "<=" ||
                                     peek().s == ">" || peek().s == ">=")) {
        op = next().s;
      } else if (is_name("in")) {
        ++i_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        i_ += 2;
        op = "not in";
      } else {
        return l;
      }
      ExprP e = make(Expr::K::Binary, p, op);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_additive());
      l = std::move(e);
    }
  }
  ExprP parse_additive() {
    ExprP l = parse_multiplicative();
    while (is_op("+") || is_op("-") || is_op("~")) {
      const Token& t = next();
      ExprP e = make(Expr::K::Binary, t.pos, t.s);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_multiplicative());
      l = std::move(e);
    }
    return l;
  }
  ExprP parse_multiplicative() {
    ExprP l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      ExprP e = make(Expr::K::Binary, t.pos, t.s);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_pow());
      l = std::move(e);
    }
    return l;
  }
  ExprP parse_pow() {
    ExprP l = parse_unary();
    while (is_op("**")) {
      const Token& t = next();
      ExprP e = make(Expr::K::Binary, t.pos, t.s);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_unary());
      l = std::move(e);
    }
    return l;
  }
  // Unary minus binds tighter than filters and tests (-x|abs is (-x)|abs),
  // as in the reference.
  ExprP parse_unary() { return parse_tests(parse_filters(parse_sign())); }
  ExprP parse_sign() {
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      ExprP e = make(Expr::K::Unary, t.pos, t.s);
      e->a.push_back(parse_sign());
      return e;
    }
    return parse_postfix(parse_primary());
  }
  ExprP parse_tests(ExprP l) {
    while (is_name("is")) {
      const Pos p = next().pos;
      bool negate = false;
      if (is_name("not")) {
        ++i_;
        negate = true;
      }
      std::string name;
      if (peek().type == Tok::Name) {
        name = next().s;
      } else {
        unexpected("a test name after 'is'");
      }
      ExprP e = make(Expr::K::Test, p, name);
      e->negate = negate;
      e->a.push_back(std::move(l));
      if (is_op("(")) parse_args(*e);
      l = std::move(e);
    }
    return l;
  }
  ExprP parse_filters(ExprP l) {
    while (is_op("|")) {
      ++i_;
      const Pos p = peek().pos;
      ExprP e = make(Expr::K::Filter, p, expect_name());
      e->a.push_back(std::move(l));
      if (is_op("(")) parse_args(*e);
      l = parse_postfix(std::move(e));
    }
    return l;
  }
  // (args, name=value) into e's operands after the first, and its kwargs.
  void parse_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == Tok::Name && is_op("=", 1)) {
        std::string key = next().s;
        ++i_;
        e.kwargs.emplace_back(std::move(key), parse_expr());
      } else {
        e.a.push_back(parse_expr());
      }
      if (is_op(",")) {
        ++i_;
      } else if (!is_op(")")) {
        unexpected("',' or ')'");
      }
    }
    ++i_;
  }
  ExprP parse_postfix(ExprP l) {
    while (true) {
      if (is_op(".")) {
        const Pos p = next().pos;
        ExprP e = make(Expr::K::Member, p, expect_name());
        e->a.push_back(std::move(l));
        l = std::move(e);
      } else if (is_op("[")) {
        const Pos p = next().pos;
        ExprP idx[3];
        int parts = 0;
        bool slice = false;
        while (true) {
          if (!is_op(":") && !is_op("]")) idx[parts] = parse_expr();
          if (is_op(":")) {
            ++i_;
            slice = true;
            if (++parts > 2) unexpected("']'");
            continue;
          }
          break;
        }
        expect_op("]");
        if (!slice) {
          if (!idx[0]) fail(p, "empty subscript []");
          ExprP e = make(Expr::K::Index, p);
          e->a.push_back(std::move(l));
          e->a.push_back(std::move(idx[0]));
          l = std::move(e);
        } else {
          ExprP e = make(Expr::K::Slice, p);
          e->a.push_back(std::move(l));
          for (auto& x : idx) e->a.push_back(std::move(x));
          l = std::move(e);
        }
      } else if (is_op("(")) {
        ExprP e = make(Expr::K::Call, peek().pos);
        e->a.push_back(std::move(l));
        parse_args(*e);
        l = std::move(e);
      } else {
        return l;
      }
    }
  }
  ExprP parse_primary() {
    const Token& t = peek();
    switch (t.type) {
      case Tok::Int: {
        ++i_;
        return literal(Json(std::stoll(t.s)), t.pos);
      }
      case Tok::Float: {
        ++i_;
        return literal(Json(std::stod(t.s)), t.pos);
      }
      case Tok::String: {
        std::string s;
        const Pos p = t.pos;
        while (peek().type == Tok::String) s += next().s;  // adjacent literals join
        return literal(Json(s), p);
      }
      case Tok::Name: {
        ++i_;
        if (t.s == "true" || t.s == "True") return literal(Json(true), t.pos);
        if (t.s == "false" || t.s == "False") return literal(Json(false), t.pos);
        if (t.s == "none" || t.s == "None") return literal(Json(nullptr), t.pos);
        return make(Expr::K::Name, t.pos, t.s);
      }
      case Tok::Op: {
        if (t.s == "(") {
          ++i_;
          ExprP e = parse_expr();
          if (is_op(",")) {  // a tuple: a list here
            ExprP list = make(Expr::K::List, t.pos);
            list->a.push_back(std::move(e));
            while (is_op(",")) {
              ++i_;
              if (is_op(")")) break;
              list->a.push_back(parse_expr());
            }
            e = std::move(list);
          }
          expect_op(")");
          return e;
        }
        if (t.s == "[") {
          ++i_;
          ExprP e = make(Expr::K::List, t.pos);
          while (!is_op("]")) {
            e->a.push_back(parse_expr());
            if (is_op(",")) {
              ++i_;
            } else if (!is_op("]")) {
              unexpected("',' or ']'");
            }
          }
          ++i_;
          return e;
        }
        if (t.s == "{") {
          ++i_;
          ExprP e = make(Expr::K::Dict, t.pos);
          while (!is_op("}")) {
            e->a.push_back(parse_expr());
            expect_op(":");
            e->a.push_back(parse_expr());
            if (is_op(",")) {
              ++i_;
            } else if (!is_op("}")) {
              unexpected("',' or '}'");
            }
          }
          ++i_;
          return e;
        }
        break;
      }
      default: break;
    }
    unexpected("an expression");
  }

  std::vector<Token> t_;
  std::size_t i_ = 0;
};

// ---- evaluation -------------------------------------------------------------

struct BreakSignal {};
struct ContinueSignal {};

class Renderer {
 public:
  Renderer(const Json& defaults, Value context) : defaults_(defaults), context_(std::move(context)) {}

  void run(const Body& body, std::string& out) {
    scopes_.emplace_back();
    exec(body, out);
  }

 private:
  using Scope = std::unordered_map<std::string, Value>;

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      const auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    const Json& c = context_.j();
    const auto f = c.find(name);
    if (f != c.end()) return Value::part(context_, *f);
    const auto d = defaults_.find(name);
    if (d != defaults_.end()) return Value::of(*d);
    return {};
  }

  void exec(const Body& body, std::string& out) {
    for (const Node& n : body) exec(n, out);
  }

  void exec(const Node& n, std::string& out) {
    switch (n.k) {
      case Node::K::Text: out += n.text; break;
      case Node::K::Output: out += render_value(eval(*n.e)); break;
      case Node::K::If: {
        for (const auto& [cond, b] : n.branches) {
          if (truthy(eval(*cond))) {
            exec(b, out);
            return;
          }
        }
        exec(n.else_body, out);
        break;
      }
      case Node::K::For: run_for(n, out); break;
      case Node::K::Set: {
        Value v = eval(*n.e);
        if (!n.attr.empty()) {
          Value target = lookup(n.targets[0]);
          if (target.kind != Value::Kind::Namespace) {
            fail(n.pos, "cannot set attribute '" + n.attr + "' of '" + n.targets[0] + "', a " + type_name(target) +
                            " (only a namespace() takes attributes)");
          }
          (*target.ns)[n.attr] = v.undefined() ? Json() : v.j();
        } else {
          assign(n.targets, v, n.pos);
        }
        break;
      }
      case Node::K::SetBlock: {
        std::string inner;
        exec(n.body, inner);
        scopes_.back()[n.targets[0]] = Value::of(Json(inner));
        break;
      }
      case Node::K::Break: throw BreakSignal{};
      case Node::K::Continue: throw ContinueSignal{};
      case Node::K::Macro: {
        Value m;
        m.kind = Value::Kind::Macro;
        m.macro = &n;
        scopes_.back()[n.targets[0]] = m;
        break;
      }
    }
  }

  void assign(const std::vector<std::string>& targets, const Value& v, Pos p) {
    if (targets.size() == 1) {
      scopes_.back()[targets[0]] = v;
      return;
    }
    if (!v.is_list() || v.j().size() != targets.size()) {
      fail(p, "cannot unpack a " + std::string(type_name(v)) + " into " + std::to_string(targets.size()) + " names");
    }
    for (std::size_t k = 0; k < targets.size(); ++k) scopes_.back()[targets[k]] = Value::part(v, v.j()[k]);
  }

  void run_for(const Node& n, std::string& out) {
    const Value seq = eval(*n.e);
    std::vector<Value> items;
    if (seq.is_list()) {
      for (const Json& e : seq.j()) items.push_back(Value::part(seq, e));
    } else if (seq.is_dict()) {
      for (const auto& [k, e] : seq.j().items()) items.push_back(Value::of(Json(k)));
    } else if (!seq.undefined()) {
      fail(n.e->pos, std::string("a for loop needs a list or a dict, got a ") + type_name(seq));
    }
    if (n.filter) {
      std::vector<Value> kept;
      for (const Value& v : items) {
        scopes_.emplace_back();
        assign(n.targets, v, n.pos);
        const bool keep = truthy(eval(*n.filter));
        scopes_.pop_back();
        if (keep) kept.push_back(v);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec(n.else_body, out);
      return;
    }
    const auto length = static_cast<std::int64_t>(items.size());
    for (std::int64_t k = 0; k < length; ++k) {
      scopes_.emplace_back();
      const auto uk = static_cast<std::size_t>(k);
      Json loop = {{"index0", k},
                   {"index", k + 1},
                   {"first", k == 0},
                   {"last", k == length - 1},
                   {"length", length},
                   {"revindex", length - k},
                   {"revindex0", length - k - 1}};
      if (k > 0) loop["previtem"] = items[uk - 1].undefined() ? Json() : items[uk - 1].j();
      if (k + 1 < length) loop["nextitem"] = items[uk + 1].undefined() ? Json() : items[uk + 1].j();
      scopes_.back()["loop"] = Value::of(std::move(loop));
      assign(n.targets, items[uk], n.pos);
      bool stop = false;
      try {
        exec(n.body, out);
      } catch (const BreakSignal&) {
        stop = true;
      } catch (const ContinueSignal&) {
      }
      scopes_.pop_back();
      if (stop) break;
    }
  }

  [[noreturn]] static void type_fail(const Expr& e, const std::string& what) { fail(e.pos, what); }

  static std::int64_t as_int(const Value& v, const Expr& e, const char* what) {
    if (!v.is_int()) type_fail(e, std::string(what) + " must be an integer, got a " + type_name(v));
    return v.j().get<std::int64_t>();
  }

  Value eval(const Expr& e) {
    switch (e.k) {
      case Expr::K::Literal: return Value::of(e.lit);
      case Expr::K::Name: return lookup(e.s);
      case Expr::K::List: {
        Json list = Json::array();
        for (const auto& x : e.a) {
          const Value v = eval(*x);
          list.push_back(v.undefined() ? Json() : v.j());
        }
        return Value::of(std::move(list));
      }
      case Expr::K::Dict: {
        Json dict = Json::object();
        for (std::size_t k = 0; k + 1 < e.a.size(); k += 2) {
          const Value key = eval(*e.a[k]);
          if (!key.is_string()) type_fail(*e.a[k], std::string("a dict key must be a string, got a ") + type_name(key));
          const Value v = eval(*e.a[k + 1]);
          dict[key.str()] = v.undefined() ? Json() : v.j();
        }
        return Value::of(std::move(dict));
      }
      case Expr::K::Member: return member(eval(*e.a[0]), e.s);
      case Expr::K::Index: return index(eval(*e.a[0]), eval(*e.a[1]), e);
      case Expr::K::Slice: return slice(e);
      case Expr::K::Call: return call(e);
      case Expr::K::Filter: return filter(e);
      case Expr::K::Test: {
        const bool r = test(e);
        return Value::of(Json(e.negate ? !r : r));
      }
      case Expr::K::Unary: {
        const Value v = eval(*e.a[0]);
        if (e.s == "not") return Value::of(Json(!truthy(v)));
        if (!v.is_number()) type_fail(e, "unary " + e.s + " needs a number, got a " + type_name(v));
        if (e.s == "+") return v;
        if (v.is_int()) return Value::of(Json(-v.j().get<std::int64_t>()));
        return Value::of(Json(-v.num()));
      }
      case Expr::K::And: {
        Value l = eval(*e.a[0]);
        return truthy(l) ? eval(*e.a[1]) : l;
      }
      case Expr::K::Or: {
        Value l = eval(*e.a[0]);
        return truthy(l) ? l : eval(*e.a[1]);
      }
      case Expr::K::Cond: {
        if (truthy(eval(*e.a[1]))) return eval(*e.a[0]);
        return e.a.size() > 2 ? eval(*e.a[2]) : Value{};
      }
      case Expr::K::Binary: return binary(e);
    }
    return {};
  }

  static Value member(const Value& obj, const std::string& name) {
    if (obj.is_dict()) {
      const Json& j = obj.j();
      const auto f = j.find(name);
      if (f != j.end()) return Value::part(obj, *f);
    }
    return {};
  }

  static Value index(const Value& obj, const Value& key, const Expr& e) {
    if (obj.is_dict()) {
      if (key.is_string()) return member(obj, key.str());
      return {};
    }
    if (obj.is_list() || obj.is_string()) {
      if (!key.is_int()) {
        if (key.is_string()) return {};  // e.g. list["x"]: undefined, as the reference
        type_fail(e, std::string("an index must be an integer, got a ") + type_name(key));
      }
      std::int64_t k = key.j().get<std::int64_t>();
      if (obj.is_list()) {
        const auto n = static_cast<std::int64_t>(obj.j().size());
        if (k < 0) k += n;
        if (k < 0 || k >= n) return {};
        return Value::part(obj, obj.j()[static_cast<std::size_t>(k)]);
      }
      const auto cps = code_points(obj.str());
      const auto n = static_cast<std::int64_t>(cps.size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return {};
      return Value::of(Json(cps[static_cast<std::size_t>(k)]));
    }
    return {};
  }

  Value slice(const Expr& e) {
    const Value obj = eval(*e.a[0]);
    std::optional<std::int64_t> bound[3];
    for (int k = 0; k < 3; ++k) {
      if (!e.a[static_cast<std::size_t>(k) + 1]) continue;
      const Value v = eval(*e.a[static_cast<std::size_t>(k) + 1]);
      if (v.undefined() || v.is_null()) continue;
      bound[k] = as_int(v, e, "a slice bound");
    }
    const std::int64_t step = bound[2].value_or(1);
    if (step == 0) type_fail(e, "slice step cannot be zero");
    std::vector<std::string> cps;
    std::int64_t n = 0;
    if (obj.is_list()) {
      n = static_cast<std::int64_t>(obj.j().size());
    } else if (obj.is_string()) {
      cps = code_points(obj.str());
      n = static_cast<std::int64_t>(cps.size());
    } else {
      type_fail(e, std::string("only a list or a string can be sliced, got a ") + type_name(obj));
    }
    std::int64_t start, stop;
    if (step > 0) {
      start = bound[0].value_or(0);
      start = start < 0 ? std::max<std::int64_t>(n + start, 0) : std::min(start, n);
      stop = bound[1].value_or(n);
      stop = stop < 0 ? std::max<std::int64_t>(n + stop, 0) : std::min(stop, n);
    } else {
      start = bound[0].value_or(n - 1);
      start = start < 0 ? std::max<std::int64_t>(n + start, -1) : std::min(start, n - 1);
      stop = bound[1].value_or(-1);
      stop = stop < -1 ? std::max<std::int64_t>(n + stop, -1) : std::min(stop, n - 1);
    }
    const std::int64_t dir = step > 0 ? 1 : -1;
    if (obj.is_list()) {
      Json out = Json::array();
      for (std::int64_t k = start; dir * k < dir * stop; k += step) out.push_back(obj.j()[static_cast<std::size_t>(k)]);
      return Value::of(std::move(out));
    }
    std::string out;
    for (std::int64_t k = start; dir * k < dir * stop; k += step) out += cps[static_cast<std::size_t>(k)];
    return Value::of(Json(out));
  }

  std::vector<Value> args_of(const Expr& e, std::size_t first) {
    std::vector<Value> out;
    for (std::size_t k = first; k < e.a.size(); ++k) out.push_back(eval(*e.a[k]));
    return out;
  }
  const Expr* kwarg(const Expr& e, const char* name) const {
    for (const auto& [k, v] : e.kwargs) {
      if (k == name) return v.get();
    }
    return nullptr;
  }

  // A macro call renders its body with the parameters bound (positional,
  // then by name, then defaults; undefined when none) in a scope of its own.
  Value call_macro(const Node& m, const Expr& e) {
    const std::vector<Value> args = args_of(e, 1);
    if (args.size() > m.params.size()) {
      type_fail(e, "macro '" + m.targets[0] + "' takes " + std::to_string(m.params.size()) + " arguments, got " +
                       std::to_string(args.size()));
    }
    Scope scope;
    for (std::size_t k = 0; k < m.params.size(); ++k) {
      const auto& [name, dflt] = m.params[k];
      if (k < args.size()) {
        scope[name] = args[k];
      } else if (const Expr* kw = kwarg(e, name.c_str())) {
        scope[name] = eval(*kw);
      } else if (dflt) {
        scope[name] = eval(*dflt);
      } else {
        scope[name] = Value{};
      }
    }
    for (const auto& [k, x] : e.kwargs) {
      bool known = false;
      for (const auto& p : m.params) known = known || p.first == k;
      if (!known) type_fail(e, "macro '" + m.targets[0] + "' has no parameter '" + k + "'");
    }
    if (++depth_ > 64) type_fail(e, "macro calls nest deeper than 64");
    scopes_.push_back(std::move(scope));
    std::string out;
    try {
      exec(m.body, out);
    } catch (...) {
      scopes_.pop_back();
      --depth_;
      throw;
    }
    scopes_.pop_back();
    --depth_;
    return Value::of(Json(out));
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.a[0];
    if (callee.k == Expr::K::Name) {
      if (const Value m = lookup(callee.s); m.kind == Value::Kind::Macro) return call_macro(*m.macro, e);
      if (callee.s == "raise_exception") {
        const std::vector<Value> args = args_of(e, 1);
        throw TemplateRaised(args.empty() ? std::string() : render_value(args[0]));
      }
      if (callee.s == "namespace") {
        auto ns = std::make_shared<Json>(Json::object());
        for (const auto& [k, x] : e.kwargs) {
          const Value v = eval(*x);
          (*ns)[k] = v.undefined() ? Json() : v.j();
        }
        Value v;
        v.kind = Value::Kind::Namespace;
        v.ns = std::move(ns);
        return v;
      }
      if (callee.s == "range") {
        const std::vector<Value> args = args_of(e, 1);
        if (args.empty() || args.size() > 3) type_fail(e, "range() takes 1 to 3 integers");
        std::int64_t start = 0, stop, step = 1;
        if (args.size() == 1) {
          stop = as_int(args[0], e, "range()'s argument");
        } else {
          start = as_int(args[0], e, "range()'s start");
          stop = as_int(args[1], e, "range()'s stop");
          if (args.size() == 3) step = as_int(args[2], e, "range()'s step");
        }
        if (step == 0) type_fail(e, "range() step must not be zero");
        Json out = Json::array();
        for (std::int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(k);
        return Value::of(std::move(out));
      }
      fail(callee.pos, "unknown function '" + callee.s + "' (supported: raise_exception, namespace, range)");
    }
    if (callee.k == Expr::K::Member) {
      const Value obj = eval(*callee.a[0]);
      const std::vector<Value> args = args_of(e, 1);
      return method(obj, callee.s, args, e);
    }
    fail(e.pos, "only functions and methods can be called");
  }

  static std::string string_arg(const std::vector<Value>& args, std::size_t k, const Expr& e, const std::string& what) {
    if (k >= args.size() || !args[k].is_string()) {
      type_fail(e, what + " needs a string argument" +
                       (k < args.size() ? std::string(", got a ") + type_name(args[k]) : std::string()));
    }
    return args[k].str();
  }

  static bool starts_or_ends(const std::string& s, const Value& pattern, bool start, const Expr& e) {
    const auto one = [&](const std::string& p) {
      if (p.size() > s.size()) return false;
      return start ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0;
    };
    if (pattern.is_string()) return one(pattern.str());
    if (pattern.is_list()) {
      for (const Json& p : pattern.j()) {
        if (!p.is_string()) type_fail(e, "startswith / endswith: every element must be a string");
        if (one(p.get<std::string>())) return true;
      }
      return false;
    }
    type_fail(e, std::string("startswith / endswith needs a string or a list of strings, got a ") + type_name(pattern));
  }

  static std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                                 std::int64_t count) {
    if (count == 0) return s;
    std::int64_t left = count < 0 ? INT64_MAX : count;
    std::string out;
    if (from.empty()) {  // between every code point, as Python and the reference
      const auto cps = code_points(s);
      for (const auto& c : cps) {
        if (left > 0) {
          out += to;
          --left;
        }
        out += c;
      }
      if (left > 0) out += to;
      return out;
    }
    std::size_t i = 0;
    while (left > 0) {
      const std::size_t f = s.find(from, i);
      if (f == std::string::npos) break;
      out.append(s, i, f - i);
      out += to;
      i = f + from.size();
      --left;
    }
    out.append(s, i, std::string::npos);
    return out;
  }

  static std::string title(const std::string& s) {
    // \b\w: an ASCII word character after a non-word one is upper-cased.
    std::string out = s;
    bool prev_word = false;
    for (char& c : out) {
      const bool word = std::isalnum(static_cast<unsigned char>(c)) || c == '_';
      if (word && !prev_word) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      prev_word = word;
    }
    return out;
  }

  static std::string capitalize(const std::string& s) {
    const auto cps = code_points(s);
    if (cps.empty()) return s;
    return change_case(cps[0], true) + s.substr(cps[0].size());
  }

  static Json split(const std::string& s, const Value* sep, std::int64_t maxsplit) {
    Json out = Json::array();
    if (!sep || sep->is_null() || sep->undefined()) {
      // Runs of white space (JavaScript's \S+ pieces).
      std::vector<std::pair<std::size_t, std::size_t>> words;
      std::size_t i = 0, begin = std::string::npos;
      while (i < s.size()) {
        std::size_t n;
        const bool space = js_space(decode_at(s, i, n));
        if (!space && begin == std::string::npos) begin = i;
        if (space && begin != std::string::npos) {
          words.emplace_back(begin, i);
          begin = std::string::npos;
        }
        i += n;
      }
      if (begin != std::string::npos) words.emplace_back(begin, s.size());
      for (std::size_t k = 0; k < words.size(); ++k) {
        if (maxsplit >= 0 && static_cast<std::int64_t>(k) >= maxsplit) {
          out.push_back(s.substr(words[k].first));
          break;
        }
        out.push_back(s.substr(words[k].first, words[k].second - words[k].first));
      }
      return out;
    }
    const std::string& d = sep->str();
    std::size_t i = 0;
    std::int64_t done = 0;
    while (true) {
      const std::size_t f = s.find(d, i);
      if (f == std::string::npos || (maxsplit >= 0 && done >= maxsplit)) {
        out.push_back(s.substr(i));
        break;
      }
      out.push_back(s.substr(i, f - i));
      i = f + d.size();
      ++done;
    }
    return out;
  }

  Value method(const Value& obj, const std::string& name, const std::vector<Value>& args, const Expr& e) {
    if (obj.is_string()) {
      const std::string& s = obj.str();
      if (name == "startswith" || name == "endswith") {
        if (args.empty()) type_fail(e, name + "() needs an argument");
        return Value::of(Json(starts_or_ends(s, args[0], name == "startswith", e)));
      }
      // The reference's strip / lstrip / rstrip ignore a characters argument
      // and strip white space.
      if (name == "strip") return Value::of(Json(trim(s)));
      if (name == "lstrip") return Value::of(Json(trim_start(s)));
      if (name == "rstrip") return Value::of(Json(trim_end(s)));
      if (name == "upper") return Value::of(Json(change_case(s, true)));
      if (name == "lower") return Value::of(Json(change_case(s, false)));
      if (name == "title") return Value::of(Json(title(s)));
      if (name == "capitalize") return Value::of(Json(capitalize(s)));
      if (name == "split") {
        const Value* sep = args.empty() ? nullptr : &args[0];
        if (sep && !sep->is_string() && !sep->is_null()) type_fail(e, "split()'s separator must be a string or none");
        if (sep && sep->is_string() && sep->str().empty()) type_fail(e, "split(): empty separator");
        std::int64_t maxsplit = -1;
        if (args.size() > 1) maxsplit = as_int(args[1], e, "split()'s maxsplit");
        if (const Expr* m = kwarg(e, "maxsplit")) maxsplit = as_int(eval(*m), e, "split()'s maxsplit");
        return Value::of(split(s, sep, maxsplit));
      }
      if (name == "replace") {
        const std::string from = string_arg(args, 0, e, "replace()");
        const std::string to = string_arg(args, 1, e, "replace()");
        std::int64_t count = -1;
        if (args.size() > 2 && !args[2].is_null()) count = as_int(args[2], e, "replace()'s count");
        if (const Expr* c = kwarg(e, "count")) count = as_int(eval(*c), e, "replace()'s count");
        return Value::of(Json(replace_all(s, from, to, count)));
      }
    } else if (obj.is_dict()) {
      const Json& j = obj.j();
      if (name == "items") {
        Json out = Json::array();
        for (const auto& [k, v] : j.items()) out.push_back(Json::array({k, v}));
        return Value::of(std::move(out));
      }
      if (name == "keys" || name == "values") {
        Json out = Json::array();
        for (const auto& [k, v] : j.items()) out.push_back(name == "keys" ? Json(k) : v);
        return Value::of(std::move(out));
      }
      if (name == "get") {
        const std::string key = string_arg(args, 0, e, "get()");
        const Value v = member(obj, key);
        if (!v.undefined()) return v;
        return args.size() > 1 ? args[1] : Value::of(Json());
      }
    }
    fail(e.pos, "unknown method '" + name + "' of a " + type_name(obj));
  }

  // The string filters (trim, upper, lower, capitalize, title, replace,
  // string, safe) of `v`; nullopt for another filter.
  std::optional<Value> text_filter(const Expr& e, const Value& v, const std::vector<Value>& args) {
    const std::string& f = e.s;
    const auto need = [&](bool ok, const char* what) {
      if (!ok) type_fail(e, "filter '" + f + "' needs " + what + ", got a " + type_name(v));
    };
    if (f == "trim") {
      need(v.is_string(), "a string");
      return Value::of(Json(trim(v.str())));
    }
    if (f == "upper" || f == "lower") {
      need(v.is_string(), "a string");
      return Value::of(Json(change_case(v.str(), f == "upper")));
    }
    if (f == "capitalize") {
      need(v.is_string(), "a string");
      return Value::of(Json(capitalize(v.str())));
    }
    if (f == "title") {
      need(v.is_string(), "a string");
      return Value::of(Json(title(v.str())));
    }
    if (f == "replace") {
      need(v.is_string(), "a string");
      std::int64_t count = -1;
      if (args.size() > 2) count = as_int(args[2], e, "replace's count");
      return Value::of(
          Json(replace_all(v.str(), string_arg(args, 0, e, "replace"), string_arg(args, 1, e, "replace"), count)));
    }
    if (f == "string") return Value::of(Json(render_value(v)));
    // Without autoescaping (transformers renders with none) "safe" changes
    // nothing; Qwen3-Coder's template writes `tojson | safe`.
    if (f == "safe") return v;
    return std::nullopt;
  }

  // The list filters (items, join, first, last, reverse, selectattr,
  // rejectattr, map, list) of `v`; nullopt for another filter.
  std::optional<Value> list_filter(const Expr& e, const Value& v, const std::vector<Value>& args) {
    const std::string& f = e.s;
    const auto need = [&](bool ok, const char* what) {
      if (!ok) type_fail(e, "filter '" + f + "' needs " + what + ", got a " + type_name(v));
    };
    if (f == "items") {
      if (v.undefined()) return Value::of(Json::array());
      need(v.is_dict(), "a dict");
      return method(v, "items", {}, e);
    }
    if (f == "join") {
      need(v.is_list(), "a list");
      const std::string sep = args.empty() ? std::string() : string_arg(args, 0, e, "join");
      std::string out;
      bool first = true;
      for (const Json& x : v.j()) {
        if (!first) out += sep;
        first = false;
        out += render_value(Value::of(x));
      }
      return Value::of(Json(out));
    }
    if (f == "first" || f == "last") {
      need(v.is_list(), "a list");
      if (v.j().empty()) return {};
      return Value::part(v, f == "first" ? v.j().front() : v.j().back());
    }
    if (f == "reverse") {
      if (v.is_string()) {
        auto cps = code_points(v.str());
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value::of(Json(out));
      }
      need(v.is_list(), "a list or a string");
      Json out = Json::array();
      for (auto it = v.j().rbegin(); it != v.j().rend(); ++it) out.push_back(*it);
      return Value::of(std::move(out));
    }
    if (f == "selectattr" || f == "rejectattr") {
      need(v.is_list(), "a list of dicts");
      if (args.empty() || !args[0].is_string()) type_fail(e, f + " needs an attribute name (a string)");
      if (args.size() > 1 && !args[1].is_string()) type_fail(e, f + "'s second argument must be a test name");
      const std::string& attr = args[0].str();
      Json out = Json::array();
      for (const Json& item : v.j()) {
        if (!item.is_object()) type_fail(e, f + " applies to a list of dicts, found a " + type_name(Value::of(item)));
        bool r = false;  // an item without the attribute is never selected
        const auto a = item.find(attr);
        if (a != item.end()) {
          const Value av = Value::of(*a);
          r = args.size() > 1 ? apply_test(args[1].str(), av, args.size() > 2 ? &args[2] : nullptr, e) : truthy(av);
        }
        if (r == (f == "selectattr")) out.push_back(item);
      }
      return Value::of(std::move(out));
    }
    if (f == "map") {
      need(v.is_list(), "a list of dicts");
      const Expr* attr_e = kwarg(e, "attribute");
      if (!attr_e) type_fail(e, "map needs attribute=NAME (map with a filter name is not supported)");
      const Value attr = eval(*attr_e);
      if (!attr.is_string()) type_fail(e, "map's attribute must be a string");
      const Expr* dflt_e = kwarg(e, "default");
      const Value dflt = dflt_e ? eval(*dflt_e) : Value{};
      Json out = Json::array();
      for (const Json& item : v.j()) {
        if (!item.is_object()) type_fail(e, "map applies to a list of dicts");
        const auto a = item.find(attr.str());
        if (a != item.end()) {
          out.push_back(*a);
        } else {
          out.push_back(dflt.undefined() ? Json() : dflt.j());
        }
      }
      return Value::of(std::move(out));
    }
    if (f == "list") {
      need(v.is_list(), "a list");
      return v;
    }
    return std::nullopt;
  }

  // The number filters (int, float, abs) of `v`; nullopt for another filter.
  std::optional<Value> number_filter(const Expr& e, const Value& v) {
    const std::string& f = e.s;
    const auto need = [&](bool ok, const char* what) {
      if (!ok) type_fail(e, "filter '" + f + "' needs " + what + ", got a " + type_name(v));
    };
    if (f == "int") {
      if (v.is_int()) return v;
      if (v.is_float()) return Value::of(Json(static_cast<std::int64_t>(std::trunc(v.num()))));
      if (v.is_bool()) return Value::of(Json(v.j().get<bool>() ? 1 : 0));
      if (v.is_string()) {
        try {
          return Value::of(Json(static_cast<std::int64_t>(std::stoll(v.str()))));
        } catch (const std::exception&) {
          return Value::of(Json(0));
        }
      }
      need(false, "a number, a boolean or a string");
    }
    if (f == "float") {
      if (v.is_number()) return Value::of(Json(v.num()));
      need(false, "a number");
    }
    if (f == "abs") {
      need(v.is_number(), "a number");
      if (v.is_int()) return Value::of(Json(std::llabs(v.j().get<std::int64_t>())));
      return Value::of(Json(std::fabs(v.num())));
    }
    return std::nullopt;
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.a[0]);
    const std::vector<Value> args = args_of(e, 1);
    const std::string& f = e.s;
    const auto need = [&](bool ok, const char* what) {
      if (!ok) type_fail(e, "filter '" + f + "' needs " + what + ", got a " + type_name(v));
    };
    if (f == "tojson") {
      int indent = 0;
      const Expr* ie = kwarg(e, "indent");
      if (ie || !args.empty()) {
        const Value iv = ie ? eval(*ie) : args[0];
        if (!iv.is_null()) indent = static_cast<int>(as_int(iv, e, "tojson's indent"));
      }
      return Value::of(Json(to_json(v, indent)));
    }
    if (f == "default" || f == "d") {
      const bool boolean = args.size() > 1 ? truthy(args[1]) : false;
      if (v.undefined() || (boolean && !truthy(v))) return args.empty() ? Value::of(Json("")) : args[0];
      return v;
    }
    if (f == "length" || f == "count") {
      if (v.is_string()) return Value::of(Json(utf16_length(v.str())));
      need(v.is_list() || v.is_dict(), "a string, a list or a dict");
      return Value::of(Json(static_cast<std::int64_t>(v.j().size())));
    }
    if (auto r = text_filter(e, v, args)) return *r;
    if (auto r = list_filter(e, v, args)) return *r;
    if (auto r = number_filter(e, v)) return *r;
    fail(e.pos, "unknown filter '" + f +
                    "' (supported: tojson, default, length, count, trim, upper, lower, capitalize, title, replace, "
                    "items, join, first, last, reverse, list, string, int, float, abs, selectattr, rejectattr, "
                    "map)");
  }

  bool test(const Expr& e) {
    const Value v = eval(*e.a[0]);
    const std::vector<Value> args = args_of(e, 1);
    return apply_test(e.s, v, args.empty() ? nullptr : &args[0], e);
  }

  // Test `t` on `v`; `arg` is equalto's operand (selectattr passes it).
  bool apply_test(const std::string& t, const Value& v, const Value* arg, const Expr& e) {
    if (t == "equalto" || t == "eq") {
      if (!arg) type_fail(e, "test '" + t + "' needs a value to compare with");
      return !v.is_list() && !v.is_dict() && equal(v, *arg);
    }
    if (t == "lower" || t == "upper") {
      return v.is_string() && change_case(v.str(), t == "upper") == v.str();
    }
    if (t == "defined") return !v.undefined();
    if (t == "undefined") return v.undefined();
    if (t == "none") return v.is_null();
    if (t == "string") return v.is_string();
    if (t == "number") return v.is_number();
    if (t == "integer") return v.is_int();
    if (t == "float") return v.is_float();
    if (t == "boolean") return v.is_bool();
    if (t == "true") return v.is_bool() && v.j().get<bool>();
    if (t == "false") return v.is_bool() && !v.j().get<bool>();
    if (t == "mapping") return v.is_dict();
    if (t == "iterable") return v.is_list() || v.is_string();
    if (t == "sequence") return v.is_list() || v.is_string() || v.is_dict();
    if (t == "odd" || t == "even") {
      const std::int64_t n = as_int(v, e, "the value tested odd / even");
      return (n % 2 != 0) == (t == "odd");
    }
    fail(e.pos, "unknown test '" + t +
                    "' (supported: defined, undefined, none, string, number, integer, float, boolean, true, false, "
                    "mapping, iterable, sequence, odd, even, lower, upper, equalto, eq)");
  }

  static bool contains(const Value& hay, const Value& needle, const Expr& e) {
    if (hay.is_string()) {
      if (!needle.is_string()) type_fail(e, std::string("'in <string>' needs a string, got a ") + type_name(needle));
      return hay.str().find(needle.str()) != std::string::npos;
    }
    if (hay.is_list()) {
      for (const Json& x : hay.j()) {
        if (equal(Value::of(x), needle)) return true;
      }
      return false;
    }
    if (hay.is_dict()) return needle.is_string() && hay.j().contains(needle.str());
    if (hay.undefined() || hay.is_null()) return false;
    type_fail(e, std::string("'in' needs a string, a list or a dict on its right, got a ") + type_name(hay));
  }

  Value binary(const Expr& e) {
    const Value l = eval(*e.a[0]);
    const Value r = eval(*e.a[1]);
    const std::string& op = e.s;
    if (op == "==") return Value::of(Json(equal(l, r)));
    if (op == "!=") return Value::of(Json(!equal(l, r)));
    if (op == "in") return Value::of(Json(contains(r, l, e)));
    if (op == "not in") return Value::of(Json(!contains(r, l, e)));
    if (op == "~") {
      if (l.is_null() || r.is_null()) type_fail(e, "'~' on a none value");
      return Value::of(Json(render_value(l) + render_value(r)));
    }
    if (l.is_null() || r.is_null()) type_fail(e, "'" + op + "' on a none value");
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      int c;
      if (l.is_number() && r.is_number()) {
        c = l.num() < r.num() ? -1 : l.num() > r.num() ? 1 : 0;
      } else if (l.is_string() && r.is_string()) {
        c = l.str().compare(r.str());
        c = c < 0 ? -1 : c > 0 ? 1 : 0;
      } else {
        type_fail(e, "'" + op + "' between a " + type_name(l) + " and a " + type_name(r));
      }
      const bool res = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
      return Value::of(Json(res));
    }
    if (op == "+") {
      if (l.is_string() || r.is_string()) {
        if (l.undefined() || r.undefined()) type_fail(e, "'+' with an undefined value");
        return Value::of(Json(render_value(l) + render_value(r)));
      }
      if (l.is_list() && r.is_list()) {
        Json out = l.j();
        for (const Json& x : r.j()) out.push_back(x);
        return Value::of(std::move(out));
      }
    }
    if (l.is_number() && r.is_number()) {
      const bool ints = l.is_int() && r.is_int();
      if (op == "+" || op == "-" || op == "*") {
        if (ints) {
          const std::int64_t a = l.j().get<std::int64_t>(), b = r.j().get<std::int64_t>();
          return Value::of(Json(op == "+" ? a + b : op == "-" ? a - b : a * b));
        }
        const double a = l.num(), b = r.num();
        return Value::of(Json(op == "+" ? a + b : op == "-" ? a - b : a * b));
      }
      if (op == "/") return Value::of(Json(l.num() / r.num()));
      if (op == "//") {
        const double q = std::floor(l.num() / r.num());
        if (ints) return Value::of(Json(static_cast<std::int64_t>(q)));
        return Value::of(Json(q));
      }
      if (op == "%") {
        if (ints && r.j().get<std::int64_t>() != 0) {
          return Value::of(Json(l.j().get<std::int64_t>() % r.j().get<std::int64_t>()));
        }
        return Value::of(Json(std::fmod(l.num(), r.num())));
      }
      if (op == "**") {
        const double p = std::pow(l.num(), r.num());
        if (ints && r.j().get<std::int64_t>() >= 0) return Value::of(Json(static_cast<std::int64_t>(p)));
        return Value::of(Json(p));
      }
    }
    type_fail(e, "'" + op + "' between a " + type_name(l) + " and a " + type_name(r));
  }

  const Json& defaults_;
  Value context_;
  std::vector<Scope> scopes_;
  int depth_ = 0;  // macro calls under way
};

Json parse_object(std::string_view text, const char* what) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::parse_error& e) {
    throw InvalidArgument(std::string("ChatTemplate: ") + what + " is not valid JSON: " + e.what());
  }
  if (!j.is_object()) {
    throw InvalidArgument(std::string("ChatTemplate: ") + what + " must be a JSON object, got " + j.type_name());
  }
  normalize(j);
  return j;
}

}  // namespace

struct ChatTemplate::Impl {
  std::string source;
  Body body;
  Json defaults;
};

ChatTemplate ChatTemplate::parse(std::string_view source, std::string_view defaults_json) {
  auto impl = std::make_shared<Impl>();
  impl->source = std::string(source);
  impl->defaults = parse_object(defaults_json, "the default variables");
  Lexer lexer(impl->source);
  Parser parser(lexer.run());
  impl->body = parser.parse_all();
  return ChatTemplate(std::move(impl));
}

namespace {

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::optional<ChatTemplate> ChatTemplate::from_model_dir(const std::string& dir) {
  const std::string path = dir + "/tokenizer_config.json";
  Json config = Json::object();
  if (const auto text = read_file(path)) {
    try {
      config = Json::parse(*text);
    } catch (const Json::parse_error& e) {
      throw FormatError(path + ": not valid JSON: " + e.what());
    }
    if (!config.is_object()) throw FormatError(path + ": must be a JSON object");
  }
  // transformers saves the template as chat_template.jinja beside the
  // config (and prefers that file when both exist).
  std::optional<std::string> source = read_file(dir + "/chat_template.jinja");
  const auto t = config.find("chat_template");
  if (!source && t != config.end() && !t->is_null()) {
    if (t->is_string()) {
      source = t->get<std::string>();
    } else if (t->is_array()) {
      for (const Json& entry : *t) {
        if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
            entry["template"].is_string()) {
          source = entry["template"].get<std::string>();
        }
      }
    } else {
      throw FormatError(path + ": chat_template must be a string or a list of {name, template}, got " +
                        std::string(t->type_name()));
    }
  }
  if (!source) return std::nullopt;
  Json defaults = Json::object();
  for (const char* key : {"bos_token", "eos_token", "pad_token", "unk_token"}) {
    const auto f = config.find(key);
    if (f == config.end()) continue;
    if (f->is_string()) defaults[key] = *f;
    if (f->is_object() && f->contains("content") && (*f)["content"].is_string()) defaults[key] = (*f)["content"];
  }
  return parse(*source, defaults.dump());
}

std::string ChatTemplate::render(std::string_view context_json) const {
  Value context = Value::of(parse_object(context_json, "the render context"));
  Renderer r(impl_->defaults, std::move(context));
  std::string out;
  try {
    r.run(impl_->body, out);
  } catch (const BreakSignal&) {
    throw TemplateError("chat template: {% break %} outside a for loop");
  } catch (const ContinueSignal&) {
    throw TemplateError("chat template: {% continue %} outside a for loop");
  }
  return out;
}

const std::string& ChatTemplate::source() const { return impl_->source; }

std::vector<std::int32_t> encode_rendered_chat(const Tokenizer& tokenizer, std::string_view rendered) {
  std::vector<std::int32_t> ids = tokenizer.encode(rendered, false);
  const std::vector<std::int32_t>& lead = tokenizer.prefix_ids();
  const bool led = ids.size() >= lead.size() && std::equal(lead.begin(), lead.end(), ids.begin());
  if (!led) ids.insert(ids.begin(), lead.begin(), lead.end());
  return ids;
}

}  // namespace rwd::runtime
