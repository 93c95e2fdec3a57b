#include "runtime/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "rewind/error.h"

namespace rwd::runtime {

namespace {

using json = nlohmann::json;

// ---- UTF-8 -------------------------------------------------------------------------

enum class Utf8Step { Complete, Incomplete, Invalid };

// Classifies the sequence that starts at s[0] (Unicode 15, table 3-7 of the
// standard's well-formed byte sequences). Complete: `len` bytes form a code
// point. Incomplete: the bytes so far are a valid start but the string ends.
// Invalid: the first `len` bytes are a maximal subpart that cannot start a
// valid sequence (one U+FFFD each).
Utf8Step utf8_step(std::string_view s, std::size_t* len, char32_t* cp = nullptr) {
  const auto b0 = static_cast<unsigned char>(s[0]);
  if (b0 < 0x80) {
    *len = 1;
    if (cp) *cp = b0;
    return Utf8Step::Complete;
  }
  std::size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  char32_t value = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    value = b0 & 0x1Fu;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    value = b0 & 0x0Fu;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    value = b0 & 0x07u;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *len = 1;
    return Utf8Step::Invalid;
  }
  for (std::size_t i = 1; i <= need; ++i) {
    if (i >= s.size()) {
      *len = i;
      return Utf8Step::Incomplete;
    }
    const auto b = static_cast<unsigned char>(s[i]);
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      *len = i;
      return Utf8Step::Invalid;
    }
    value = (value << 6) | (b & 0x3Fu);
  }
  *len = need + 1;
  if (cp) *cp = value;
  return Utf8Step::Complete;
}

// Whether `text` is valid UTF-8; if not, `bad_offset` gets the offset of
// the first byte outside a valid sequence.
bool valid_utf8(std::string_view text, std::size_t* bad_offset = nullptr) {
  for (std::size_t p = 0; p < text.size();) {
    std::size_t len = 1;
    if (utf8_step(text.substr(p), &len) != Utf8Step::Complete) {
      if (bad_offset) *bad_offset = p;
      return false;
    }
    p += len;
  }
  return true;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Unicode's White_Space property (PropList.txt), the definition of
// whitespace of Hugging Face's tokenizers (Rust's char::is_whitespace and
// the regex crate's \s).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
// The same set as PCRE2 class items. PCRE2's own \s (with UCP) differs: it
// also takes U+180E.
constexpr std::string_view kWhiteSpaceItems =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

// The code point that ends just before `end` (text is valid UTF-8).
char32_t code_point_before(std::string_view text, std::size_t end, std::size_t* start) {
  std::size_t s = end - 1;
  while (s > 0 && (static_cast<unsigned char>(text[s]) & 0xC0) == 0x80) --s;
  std::size_t len = 0;
  char32_t cp = 0;
  utf8_step(text.substr(s, end - s), &len, &cp);
  *start = s;
  return cp;
}

// ---- the byte-level alphabet ---------------------------------------------------------

// GPT-2's byte-to-character table: printable bytes (33-126, 161-172,
// 174-255) stand for themselves, the other 68 bytes take the code points
// 256, 257, ... in byte order, so that every byte is a visible character.
struct ByteAlphabet {
  std::array<char32_t, 256> to_char{};
  std::array<std::string, 256> to_utf8;
  std::unordered_map<char32_t, unsigned char> to_byte;
  ByteAlphabet() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      to_char[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
    }
    for (std::size_t b = 0; b < 256; ++b) {
      append_utf8(to_utf8[b], to_char[b]);
      to_byte[to_char[b]] = static_cast<unsigned char>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

// ---- regexes (PCRE2, UTF + UCP) ------------------------------------------------------

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
using Regex = std::shared_ptr<pcre2_code>;

// tokenizer.json's patterns are written for Rust's regex crate (Oniguruma
// in older files), whose \s is White_Space. PCRE2's \s is not quite that, so
// \s and \S become explicit classes. \S inside a class has no such
// rewriting and is refused.
std::string rewrite_white_space(const std::string& pattern, const std::string& where) {
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      ++i;
      if (e == 's') {
        out += in_class ? std::string(kWhiteSpaceItems) : "[" + std::string(kWhiteSpaceItems) + "]";
      } else if (e == 'S') {
        if (in_class)
          throw FormatError(where +
                            ": the pre-tokenizer regex uses \\S inside a character class, which "
                            "rewind does not support");
        out += "[^" + std::string(kWhiteSpaceItems) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const std::size_t close = pattern.find(":]", i + 2);
      if (close != std::string::npos) {
        out.append(pattern, i, close + 2 - i);
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex compile_regex(const std::string& pattern, const std::string& where) {
  const std::string rewritten = rewrite_white_space(pattern, where);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw FormatError(where + ": the pre-tokenizer regex " + json(pattern).dump() + " does not compile (PCRE2: " +
                      reinterpret_cast<const char*>(message) + " at offset " + std::to_string(offset) + ")");
  }
  // JIT when the library has it; matching falls back to the interpreter.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return Regex(code, CodeDeleter{});
}

// Isolated splitting: every match is a piece, and so is every stretch
// between matches. Empty matches split nothing.
void split_isolated(const pcre2_code* code, pcre2_match_data* md, std::string_view text,
                    std::vector<std::string_view>& out) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t start = 0, last = 0;
  while (start <= text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw Error(std::string("tokenizer: pre-tokenizer regex failed: ") + reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const std::size_t s = ov[0], e = ov[1];
    if (e == s) {
      if (s >= text.size()) break;
      std::size_t len = 1;
      utf8_step(text.substr(s), &len);
      start = s + len;
      continue;
    }
    if (s > last) out.push_back(text.substr(last, s - last));
    out.push_back(text.substr(s, e - s));
    last = e;
    start = e;
  }
  if (last < text.size()) out.push_back(text.substr(last));
}

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(const pcre2_code* code) : md(pcre2_match_data_create_from_pattern(code, nullptr)) {
    if (md == nullptr) throw std::bad_alloc();
  }
  ~MatchData() { pcre2_match_data_free(md); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
};

// GPT-2's pattern: ByteLevel's use_regex: true.
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// ---- NFC (ICU) -------------------------------------------------------------------------

std::string nfc(std::string_view text) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    return std::string(text);
  }
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status))
    throw Error(std::string("tokenizer: ICU's NFC normalizer is unavailable: ") + u_errorName(status));
  const icu::StringPiece piece(text.data(), static_cast<std::int32_t>(text.size()));
  if (normalizer->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) return std::string(text);
  status = U_ZERO_ERROR;
  std::string out;
  icu::StringByteSink<std::string> sink(&out, static_cast<std::int32_t>(text.size()));
  normalizer->normalizeUTF8(0, piece, sink, nullptr, status);
  if (U_FAILURE(status)) throw Error(std::string("tokenizer: NFC normalization failed: ") + u_errorName(status));
  return out;
}

std::string show_string(std::string_view s) {
  return json(std::string(s)).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
}

struct Merge {
  std::int32_t rank;
  std::int32_t merged;
};

}  // namespace

