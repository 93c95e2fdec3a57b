// Chat templates: the Jinja subset that models' tokenizer_config.json
// `chat_template`s use, rendered as @huggingface/jinja (transformers.js'
// renderer) renders them, with transformers' settings (trim_blocks and
// lstrip_blocks on, one trailing newline of the template dropped).
//
// Supported: `{{ }}`, `{% if / elif / else / endif %}`, `{% for x in xs %}`
// (tuple targets, `{% else %}`, `loop.index0 / index / first / last / length
// / revindex / revindex0 / previtem / nextitem`, `break`, `continue`),
// `{% set %}` (names, tuples, `ns.attr` on a namespace(), block set),
// `{% macro name(a, b=default) %}` and its calls, `{# #}`, whitespace control with `-`, literals (strings, integers,
// floats, true / false / none, lists, dicts), member / index access, slices, arithmetic, `~`, comparisons, `and / or /
// not / in / not in`, conditional expressions, tests (`is [not] defined / undefined / none / string / number / integer
// / float / boolean / true / false / mapping / iterable / sequence / odd / even / lower / upper`, `equalto` in
// selectattr), filters (`tojson`, `trim`, `length`, `count`, `upper`, `lower`, `default`, `items`, `join`, `first`,
// `last`, `reverse`, `list`, `string`, `int`, `float`, `abs`, `capitalize`, `title`, `replace`, `selectattr`,
// `rejectattr`, `map(attribute=)`), string methods (`startswith`, `endswith`, `split`, `strip`, `lstrip`, `rstrip`,
// `replace`, `upper`, `lower`, `title`, `capitalize`), dict methods
// (`items`, `keys`, `values`, `get`) and the globals `raise_exception`,
// `namespace` and `range`. Anything else (`{% raw %}`, `{% include %}`,
// `{% call %}`, unknown filters) is refused with a TemplateError naming the line and column.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rewind/error.h"
#include "runtime/tokenizer.h"

namespace rwd::runtime {

// A template that does not parse, or an expression that cannot be evaluated
// (an unknown filter, an operation on values of the wrong type). The message
// names the line and column (1-based) in the template source.
class TemplateError : public FormatError {
 public:
  using FormatError::FormatError;
};

// The template called raise_exception(message): it refused its input. what()
// is "chat template: " + the message; message() is the template's own text.
class TemplateRaised : public TemplateError {
 public:
  explicit TemplateRaised(std::string message)
      : TemplateError("chat template: " + message), message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

class ChatTemplate {
 public:
  // Parses `source` once. `defaults_json` is a JSON object of variables
  // every render sees unless its context overrides them (bos_token, ...).
  // Throws TemplateError (line, column) for syntax outside the subset and
  // InvalidArgument when `defaults_json` is not a JSON object.
  static ChatTemplate parse(std::string_view source, std::string_view defaults_json = "{}");

  // The chat template of a model directory: its chat_template.jinja file
  // when present, else tokenizer_config.json's `chat_template` (a string,
  // or the entry named "default" of a list of {name, template}), with the
  // config's bos_token / eos_token / pad_token / unk_token as default
  // variables. std::nullopt when neither names a template. Throws
  // FormatError naming the file when the JSON is malformed, TemplateError
  // when the template does not parse.
  static std::optional<ChatTemplate> from_model_dir(const std::string& dir);

  // Renders with `context_json`, a JSON object of variables (messages,
  // tools, add_generation_prompt, ...); its keys override the defaults.
  // Throws InvalidArgument when it is not a JSON object, TemplateRaised when
  // the template calls raise_exception, TemplateError when evaluation fails.
  // Const and thread safe: one parsed template serves concurrent renders.
  std::string render(std::string_view context_json) const;

  // The template's source, as given.
  const std::string& source() const;

  struct Impl;

 private:
  explicit ChatTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// The prompt ids of `rendered`, a chat template's output: the special
// tokens it writes as text become their ids (tokenizer.encode(rendered,
// false)), and tokenizer.prefix_ids() go first unless the ids already start
// with them (a template that writes BOS gets it once, a byte-level model
// gets its BOS as encode(text, true) gives it). Throws what encode throws.
std::vector<std::int32_t> encode_rendered_chat(const Tokenizer& tokenizer, std::string_view rendered);

}  // namespace rwd::runtime