// ---- the tokenizer's data ------------------------------------------------------------------

struct Tokenizer::Impl {
  TokenizerKind kind = TokenizerKind::ByteLevel;
  std::string where;                                  // the file, for messages
  std::vector<std::string> tokens;                    // id -> token string ("" for a hole)
  std::vector<char> present;                          // id -> has a token
  std::vector<std::string> bytes;                     // id -> decoded bytes
  std::vector<char> special;                          // id -> special
  std::unordered_map<std::string, std::int32_t> ids;  // token string -> id
  std::unordered_map<std::uint64_t, Merge> merges;
  std::array<std::int32_t, 256> byte_id{};  // the token of each single byte
  bool ignore_merges = false;
  bool nfc = false;
  std::vector<Regex> splits;      // applied in order, each to the pieces of the previous
  std::vector<AddedToken> added;  // id order
  // Added tokens by first byte, longest first; raw (normalized: false) and
  // normalized ones apart.
  std::array<std::vector<std::size_t>, 256> raw_by_byte, norm_by_byte;
  bool any_raw = false, any_norm = false;
  Regex word_char;                           // [\p{L}\p{N}_] for single_word
  std::vector<std::int32_t> prefix, suffix;  // the post-processor's template
  std::optional<std::int32_t> bos, eos, pad;
  bool add_bos = false;
  // What encode(text, true) puts before the text: the template's prefix, or
  // BOS when tokenizer_config.json asks for it without a template.
  std::vector<std::int32_t> leading;

  void set_token(std::int32_t id, const std::string& token) {
    const auto i = static_cast<std::size_t>(id);
    if (i >= tokens.size()) {
      tokens.resize(i + 1);
      present.resize(i + 1, 0);
      special.resize(i + 1, 0);
    }
    tokens[i] = token;
    present[i] = 1;
  }

  // The pieces of `text` (already normalized) for BPE.
  void pre_tokenize(std::string_view text, std::vector<std::string_view>& pieces) const {
    pieces.assign(1, text);
    std::vector<std::string_view> next;
    for (const Regex& r : splits) {
      MatchData md(r.get());
      next.clear();
      for (std::string_view p : pieces) split_isolated(r.get(), md.md, p, next);
      pieces.swap(next);
    }
  }

  // BPE of one piece (raw bytes): its byte tokens merged lowest rank first,
  // leftmost first among equal ranks, through a heap of candidate pairs
  // over a linked list of symbols.
  void bpe(std::string_view piece, std::vector<std::int32_t>& out) const {
    if (piece.empty()) return;
    if (ignore_merges) {
      std::string mapped;
      for (char c : piece) mapped += alphabet().to_utf8[static_cast<unsigned char>(c)];
      const auto it = ids.find(mapped);
      if (it != ids.end()) {
        out.push_back(it->second);
        return;
      }
    }
    const std::size_t n = piece.size();
    std::vector<std::int32_t> sym(n);
    std::vector<std::int64_t> prev(n), next(n);
    for (std::size_t i = 0; i < n; ++i) {
      sym[i] = byte_id[static_cast<unsigned char>(piece[i])];
      prev[i] = static_cast<std::int64_t>(i) - 1;
      next[i] = i + 1 < n ? static_cast<std::int64_t>(i + 1) : -1;
    }
    struct Candidate {
      std::int32_t rank;
      std::int64_t left;
      std::int32_t left_id, right_id;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    auto consider = [&](std::int64_t l) {
      if (l < 0 || next[static_cast<std::size_t>(l)] < 0) return;
      const auto r = static_cast<std::size_t>(next[static_cast<std::size_t>(l)]);
      const auto it = merges.find(pair_key(sym[static_cast<std::size_t>(l)], sym[r]));
      if (it != merges.end()) heap.push({it->second.rank, l, sym[static_cast<std::size_t>(l)], sym[r]});
    };
    for (std::size_t i = 0; i + 1 < n; ++i) consider(static_cast<std::int64_t>(i));
    std::vector<char> alive(n, 1);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      const auto l = static_cast<std::size_t>(c.left);
      // A candidate is stale when either symbol changed since it was pushed.
      if (!alive[l] || sym[l] != c.left_id || next[l] < 0) continue;
      const auto r = static_cast<std::size_t>(next[l]);
      if (sym[r] != c.right_id) continue;
      sym[l] = merges.at(pair_key(c.left_id, c.right_id)).merged;
      alive[r] = 0;
      next[l] = next[r];
      if (next[r] >= 0) prev[static_cast<std::size_t>(next[r])] = c.left;
      consider(prev[l]);
      consider(c.left);
    }
    for (std::int64_t i = 0; i >= 0; i = next[static_cast<std::size_t>(i)])
      out.push_back(sym[static_cast<std::size_t>(i)]);
  }

  bool word_char_at(std::string_view text, std::size_t pos, MatchData& md) const {
    return pcre2_match(word_char.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                       PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, md.md, nullptr) >= 0;
  }

  // Splits `text` at the added tokens of one kind: calls `on_text` for each
  // stretch without one and `on_token` for each match, in order.
  template <class OnText, class OnToken>
  void split_added(std::string_view text, bool normalized_pass, OnText on_text, OnToken on_token) const {
    const auto& by_byte = normalized_pass ? norm_by_byte : raw_by_byte;
    std::optional<MatchData> md;
    std::size_t done = 0, pos = 0;
    while (pos < text.size()) {
      const AddedToken* hit = nullptr;
      for (std::size_t k : by_byte[static_cast<unsigned char>(text[pos])]) {
        const AddedToken& t = added[k];
        if (text.compare(pos, t.content.size(), t.content) != 0) continue;
        if (t.single_word) {
          if (!md) md.emplace(word_char.get());
          const std::size_t end = pos + t.content.size();
          std::size_t before = 0;
          if (pos > 0) {
            code_point_before(text, pos, &before);
            if (word_char_at(text, before, *md)) continue;
          }
          if (end < text.size() && word_char_at(text, end, *md)) continue;
        }
        hit = &t;
        break;
      }
      if (hit == nullptr) {
        std::size_t len = 1;
        utf8_step(text.substr(pos), &len);
        pos += len;
        continue;
      }
      std::size_t start = pos, end = pos + hit->content.size();
      if (hit->lstrip) {
        while (start > done) {
          std::size_t s = 0;
          if (!is_white_space(code_point_before(text, start, &s))) break;
          start = s;
        }
      }
      if (hit->rstrip) {
        while (end < text.size()) {
          std::size_t len = 1;
          char32_t cp = 0;
          utf8_step(text.substr(end), &len, &cp);
          if (!is_white_space(cp)) break;
          end += len;
        }
      }
      if (start > done) on_text(text.substr(done, start - done));
      on_token(hit->id);
      done = pos = end;
    }
    if (done < text.size()) on_text(text.substr(done));
  }

  void encode_text(std::string_view text, std::vector<std::int32_t>& out,
                   std::unordered_map<std::string_view, std::vector<std::int32_t>>& cache,
                   std::deque<std::string>& keep) const {
    std::vector<std::string_view> pieces;
    auto model = [&](std::string_view normalized) {
      pre_tokenize(normalized, pieces);
      for (std::string_view p : pieces) {
        auto it = cache.find(p);
        if (it == cache.end()) {
          std::vector<std::int32_t> ids_of_piece;
          bpe(p, ids_of_piece);
          it = cache.emplace(p, std::move(ids_of_piece)).first;
        }
        out.insert(out.end(), it->second.begin(), it->second.end());
      }
    };
    auto normalized_part = [&](std::string_view raw) {
      // The cache keys view the normalized strings, kept alive until encode ends.
      keep.push_back(this->nfc ? ::rwd::runtime::nfc(raw) : std::string(raw));
      const std::string_view norm = keep.back();
      if (any_norm) {
        split_added(norm, true, model, [&](std::int32_t id) { out.push_back(id); });
      } else {
        model(norm);
      }
    };
    if (any_raw) {
      split_added(text, false, normalized_part, [&](std::int32_t id) { out.push_back(id); });
    } else {
      normalized_part(text);
    }
  }
};

namespace {

// ---- tokenizer.json --------------------------------------------------------------

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FormatError(path.string() + ": cannot open it");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw FormatError(path.string() + ": read error");
  return buffer.str();
}

const json& member(const json& j, const char* key, const std::string& where, const std::string& path) {
  if (!j.is_object() || !j.contains(key)) throw FormatError(where + ": " + path + " has no \"" + key + "\"");
  return j.at(key);
}

bool flag(const json& j, const char* key, bool fallback, const std::string& where, const std::string& path) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  if (!j.at(key).is_boolean()) throw FormatError(where + ": " + path + "." + key + " must be true or false");
  return j.at(key).get<bool>();
}

[[noreturn]] void unsupported(const std::string& where, const std::string& path, const std::string& what) {
  throw FormatError(where + ": " + path + " is " + what +
                    ", which rewind's tokenizer does not support (docs/model-format.md, \"Tokenizer\", lists what it "
                    "reads)");
}

std::string type_of(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j.at("type").is_string()) return "(no type)";
  return j.at("type").get<std::string>();
}

// A pre-tokenizer: Split (Regex, Isolated, not inverted) or ByteLevel
// (add_prefix_space false; use_regex adds GPT-2's pattern).
void read_pre_tokenizer(const json& j, const std::string& where, const std::string& path, Tokenizer::Impl& t,
                        bool& byte_level_seen) {
  const std::string type = type_of(j);
  if (byte_level_seen) unsupported(where, path, "a pre-tokenizer after ByteLevel (" + type + ")");
  if (type == "Split") {
    const json& pattern = member(j, "pattern", where, path);
    if (!pattern.is_object() || !pattern.contains("Regex") || !pattern.at("Regex").is_string()) {
      unsupported(where, path + ".pattern", "not {\"Regex\": ...} (a String pattern)");
    }
    const std::string behavior = j.value("behavior", std::string());
    if (behavior != "Isolated") unsupported(where, path + ".behavior", show_string(behavior) + " (only \"Isolated\")");
    if (flag(j, "invert", false, where, path)) unsupported(where, path + ".invert", "true");
    t.splits.push_back(compile_regex(pattern.at("Regex").get<std::string>(), where + " " + path));
  } else if (type == "ByteLevel") {
    if (flag(j, "add_prefix_space", false, where, path)) unsupported(where, path + ".add_prefix_space", "true");
    if (flag(j, "use_regex", true, where, path)) t.splits.push_back(compile_regex(kGpt2Pattern, where + " " + path));
    byte_level_seen = true;
  } else {
    unsupported(where, path, "a pre-tokenizer of type " + show_string(type) + " (only Split and ByteLevel)");
  }
}

void read_post_processor(const json& j, const std::string& where, const std::string& path, Tokenizer::Impl& t) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "ByteLevel") return;  // offsets only: no tokens added
  if (type == "Sequence") {
    const json& list = member(j, "processors", where, path);
    if (!list.is_array()) throw FormatError(where + ": " + path + ".processors must be a list");
    for (std::size_t i = 0; i < list.size(); ++i) {
      read_post_processor(list[i], where, path + ".processors[" + std::to_string(i) + "]", t);
    }
    return;
  }
  if (type != "TemplateProcessing") {
    unsupported(where, path, "a post-processor of type " + show_string(type) + " (only ByteLevel, TemplateProcessing)");
  }
  if (!t.prefix.empty() || !t.suffix.empty()) unsupported(where, path, "a second TemplateProcessing");
  const json& single = member(j, "single", where, path);
  const json& specials = member(j, "special_tokens", where, path);
  if (!single.is_array()) throw FormatError(where + ": " + path + ".single must be a list");
  bool seen_a = false;
  for (std::size_t i = 0; i < single.size(); ++i) {
    const std::string at = path + ".single[" + std::to_string(i) + "]";
    const json& piece = single[i];
    if (piece.contains("Sequence")) {
      if (piece.at("Sequence").value("id", std::string()) != "A" || seen_a)
        unsupported(where, at, "not one sequence A");
      seen_a = true;
    } else if (piece.contains("SpecialToken")) {
      const std::string name = piece.at("SpecialToken").value("id", std::string());
      if (!specials.contains(name))
        throw FormatError(where + ": " + at + " names " + show_string(name) + ", which " + path +
                          ".special_tokens does not define");
      const json& ids = member(specials.at(name), "ids", where, path + ".special_tokens." + name);
      if (!ids.is_array()) throw FormatError(where + ": " + path + ".special_tokens." + name + ".ids must be a list");
      for (const json& id : ids) {
        if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
            id.get<std::int64_t>() >= static_cast<std::int64_t>(t.tokens.size()) || !t.present[id.get<std::size_t>()]) {
          throw FormatError(where + ": " + path + ".special_tokens." + name + " has id " + id.dump() +
                            ", which is not in the vocabulary");
        }
        (seen_a ? t.suffix : t.prefix).push_back(id.get<std::int32_t>());
      }
    } else {
      unsupported(where, at, "neither SpecialToken nor Sequence");
    }
  }
  if (!seen_a) unsupported(where, path + ".single", "a template without sequence A");
}

// bos_token / eos_token / pad_token of tokenizer_config.json: a string, an
// AddedToken object ({"content": ...}) or null.
std::optional<std::int32_t> config_token(const json& config, const char* key, const Tokenizer::Impl& t,
                                         const std::string& where) {
  if (!config.contains(key) || config.at(key).is_null()) return std::nullopt;
  const json& v = config.at(key);
  std::string name;
  if (v.is_string()) {
    name = v.get<std::string>();
  } else if (v.is_object() && v.contains("content") && v.at("content").is_string()) {
    name = v.at("content").get<std::string>();
  } else {
    throw FormatError(where + ": " + key + " must be a token string, {\"content\": ...} or null");
  }
  const auto it = t.ids.find(name);
  if (it == t.ids.end()) {
    throw FormatError(where + ": " + key + " is " + show_string(name) + ", which is not a token of tokenizer.json");
  }
  return it->second;
}

// model.merges: each pair's rank and the token it makes.
void read_merges(const json& model, const std::string& where, Tokenizer::Impl& t) {
  const json& merges = member(model, "merges", where, "model");
  if (!merges.is_array()) throw FormatError(where + ": model.merges must be a list");
  t.merges.reserve(merges.size());
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const json& m = merges[r];
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const std::size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        throw FormatError(where + ": model.merges[" + std::to_string(r) + "] is " + show_string(s) +
                          ", not two tokens separated by one space");
      }
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      throw FormatError(where + ": model.merges[" + std::to_string(r) + "] is " + m.dump() +
                        ", neither \"a b\" nor [\"a\", \"b\"]");
    }
    const auto ia = t.ids.find(a), ib = t.ids.find(b), im = t.ids.find(a + b);
    if (ia == t.ids.end() || ib == t.ids.end() || im == t.ids.end()) {
      const std::string& missing = ia == t.ids.end() ? a : ib == t.ids.end() ? b : a + b;
      throw FormatError(where + ": model.merges[" + std::to_string(r) + "] (" + show_string(a) + " " + show_string(b) +
                        ") needs the token " + show_string(missing) + ", which model.vocab lacks");
    }
    // A repeated pair keeps its first (lowest) rank.
    t.merges.emplace(pair_key(ia->second, ib->second), Merge{static_cast<std::int32_t>(r), im->second});
  }
}

// model: a byte-level BPE model's vocabulary (every byte's token
// included) and merge ranks.
void read_bpe_model(const json& model, const std::string& where, Tokenizer::Impl& t) {
  const std::string model_type = model.value("type", std::string("BPE"));
  if (model_type != "BPE") unsupported(where, "model", "of type " + show_string(model_type) + " (only BPE)");
  if (flag(model, "byte_fallback", false, where, "model")) unsupported(where, "model.byte_fallback", "true");
  if (model.contains("dropout") && !model.at("dropout").is_null()) unsupported(where, "model.dropout", "set");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model.at(key).is_null() && model.at(key) != "") {
      unsupported(where, std::string("model.") + key, show_string(model.at(key).dump()));
    }
  }
  t.ignore_merges = flag(model, "ignore_merges", false, where, "model");
  const json& vocab = member(model, "vocab", where, "model");
  if (!vocab.is_object()) throw FormatError(where + ": model.vocab must be an object of token: id");
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
        id.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max() - 1) {
      throw FormatError(where + ": model.vocab[" + show_string(token) + "] is " + id.dump() +
                        ", not an id in [0, 2^31 - 1)");
    }
    const auto i = id.get<std::int32_t>();
    if (static_cast<std::size_t>(i) < t.tokens.size() && t.present[static_cast<std::size_t>(i)]) {
      throw FormatError(where + ": model.vocab gives id " + std::to_string(i) + " to both " +
                        show_string(t.tokens[static_cast<std::size_t>(i)]) + " and " + show_string(token));
    }
    t.set_token(i, token);
    t.ids.emplace(token, i);
  }
  const ByteAlphabet& abc = alphabet();
  for (std::size_t b = 0; b < 256; ++b) {
    const auto it = t.ids.find(abc.to_utf8[b]);
    if (it == t.ids.end()) {
      throw FormatError(where + ": model.vocab has no token for byte " + std::to_string(b) + " (" +
                        show_string(abc.to_utf8[b]) + "); a byte-level BPE vocabulary has all 256");
    }
    t.byte_id[b] = it->second;
  }
  read_merges(model, where, t);
}

// added_tokens: ids, contents and matching flags, and the tables that find
// them in text (longest first).
void read_added_tokens(const json& root, const std::string& where, Tokenizer::Impl& t) {
  if (root.contains("added_tokens") && !root.at("added_tokens").is_null()) {
    const json& list = root.at("added_tokens");
    if (!list.is_array()) throw FormatError(where + ": added_tokens must be a list");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string path = "added_tokens[" + std::to_string(i) + "]";
      const json& a = list[i];
      const json& id = member(a, "id", where, path);
      const json& content = member(a, "content", where, path);
      if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
          id.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max() - 1 || !content.is_string() ||
          content.get<std::string>().empty()) {
        throw FormatError(where + ": " + path + " needs an id in [0, 2^31 - 1) and a non-empty content");
      }
      AddedToken token;
      token.id = id.get<std::int32_t>();
      token.content = content.get<std::string>();
      if (!valid_utf8(token.content)) throw FormatError(where + ": " + path + ".content is not valid UTF-8");
      token.special = flag(a, "special", false, where, path);
      token.lstrip = flag(a, "lstrip", false, where, path);
      token.rstrip = flag(a, "rstrip", false, where, path);
      token.single_word = flag(a, "single_word", false, where, path);
      token.normalized = flag(a, "normalized", !token.special, where, path);
      const auto u = static_cast<std::size_t>(token.id);
      if (u < t.tokens.size() && t.present[u] && t.tokens[u] != token.content) {
        throw FormatError(where + ": " + path + " gives id " + std::to_string(token.id) + " to " +
                          show_string(token.content) + ", but model.vocab gives it to " + show_string(t.tokens[u]));
      }
      const auto existing = t.ids.find(token.content);
      if (existing != t.ids.end() && existing->second != token.id) {
        throw FormatError(where + ": " + path + " " + show_string(token.content) + " has id " +
                          std::to_string(token.id) + " but model.vocab has it as " + std::to_string(existing->second));
      }
      t.set_token(token.id, token.content);
      t.ids[token.content] = token.id;
      t.added.push_back(std::move(token));
    }
  }
  std::sort(t.added.begin(), t.added.end(), [](const AddedToken& x, const AddedToken& y) { return x.id < y.id; });
  for (std::size_t k = 0; k < t.added.size(); ++k) {
    const AddedToken& a = t.added[k];
    t.special[static_cast<std::size_t>(a.id)] = a.special ? 1 : 0;
    auto& by_byte = a.normalized ? t.norm_by_byte : t.raw_by_byte;
    by_byte[static_cast<unsigned char>(a.content[0])].push_back(k);
    (a.normalized ? t.any_norm : t.any_raw) = true;
  }
  for (auto* table : {&t.raw_by_byte, &t.norm_by_byte}) {
    for (auto& list : *table) {
      std::stable_sort(list.begin(), list.end(), [&](std::size_t x, std::size_t y) {
        return t.added[x].content.size() > t.added[y].content.size();
      });
    }
  }
  t.word_char = compile_regex("[\\p{L}\\p{N}_]", where + " (single_word)");
}

// normalizer, pre_tokenizer, decoder and post_processor.
void read_pipeline(const json& root, const std::string& where, Tokenizer::Impl& t) {
  // Normalizer: none or NFC.
  if (root.contains("normalizer") && !root.at("normalizer").is_null()) {
    const std::string type = type_of(root.at("normalizer"));
    if (type != "NFC") unsupported(where, "normalizer", "of type " + show_string(type) + " (only NFC or null)");
    t.nfc = true;
  }
  // Pre-tokenizer: ByteLevel, or a Sequence of Splits ending with ByteLevel.
  const json& pre = member(root, "pre_tokenizer", where, "the file");
  bool byte_level_seen = false;
  if (type_of(pre) == "Sequence") {
    const json& list = member(pre, "pretokenizers", where, "pre_tokenizer");
    if (!list.is_array()) throw FormatError(where + ": pre_tokenizer.pretokenizers must be a list");
    for (std::size_t i = 0; i < list.size(); ++i) {
      read_pre_tokenizer(list[i], where, "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]", t, byte_level_seen);
    }
  } else if (!pre.is_null()) {
    read_pre_tokenizer(pre, where, "pre_tokenizer", t, byte_level_seen);
  }
  if (!byte_level_seen) unsupported(where, "pre_tokenizer", "without a ByteLevel step (not byte-level BPE)");
  // Decoder: ByteLevel.
  const json& decoder = member(root, "decoder", where, "the file");
  if (type_of(decoder) != "ByteLevel") {
    unsupported(where, "decoder", "of type " + show_string(type_of(decoder)) + " (only ByteLevel)");
  }
  if (root.contains("post_processor")) read_post_processor(root.at("post_processor"), where, "post_processor", t);
}

// Each token's bytes: a vocabulary token through the byte-level table
// (a character outside it stands for its own UTF-8, as in Hugging Face's
// ByteLevel decoder), an added token as its content.
void compute_token_bytes(const std::string& where, Tokenizer::Impl& t) {
  const ByteAlphabet& abc = alphabet();
  t.bytes.assign(t.tokens.size(), std::string());
  for (std::size_t i = 0; i < t.tokens.size(); ++i) {
    if (!t.present[i]) continue;
    const std::string& s = t.tokens[i];
    std::string& out = t.bytes[i];
    for (std::size_t p = 0; p < s.size();) {
      std::size_t len = 1;
      char32_t cp = 0;
      if (utf8_step(std::string_view(s).substr(p), &len, &cp) != Utf8Step::Complete) {
        throw FormatError(where + ": token " + std::to_string(i) + " is not valid UTF-8");
      }
      const auto it = abc.to_byte.find(cp);
      if (it != abc.to_byte.end())
        out.push_back(static_cast<char>(it->second));
      else
        out.append(s, p, len);
      p += len;
    }
  }
  for (const AddedToken& a : t.added) t.bytes[static_cast<std::size_t>(a.id)] = a.content;
}

void read_tokenizer_json(const json& root, const std::string& where, Tokenizer::Impl& t) {
  if (!root.is_object()) throw FormatError(where + ": not a JSON object");
  t.kind = TokenizerKind::Bpe;
  t.where = where;
  read_bpe_model(member(root, "model", where, "the file"), where, t);
  read_added_tokens(root, where, t);
  read_pipeline(root, where, t);
  compute_token_bytes(where, t);
}

}  // namespace

// ---- Tokenizer -----------------------------------------------------------------------

Tokenizer Tokenizer::from_json(const std::string& tokenizer_json, const std::string& tokenizer_config_json,
                               const std::string& where) {
  auto t = std::make_shared<Impl>();
  json root;
  try {
    root = json::parse(tokenizer_json);
  } catch (const json::exception& e) {
    throw FormatError(where + ": not valid JSON (" + e.what() + ")");
  }
  try {
    read_tokenizer_json(root, where, *t);
  } catch (const json::exception& e) {
    throw FormatError(where + ": " + e.what());
  }
  if (!tokenizer_config_json.empty()) {
    const std::string cwhere = where + " (tokenizer_config.json)";
    json config;
    try {
      config = json::parse(tokenizer_config_json);
    } catch (const json::exception& e) {
      throw FormatError(cwhere + ": not valid JSON (" + e.what() + ")");
    }
    if (!config.is_object()) throw FormatError(cwhere + ": not a JSON object");
    t->bos = config_token(config, "bos_token", *t, cwhere);
    t->eos = config_token(config, "eos_token", *t, cwhere);
    t->pad = config_token(config, "pad_token", *t, cwhere);
    t->add_bos = flag(config, "add_bos_token", false, cwhere, "the file");
    if (t->add_bos && !t->bos) throw FormatError(cwhere + ": add_bos_token is true but bos_token names no token");
  }
  t->leading = t->prefix;
  if (t->leading.empty() && t->add_bos && t->bos) t->leading.push_back(*t->bos);
  return Tokenizer(std::move(t));
}

Tokenizer Tokenizer::load(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path json_path = fs::path(dir) / "tokenizer.json";
  std::error_code ec;
  if (!fs::is_regular_file(json_path, ec)) {
    throw InvalidArgument(dir + " has no tokenizer.json (a byte-level model directory needs none)");
  }
  const fs::path config_path = fs::path(dir) / "tokenizer_config.json";
  const std::string config = fs::is_regular_file(config_path, ec) ? read_text_file(config_path) : std::string();
  return from_json(read_text_file(json_path), config, json_path.string());
}

Tokenizer Tokenizer::byte_level(std::int64_t vocab_size, std::int32_t bos, std::int32_t eos) {
  if (vocab_size < 1 || vocab_size > std::numeric_limits<std::int32_t>::max()) {
    throw InvalidArgument("byte-level tokenizer: vocab_size " + std::to_string(vocab_size) +
                          " must be in [1, 2^31 - 1]");
  }
  for (const auto& [name, id] : {std::pair{"BOS", bos}, std::pair{"EOS", eos}}) {
    if (id < -1 || id >= vocab_size) {
      throw InvalidArgument(std::string("byte-level tokenizer: ") + name + " " + std::to_string(id) +
                            " must be in [0, " + std::to_string(vocab_size) + "), or -1 for none");
    }
  }
  auto t = std::make_shared<Impl>();
  t->kind = TokenizerKind::ByteLevel;
  t->where = "byte-level";
  // The bytes are tokens 0..255 whatever vocab_size says, as today's
  // encode_prompt made them (a model smaller than 256 refuses them itself).
  const auto n = std::max<std::size_t>(static_cast<std::size_t>(vocab_size), 256);
  t->tokens.resize(n);
  t->present.assign(n, 1);
  t->special.assign(n, 0);
  t->bytes.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto id = static_cast<std::int32_t>(i);
    if (i < 256) {
      t->tokens[i] = alphabet().to_utf8[i];
      t->bytes[i] = std::string(1, static_cast<char>(i));
    } else {
      t->tokens[i] = id == bos ? "<|bos|>" : id == eos ? "<|eos|>" : "<|special_" + std::to_string(i) + "|>";
      t->special[i] = 1;
    }
    t->ids.emplace(t->tokens[i], id);
  }
  if (bos >= 0) t->bos = bos;
  if (eos >= 0) t->eos = eos;
  t->add_bos = bos >= 0;
  if (bos >= 0) t->prefix = {bos};
  t->leading = t->prefix;
  return Tokenizer(std::move(t));
}

Tokenizer Tokenizer::for_model_dir(const std::string& dir, std::int64_t vocab_size, std::int32_t bos,
                                   std::int32_t eos) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(std::filesystem::path(dir) / "tokenizer.json", ec)) return load(dir);
  return byte_level(vocab_size, bos, eos);
}

TokenizerKind Tokenizer::kind() const { return impl_->kind; }

std::string Tokenizer::kind_name() const {
  return impl_->kind == TokenizerKind::ByteLevel ? "byte-level" : "BPE (tokenizer.json)";
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_special) const {
  const Impl& t = *impl_;
  std::vector<std::int32_t> out;
  if (add_special) out = t.leading;
  if (t.kind == TokenizerKind::ByteLevel) {
    out.reserve(out.size() + text.size());
    for (unsigned char c : text) out.push_back(c);
    return out;
  }
  std::size_t bad = 0;
  if (!valid_utf8(text, &bad)) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned>(static_cast<unsigned char>(text[bad])));
    throw InvalidArgument("text is not valid UTF-8 at byte " + std::to_string(bad) + " (" + hex + "); " + t.where +
                          " encodes UTF-8 text");
  }
  std::unordered_map<std::string_view, std::vector<std::int32_t>> cache;
  std::deque<std::string> keep;  // the normalized parts, which `cache` keys view: a deque never moves them
  t.encode_text(text, out, cache, keep);
  if (add_special) out.insert(out.end(), t.suffix.begin(), t.suffix.end());
  return out;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special) const {
  const Impl& t = *impl_;
  std::string out;
  for (std::int32_t id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= t.bytes.size()) continue;
    const auto i = static_cast<std::size_t>(id);
    if (!t.present[i] || (skip_special && t.special[i])) continue;
    out += t.bytes[i];
  }
  return out;
}

std::int64_t Tokenizer::vocab_size() const { return static_cast<std::int64_t>(impl_->tokens.size()); }

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->ids.find(std::string(token));
  if (it == impl_->ids.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->tokens.size() || !impl_->present[static_cast<std::size_t>(id)]) {
    return std::nullopt;
  }
  return impl_->tokens[static_cast<std::size_t>(id)];
}

bool Tokenizer::is_special(std::int32_t id) const {
  return id >= 0 && static_cast<std::size_t>(id) < impl_->special.size() &&
         impl_->special[static_cast<std::size_t>(id)];
}

std::optional<std::int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<std::int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<std::int32_t> Tokenizer::pad_id() const { return impl_->pad; }
bool Tokenizer::add_bos_token() const { return impl_->add_bos; }
const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
const std::vector<std::int32_t>& Tokenizer::prefix_ids() const { return impl_->leading; }
const std::vector<std::int32_t>& Tokenizer::suffix_ids() const { return impl_->suffix; }

bool Tokenizer::compatible_with(const Tokenizer& other, std::string* why) const {
  const Impl& a = *impl_;
  const Impl& b = *other.impl_;
  auto fail = [&](const std::string& message) {
    if (why) *why = message;
    return false;
  };
  if (a.kind != b.kind) return fail("one tokenizer is " + kind_name() + ", the other " + other.kind_name());
  if (a.tokens.size() != b.tokens.size()) {
    return fail("vocabulary sizes differ: " + std::to_string(a.tokens.size()) + " here, " +
                std::to_string(b.tokens.size()) + " there");
  }
  auto show_id = [](const std::optional<std::int32_t>& id) { return id ? std::to_string(*id) : std::string("none"); };
  if (a.bos != b.bos) return fail("BOS differs: " + show_id(a.bos) + " here, " + show_id(b.bos) + " there");
  if (a.eos != b.eos) return fail("EOS differs: " + show_id(a.eos) + " here, " + show_id(b.eos) + " there");
  for (std::size_t i = 0; i < a.tokens.size(); ++i) {
    if (a.present[i] != b.present[i] || a.tokens[i] != b.tokens[i]) {
      auto show = [](const Impl& t, std::size_t k) {
        return t.present[k] ? show_string(t.tokens[k]) : std::string("absent");
      };
      return fail("token " + std::to_string(i) + " is " + show(a, i) + " here and " + show(b, i) + " there");
    }
    if (a.special[i] != b.special[i]) {
      return fail("token " + std::to_string(i) + " (" + show_string(a.tokens[i]) + ") is special in only one of them");
    }
  }
  return true;
}

std::string Tokenizer::describe() const {
  const Impl& t = *impl_;
  auto show = [&](const char* name, const std::optional<std::int32_t>& id) {
    if (!id) return std::string(name) + " none";
    return std::string(name) + " " + std::to_string(*id) + " " + show_string(t.tokens[static_cast<std::size_t>(*id)]);
  };
  std::size_t specials = 0;
  for (char s : t.special) specials += s ? 1 : 0;
  std::string line = kind_name() + ", vocab " + std::to_string(t.tokens.size()) + ", " + show("BOS", t.bos) + ", " +
                     show("EOS", t.eos) + ", " + show("PAD", t.pad) + ", " + std::to_string(specials) +
                     " special tokens";
  if (t.kind == TokenizerKind::Bpe) {
    line += ", " + std::to_string(t.merges.size()) + " merges, " + std::to_string(t.added.size()) +
            " added tokens, normalizer " + (t.nfc ? "NFC" : "none") + ", " + std::to_string(t.splits.size()) +
            " pre-tokenizer regex(es)";
    std::string added;
    for (std::int32_t id : t.prefix)
      added += (added.empty() ? "" : " ") + show_string(t.tokens[static_cast<std::size_t>(id)]);
    for (std::int32_t id : t.suffix)
      added += (added.empty() ? "" : " ") + show_string(t.tokens[static_cast<std::size_t>(id)]);
    if (!added.empty())
      line += ", template adds " + added;
    else if (t.add_bos && t.bos)
      line += ", BOS added (add_bos_token)";
    else
      line += ", no BOS added";
  }
  return line;
}

// ---- StreamDecoder -------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(&tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::push(std::int32_t id) {
  const Tokenizer::Impl& t = *tokenizer_->impl_;
  if (id < 0 || static_cast<std::size_t>(id) >= t.bytes.size()) return {};
  const auto i = static_cast<std::size_t>(id);
  if (!t.present[i] || (skip_special_ && t.special[i])) return {};
  if (t.kind == TokenizerKind::ByteLevel) return t.bytes[i];
  pending_ += t.bytes[i];
  std::string out;
  std::size_t p = 0;
  while (p < pending_.size()) {
    std::size_t len = 1;
    const Utf8Step step = utf8_step(std::string_view(pending_).substr(p), &len);
    if (step == Utf8Step::Incomplete) break;
    if (step == Utf8Step::Complete)
      out.append(pending_, p, len);
    else
      out += kReplacement;
    p += len;
  }
  pending_.erase(0, p);
  return out;
}

std::string StreamDecoder::finish() {
  if (pending_.empty()) return {};
  pending_.clear();
  return std::string(kReplacement);
}

Tokenizer tokenizer_for_model(const std::string& dir, const ModelConfig& c) {
  const std::int64_t bos = c.add_bos ? c.bos_token_id : -1;
  const std::int64_t eos = c.eos_token_ids.empty() ? -1 : c.eos_token_ids.front();
  Tokenizer t = Tokenizer::for_model_dir(dir, c.vocab_size, static_cast<std::int32_t>(bos),
                                         static_cast<std::int32_t>(eos));
  if (t.kind() == TokenizerKind::Bpe && t.vocab_size() > c.vocab_size) {
    throw InvalidArgument(dir + "/tokenizer.json has " + std::to_string(t.vocab_size()) +
                          " tokens, more than the model's vocab_size " + std::to_string(c.vocab_size) +
                          " (config.json): its ids would fall outside the embedding table");
  }
  return t;
}

}  // namespace rwd::runtime
