// The rewind CLI end to end, as a new user meets it: every subcommand's
// output, exit status (0 ok, 1 divergence, 2 bad input) and messages, long
// prompts from files, --stats, seeds, threads, refused flags and values,
// --help, and init-random's protection of existing models. Hostile model
// files are in cli_hostile_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "runtime/model.h"
#include "runtime/weights_io.h"
#include "test_configs.h"

#ifdef REWIND_CLI_PATH
namespace rwd::runtime {
namespace {

using namespace cli_test;
using testing_configs::hybrid;
using testing_configs::kEveryKind;

class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (scratch_dir() / "models").string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write_random_model(hybrid(kEveryKind), dir_ + "/target", 5, DType::BF16);
    write_random_model(hybrid({"conv", "sliding_attention"}, 16, 4), dir_ + "/draft", 6, DType::F16);
    ModelConfig other = hybrid({"full_attention"}, 16);
    other.vocab_size = 300;
    write_random_model(other, dir_ + "/other_vocab", 7, DType::F32);
    // Linear in the prompt length (no full attention): for very long prompts.
    write_random_model(hybrid({"conv", "sliding_attention", "linear_attention"}, 16, 8), dir_ + "/linear", 8,
                       DType::F32);
  }
  static void TearDownTestSuite() { fs::remove_all(scratch_dir()); }

  static std::string model(const std::string& name) { return " --model " + quote(dir_ + "/" + name); }

  // The JSON object --stats prints on the last line of stdout.
  static nlohmann::json stats_of(const CliResult& r) {
    const std::size_t end = r.out.size() - 1;  // the final newline
    const std::size_t start = r.out.rfind('\n', end - 1) + 1;
    return nlohmann::json::parse(r.out.substr(start, end - start));
  }
  // The generated text: stdout before the newline that precedes the JSON line.
  static std::string text_of(const CliResult& r) {
    const std::size_t json_start = r.out.rfind('\n', r.out.size() - 2) + 1;
    return r.out.substr(0, json_start - 1);
  }

  static std::string dir_;
};
std::string Cli::dir_;

// ---- subcommands working ----------------------------------------------------------

TEST_F(Cli, VerifyReportsIdenticalForDraftModelAndLookup) {
  for (const std::string& source : {"--draft " + quote(dir_ + "/draft"), std::string("--lookup 3")}) {
    const CliResult r = run_cli("verify" + model("target") + " " + source +
                                " --prompt 'in the beginning in the' --max-new-tokens 40");
    EXPECT_EQ(r.status, 0) << r.all();
    EXPECT_NE(r.out.find("IDENTICAL"), std::string::npos) << r.all();
  }
}

// The IDENTICAL line ends with the acceptance at each draft position (K
// figures in [0, 1]); what comes before is unchanged, and "acceptance "
// appears once (scripts/demo.sh takes the overall rate from the last one).
TEST_F(Cli, VerifyEndsWithAcceptanceByPosition) {
  auto figures_after = [](const std::string& out, const std::string& marker) {
    std::vector<double> v;
    const std::size_t at = out.find(marker);
    if (at == std::string::npos) return v;
    std::istringstream rest(out.substr(at + marker.size(), out.find('\n', at) - at - marker.size()));
    for (double x; rest >> x;) v.push_back(x);
    return v;
  };
  const std::string marker = "; accepted by position";
  const CliResult r = run_cli("verify" + model("target") + " --draft " + quote(dir_ + "/draft") +
                              " --num-draft 3 --prompt 'in the beginning' --max-new-tokens 30");
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("new tokens; greedy "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" rollbacks; accepted by position "), std::string::npos) << r.out;
  const std::size_t first = r.out.find("acceptance ");
  ASSERT_NE(first, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("acceptance ", first + 1), std::string::npos) << r.out;
  const std::vector<double> single = figures_after(r.out, marker);
  ASSERT_EQ(single.size(), 3u) << r.out;
  for (double x : single) {
    EXPECT_GE(x, 0.0) << r.out;
    EXPECT_LE(x, 1.0) << r.out;
  }
  // The target drafting for itself: every position accepted.
  const CliResult self = run_cli("verify" + model("target") + " --draft " + quote(dir_ + "/target") +
                                 " --num-draft 2 --prompt 'in the beginning' --max-new-tokens 30");
  ASSERT_EQ(self.status, 0) << self.all();
  EXPECT_EQ(figures_after(self.out, marker), (std::vector<double>{1.0, 1.0})) << self.out;
  // Batched: the counts of every sequence together.
  const fs::path file = scratch_dir() / "by_position_prompts.txt";
  write_file(file, "in the beginning\nand God said\n");
  const CliResult batch = run_cli("verify" + model("target") + " --draft " + quote(dir_ + "/draft") +
                                  " --num-draft 4 --prompts " + quote(file.string()) + " --max-new-tokens 20");
  ASSERT_EQ(batch.status, 0) << batch.all();
  EXPECT_EQ(figures_after(batch.out, marker).size(), 4u) << batch.out;
}

TEST_F(Cli, WeightsQ8QuantizesAtLoadAndSpeculationStaysExact) {
  // verify checks speculative decoding against greedy decoding of the same
  // (here quantized) target, the draft quantized with it.
  const CliResult r = run_cli("verify" + model("target") + " --draft " + quote(dir_ + "/draft") +
                              " --weights q8 --prompt 'in the beginning' --max-new-tokens 24");
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("IDENTICAL: "), std::string::npos) << r.all();  // a random target may stop at EOS
  const CliResult gen = run_cli("generate" + model("target") + " --weights q8 --prompt hello --max-new-tokens 8");
  EXPECT_EQ(gen.status, 0) << gen.all();
  const CliResult bad = run_cli("generate" + model("target") + " --weights q4 --prompt hello");
  EXPECT_EQ(bad.status, 2) << bad.all();
  EXPECT_NE(bad.err.find("--weights"), std::string::npos) << bad.all();
}

// rewind quantize writes a Q8 checkpoint that loads as q8 without a flag:
// its tokens are those of the original with --weights q8 (logits are
// compared bit for bit in q8_checkpoint_test.cc); inspect names the format.
TEST_F(Cli, QuantizeWritesACheckpointThatGeneratesTheTokensOfWeightsQ8) {
  const std::string out = dir_ + "/target-q8";
  fs::remove_all(out);
  const CliResult q = run_cli("quantize" + model("target") + " --out " + quote(out));
  ASSERT_EQ(q.status, 0) << q.all();
  EXPECT_NE(q.out.find("wrote " + out + ": "), std::string::npos) << q.all();
  EXPECT_NE(q.err.find("quantize: 1/5 global tensors"), std::string::npos) << q.all();
  EXPECT_NE(q.err.find("quantize: 5/5 layer 3"), std::string::npos) << q.all();
  const std::string args = " --prompt 'in the beginning' --max-new-tokens 24 --stats";
  const CliResult a = run_cli("generate --model " + quote(out) + args);
  const CliResult b = run_cli("generate" + model("target") + " --weights q8" + args);
  ASSERT_EQ(a.status, 0) << a.all();
  ASSERT_EQ(b.status, 0) << b.all();
  EXPECT_EQ(text_of(a), text_of(b));
  EXPECT_EQ(stats_of(a)["new_tokens"], stats_of(b)["new_tokens"]);
  EXPECT_EQ(text_of(run_cli("generate --model " + quote(out) + " --weights q8" + args)), text_of(a));
  const CliResult ins = run_cli("inspect --model " + quote(out));
  ASSERT_EQ(ins.status, 0) << ins.all();
  EXPECT_NE(ins.out.find("weights stored as q8 (a Q8 checkpoint"), std::string::npos) << ins.out;
  // Refused: as-stored weights of it, quantizing it again, an output in use.
  const CliResult stored = run_cli("generate --model " + quote(out) + " --weights as-stored --prompt x");
  EXPECT_EQ(stored.status, 2) << stored.all();
  EXPECT_NE(stored.err.find("already quantized"), std::string::npos) << stored.all();
  const CliResult again = run_cli("quantize --model " + quote(out) + " --out " + quote(dir_ + "/twice"));
  EXPECT_EQ(again.status, 2) << again.all();
  EXPECT_FALSE(fs::exists(dir_ + "/twice"));
  const CliResult busy = run_cli("quantize" + model("draft") + " --out " + quote(out));
  EXPECT_EQ(busy.status, 2) << busy.all();
  EXPECT_NE(busy.err.find("is not empty"), std::string::npos) << busy.all();
  EXPECT_EQ(text_of(run_cli("generate --model " + quote(out) + args)), text_of(a))
      << "the refused quantize changed " << out;
  fs::remove_all(out);
}

// rewind pack writes the pack file that later runs map: the same tokens as
// without it (logits are compared bit for bit in pack_file_test.cc),
// inspect says where the matrices come from, and a stale pack is named on
// stderr, not used.
TEST_F(Cli, PackWritesAFileThatLaterRunsMapWithTheSameTokens) {
  const std::string dir = dir_ + "/packed";
  fs::remove_all(dir);
  fs::copy(dir_ + "/target", dir);
  const CliResult p = run_cli("pack --model " + quote(dir));
  ASSERT_EQ(p.status, 0) << p.all();
  const std::string pack = dir + "/rewind.as-stored.pack";
  EXPECT_NE(p.out.find("wrote " + pack + ": "), std::string::npos) << p.all();
  EXPECT_NE(p.err.find("pack: loading and packing " + dir), std::string::npos) << p.all();
  const std::string args = " --prompt 'in the beginning' --max-new-tokens 24";
  const CliResult mapped = run_cli("generate --model " + quote(dir) + args);
  const CliResult packed = run_cli("generate --model " + quote(dir) + " --no-pack" + args);
  ASSERT_EQ(mapped.status, 0) << mapped.all();
  EXPECT_EQ(mapped.out, packed.out);
  EXPECT_EQ(mapped.err, "");
  EXPECT_NE(run_cli("inspect --model " + quote(dir)).out.find("matrices: mapped from pack file " + pack),
            std::string::npos);
  EXPECT_NE(run_cli("inspect" + model("target")).out.find("matrices: packed at load (no pack file"), std::string::npos);
  // The q8 pack serves --weights q8.
  ASSERT_EQ(run_cli("pack --model " + quote(dir) + " --weights q8").status, 0);
  EXPECT_EQ(run_cli("generate --model " + quote(dir) + " --weights q8" + args).out,
            run_cli("generate" + model("target") + " --weights q8" + args).out);
  // Stale: the checkpoint rewritten after the pack.
  const fs::path file = dir + "/model.safetensors";
  fs::last_write_time(file, fs::last_write_time(file) + std::chrono::seconds(2));
  const CliResult stale = run_cli("generate --model " + quote(dir) + args);
  ASSERT_EQ(stale.status, 0) << stale.all();
  EXPECT_EQ(stale.out, packed.out);
  EXPECT_NE(stale.err.find("rewind: note: " + pack + " not used: model.safetensors changed"), std::string::npos)
      << stale.err;
  fs::remove_all(dir);
}

TEST_F(Cli, VerifyRepeatsChecksEveryRunAndReportsMedians) {
  const CliResult r = run_cli("verify" + model("target") + " --draft " + quote(dir_ + "/draft") +
                              " --prompt 'in the beginning' --max-new-tokens 24 --repeats 3");
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("IDENTICAL: 24 new tokens"), std::string::npos) << r.all();
  EXPECT_NE(r.out.find("medians of 3 runs each"), std::string::npos) << r.all();
  const CliResult bad = run_cli("verify" + model("target") + " --lookup 2 --prompt x --repeats 0");
  EXPECT_EQ(bad.status, 2) << bad.all();
}

TEST_F(Cli, GenerateWithStatsEndsWithOneJsonLine) {
  const CliResult r = run_cli("generate" + model("target") + " --draft " + quote(dir_ + "/draft") +
                              " --prompt hello --max-new-tokens 12 --stats");
  ASSERT_EQ(r.status, 0) << r.all();
  const nlohmann::json j = stats_of(r);
  for (const char* key :
       {"new_tokens", "prompt_tokens", "seconds", "time_to_first_token_s", "tokens_per_second",
        "decode_tokens_per_second", "drafted", "accepted", "acceptance_rate", "drafted_at", "accepted_at",
        "acceptance_at", "rollbacks", "rounds", "forwards", "cache_seconds", "peak_cache_bytes", "seed", "threads"}) {
    EXPECT_TRUE(j.contains(key)) << key << " in " << j.dump();
  }
  EXPECT_GE(j.at("new_tokens"), 1);  // a random model may emit EOS before the budget
  EXPECT_LE(j.at("new_tokens"), 12);
  EXPECT_EQ(j.at("prompt_tokens"), 6);  // BOS + 5 bytes
  EXPECT_TRUE(j.at("seed").is_null()) << "greedy decoding has no seed: " << j.dump();
  EXPECT_EQ(j.at("drafted_at").size(), j.at("accepted_at").size());
  EXPECT_EQ(j.at("drafted_at").size(), j.at("acceptance_at").size());
  std::int64_t drafted = 0;
  for (const auto& d : j.at("drafted_at")) drafted += d.get<std::int64_t>();
  EXPECT_EQ(drafted, j.at("drafted").get<std::int64_t>());
}

TEST_F(Cli, InspectListsLayersAndMemory) {
  const CliResult r = run_cli("inspect" + model("target") + " --rollback 4");
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("linear_attention"), std::string::npos);
  // 1 full-attention layer x K and V x 2 kv heads x 8 dims x 4 bytes = 128 B
  // (the sliding layer's window is part of the fixed state).
  EXPECT_NE(r.out.find("KV bytes per token (full-attention layers, f32): 128 B"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rollback memory for R = 4: at most "), std::string::npos) << r.out;
}

TEST_F(Cli, MisuseGivesAClearMessageAndExitStatus2) {
  const std::string target = model("target");
  struct Misuse {
    std::string args;
    std::string phrase;
  };
  for (const Misuse& m : std::vector<Misuse>{
           {"generate --model /nonexistent/dir --prompt x", "Directory does not exist"},
           {"generate" + target + " --prompt ''", "--prompt is empty"},
           {"generate" + target + " --prompt x --lookup 2 --num-draft 0", "--num-draft: '0' is outside [1, 64]"},
           {"generate" + target + " --prompt x --lookup 2 --num-draft 1000", "--num-draft: '1000' is outside [1, 64]"},
           {"generate" + target + " --prompt x --frobnicate", "frobnicate"},
           {"generate" + target + " --prompt x --draft " + quote(dir_ + "/other_vocab"), "incompatible"},
           {"verify" + target + " --prompt x", "needs a draft source"},
           {"generate" + target + " --prompt x --temperature -1", "--temperature: '-1' is outside [0, 1e30]"},
           {"inspect --model " + quote(dir_), "config.json"},
       }) {
    const CliResult r = run_cli(m.args);
    EXPECT_EQ(r.status, 2) << m.args << "\n" << r.all();
    EXPECT_NE(r.all().find(m.phrase), std::string::npos) << m.args << "\n" << r.all();
  }
#ifdef REWIND_HAVE_SERVER
  // serve's speculation flags, refused before it listens.
  for (const Misuse& m : std::vector<Misuse>{
           {"serve" + target + " --port 0 --num-draft 3", "--num-draft applies to speculative decoding"},
           {"serve" + target + " --port 0 --lookup 2 --draft " + quote(dir_ + "/draft"), "--draft excludes --lookup"},
           {"serve" + target + " --port 0 --lookup 2 --num-draft 65", "--num-draft: '65' is outside [1, 64]"},
           {"serve" + target + " --port 0 --draft " + quote(dir_ + "/other_vocab"), "draft_dir"},
       }) {
    const CliResult r = run_cli(m.args);
    EXPECT_EQ(r.status, 2) << m.args << "\n" << r.all();
    EXPECT_NE(r.all().find(m.phrase), std::string::npos) << m.args << "\n" << r.all();
  }
#endif
}

// ---- 1. prompts from files --------------------------------------------------------

// 140 KB exceeds Linux's 128 KiB limit on one argument: as --prompt the shell
// cannot even start the CLI ("Argument list too long").
TEST_F(Cli, PromptFileTakesA140KBPromptFromAFileOrStandardInput) {
  std::string long_prompt;
  while (long_prompt.size() < 140 * 1000) long_prompt += "And God said, Let there be light: and there was light. ";
  const fs::path file = scratch_dir() / "long_prompt.txt";
  write_file(file, long_prompt);
  const std::string expected_prompt_tokens = std::to_string(long_prompt.size() + 1);

  const CliResult from_file = run_cli("generate" + model("draft") + " --prompt-file " + quote(file.string()) +
                                      " --max-new-tokens 6 --stats");
  ASSERT_EQ(from_file.status, 0) << from_file.err;
  EXPECT_EQ(stats_of(from_file).at("prompt_tokens").dump(), expected_prompt_tokens);

  const CliResult from_stdin = run_cli("generate" + model("draft") + " --prompt-file - --max-new-tokens 6 --stats",
                                       file.string());
  ASSERT_EQ(from_stdin.status, 0) << from_stdin.err;
  EXPECT_EQ(stats_of(from_stdin).at("prompt_tokens").dump(), expected_prompt_tokens);
  EXPECT_EQ(text_of(from_stdin), text_of(from_file));

  // verify reads prompt files too; a short prompt gives the same text from
  // a file as from --prompt.
  write_file(scratch_dir() / "short_prompt.txt", "in the beginning");
  const CliResult verify = run_cli("verify" + model("target") + " --lookup 3 --prompt-file " +
                                   quote((scratch_dir() / "short_prompt.txt").string()) + " --max-new-tokens 16");
  EXPECT_EQ(verify.status, 0) << verify.all();
  EXPECT_NE(verify.out.find("IDENTICAL: "), std::string::npos) << verify.all();
  const CliResult a = run_cli("generate" + model("target") + " --prompt 'in the beginning' --max-new-tokens 20");
  const CliResult b = run_cli("generate" + model("target") + " --prompt-file " +
                              quote((scratch_dir() / "short_prompt.txt").string()) + " --max-new-tokens 20");
  ASSERT_EQ(a.status, 0) << a.err;
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
}

// generate --prompts: line i of its output holds index i and, unless the
// prompt is empty, the text generate --prompt gives for that prompt alone.
void expect_lines_as_generated_alone(const std::vector<nlohmann::json>& json, const std::vector<std::string>& lines,
                                     const std::string& model_flag) {
  for (std::size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(json[i].at("index").get<std::size_t>(), i);
    if (lines[i].empty()) continue;  // --prompt refuses an empty text
    const CliResult alone = run_cli("generate" + model_flag + " --prompt " + quote(lines[i]) + " --max-new-tokens 12");
    ASSERT_EQ(alone.status, 0) << alone.err;
    // JSON holds Unicode: bytes that are not UTF-8 (a random model emits
    // them) become U+FFFD, as the same text dumped with that rule.
    const std::string alone_text = alone.out.substr(0, alone.out.size() - 1);
    const std::string expected = nlohmann::json::parse(
        nlohmann::json(alone_text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    EXPECT_EQ(json[i].at("text").get<std::string>(), expected) << "prompt " << i;
  }
}

// Decoding alone: the tokens after each sequence's first over the time
// after the last first token (all prompts prefill in one forward here).
void expect_decode_rate_after_first_tokens(const nlohmann::json& stats) {
  double last_first = 0.0, after_first = 0.0;
  for (const nlohmann::json& s : stats.at("per_sequence")) {
    if (s.at("new_tokens").get<double>() < 1) continue;
    last_first = std::max(last_first, s.at("time_to_first_token_s").get<double>());
    after_first += s.at("new_tokens").get<double>() - 1;
  }
  const double decode = stats.at("decode_tokens_per_second");
  ASSERT_GT(after_first, 0.0);
  EXPECT_NEAR(decode, after_first / (stats.at("seconds").get<double>() - last_first), 1e-6 * decode) << stats.dump();
}

// --prompts with --prompt or a missing file, no prefill rows, a directory
// for a prompt file: exit status 2 with a message.
void expect_prompts_misuse_refused(const std::string& model_flag, const fs::path& file) {
  for (const std::string& misuse : {std::string(" --prompts ") + quote(file.string()) + " --prompt x",
                                    std::string(" --prompts ") + quote((scratch_dir() / "missing.txt").string())}) {
    const CliResult bad = run_cli("generate" + model_flag + misuse);
    EXPECT_EQ(bad.status, 2) << misuse << ": " << bad.all();
    EXPECT_FALSE(bad.err.empty()) << misuse;
  }
  const CliResult zero_rows = run_cli("generate" + model_flag + " --prompt x --max-prefill-rows 0");
  EXPECT_EQ(zero_rows.status, 2) << zero_rows.all();
  // A directory opens as a stream and fails on the first read: named as such.
  for (const std::string flag : {"--prompts", "--prompt-file"}) {
    const CliResult dir = run_cli("generate" + model_flag + " " + flag + " " + quote(scratch_dir().string()));
    EXPECT_EQ(dir.status, 2) << dir.all();
    EXPECT_NE(dir.err.find(flag + " " + scratch_dir().string() + ": is a directory; give a file"), std::string::npos)
        << dir.all();
    EXPECT_TRUE(dir.out.empty()) << dir.all();
  }
}

// generate --prompts: one JSON line per prompt, in input order, each text
// what generate --prompt gives for that line alone; standard input works;
// misuse exits 2.
TEST_F(Cli, GeneratePromptsDecodesEveryLineAsOneBatch) {
  const std::vector<std::string> lines{"in the beginning", "and God said", "", "let there be light"};
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  const fs::path file = scratch_dir() / "prompts.txt";
  write_file(file, text);
  const CliResult r = run_cli("generate" + model("target") + " --prompts " + quote(file.string()) +
                              " --max-new-tokens 12 --stats");
  ASSERT_EQ(r.status, 0) << r.all();
  std::istringstream out(r.out);
  std::vector<nlohmann::json> json;
  for (std::string line; std::getline(out, line);) json.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(json.size(), lines.size() + 1) << r.out;
  ASSERT_NO_FATAL_FAILURE(expect_lines_as_generated_alone(json, lines, model("target")));
  const nlohmann::json& stats = json.back();
  EXPECT_EQ(stats.at("sequences").get<std::size_t>(), lines.size());
  EXPECT_EQ(stats.at("per_sequence").size(), lines.size());
  EXPECT_GT(stats.at("tokens_per_second").get<double>(), 0.0);
  ASSERT_NO_FATAL_FAILURE(expect_decode_rate_after_first_tokens(stats));

  const CliResult from_stdin = run_cli("generate" + model("target") + " --prompts - --max-new-tokens 12",
                                       file.string());
  ASSERT_EQ(from_stdin.status, 0) << from_stdin.err;
  EXPECT_EQ(from_stdin.out + json.back().dump(), r.out.substr(0, r.out.size() - 1))
      << "stdin and file give the same lines";

  // Speculative decoding of the batch (lossless: the same lines).
  for (const std::string& source : {std::string(" --lookup 2"), " --draft " + quote(dir_ + "/draft")}) {
    const CliResult spec = run_cli("generate" + model("target") + " --prompts " + quote(file.string()) +
                                   " --max-new-tokens 12 --num-draft 3" + source);
    ASSERT_EQ(spec.status, 0) << spec.all();
    EXPECT_EQ(spec.out + json.back().dump(), r.out.substr(0, r.out.size() - 1)) << source;
    const CliResult verify = run_cli("verify" + model("target") + " --prompts " + quote(file.string()) +
                                     " --max-new-tokens 30 --num-draft 4" + source);
    EXPECT_EQ(verify.status, 0) << verify.all();
    EXPECT_NE(verify.out.find("IDENTICAL: 4 prompts"), std::string::npos) << verify.all();
  }

  expect_prompts_misuse_refused(model("target"), file);
  // Two sequences at a time, the others joining as they finish: same lines.
  const CliResult waves = run_cli("verify" + model("target") + " --prompts " + quote(file.string()) +
                                  " --max-new-tokens 30 --lookup 2 --max-batch 2");
  EXPECT_EQ(waves.status, 0) << waves.all();
  // Three sequences at a time, or prompts fed 3 tokens a forward: the same
  // lines as one batch with the default prefill.
  for (const std::string flags : {" --max-batch 3", " --max-prefill-rows 3"}) {
    const CliResult same = run_cli("generate" + model("target") + " --prompts " + quote(file.string()) +
                                   " --max-new-tokens 12" + flags);
    ASSERT_EQ(same.status, 0) << flags << ": " << same.all();
    EXPECT_EQ(same.out + json.back().dump(), r.out.substr(0, r.out.size() - 1)) << flags;
  }
  const CliResult no_prompts = run_cli("generate" + model("target") + " --prompt x --max-batch 2");
  EXPECT_EQ(no_prompts.status, 2) << no_prompts.all();
  const CliResult repeats = run_cli("verify" + model("target") + " --lookup 2 --repeats 2 --prompts " +
                                    quote(file.string()));
  EXPECT_EQ(repeats.status, 2) << repeats.all();
  write_file(scratch_dir() / "no_lines.txt", "");
  const CliResult empty = run_cli("generate" + model("target") + " --prompts " +
                                  quote((scratch_dir() / "no_lines.txt").string()));
  EXPECT_EQ(empty.status, 2) << empty.all();
}

TEST_F(Cli, BenchBatchAddsAggregateRows) {
  const CliResult r = run_cli("bench" + model("target") + " --draft " + quote(dir_ + "/draft") +
                              " --k 2 --batch 1,3 --repeats 1 --max-new-tokens 8");
  ASSERT_EQ(r.status, 0) << r.all();
  for (const char* row : {"greedy_batch     1", "draft_batch      1", "greedy_batch     3", "draft_batch      3"})
    EXPECT_NE(r.out.find(row), std::string::npos) << row << "\n" << r.out;
  EXPECT_EQ(r.out.find(" NO"), std::string::npos) << r.out;
  const CliResult bad = run_cli("bench" + model("target") + " --batch 0 --repeats 1");
  EXPECT_EQ(bad.status, 2) << bad.all();
}

TEST_F(Cli, ForwardCostPrintsOneRowPerQRelativeToOneToken) {
  const CliResult r = run_cli("forward-cost" + model("target") + " --max-q 4 --context 20 --samples 3");
  ASSERT_EQ(r.status, 0) << r.all();
  std::istringstream lines(r.out);
  std::string line;
  std::getline(lines, line);
  EXPECT_NE(line.find("one-token forwards"), std::string::npos) << r.out;
  std::vector<double> micros, ratios;
  for (int q = 1; std::getline(lines, line); ++q) {
    std::istringstream fields(line);
    long long got_q = 0;
    double us = 0, ratio = 0;
    fields >> got_q >> us >> ratio;
    EXPECT_EQ(got_q, q) << r.out;
    micros.push_back(us);
    ratios.push_back(ratio);
  }
  ASSERT_EQ(micros.size(), 4u) << r.out;
  EXPECT_DOUBLE_EQ(ratios[0], 1.0);
  for (std::size_t q = 0; q < 4; ++q) {
    EXPECT_GT(micros[q], 0.0);
    // Both columns come from the same unrounded times, printed to 0.1 us and
    // 0.01x: the printed ratio must lie in the interval the rounded times allow.
    const double low = (micros[q] - 0.05) / (micros[0] + 0.05) - 0.005;
    const double high = (micros[q] + 0.05) / (micros[0] - 0.05) + 0.005;
    EXPECT_GE(ratios[q], low) << r.out;
    EXPECT_LE(ratios[q], high) << r.out;
  }
  for (const char* bad : {" --max-q 0", " --max-q 65", " --context 0", " --samples 0"}) {
    const CliResult b = run_cli("forward-cost" + model("target") + bad);
    EXPECT_EQ(b.status, 2) << bad << ": " << b.all();
  }
}

// forward-cost --batch: after the q rows, a blank line, a header, then one
// row per batch size, B = 1 first and each size once, whose per-token and
// gain columns follow from the rounds (within the printed rounding).
TEST_F(Cli, ForwardCostBatchPrintsOneRowPerBatchSize) {
  const CliResult r = run_cli("forward-cost" + model("target") + " --max-q 1 --context 9 --samples 3 --batch 3,1,3");
  ASSERT_EQ(r.status, 0) << r.all();
  const std::size_t table = r.out.find("\n\n");
  ASSERT_NE(table, std::string::npos) << r.out;
  std::istringstream lines(r.out.substr(table + 2));
  std::string line;
  std::getline(lines, line);
  EXPECT_NE(line.find("per token"), std::string::npos) << r.out;
  std::vector<long long> sizes;
  std::vector<double> micros, per_token, gain;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    long long b = 0;
    double us = 0, each = 0, g = 0;
    fields >> b >> us >> each >> g;
    sizes.push_back(b);
    micros.push_back(us);
    per_token.push_back(each);
    gain.push_back(g);
  }
  ASSERT_EQ(sizes, (std::vector<long long>{1, 3})) << r.out;
  EXPECT_DOUBLE_EQ(gain[0], 1.0);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_GT(micros[i], 0.0) << r.out;
    EXPECT_NEAR(per_token[i], micros[i] / static_cast<double>(sizes[i]), 0.1) << r.out;
    const double b = static_cast<double>(sizes[i]);
    EXPECT_GE(gain[i], b * (micros[0] - 0.05) / (micros[i] + 0.05) - 0.005) << r.out;
    EXPECT_LE(gain[i], b * (micros[0] + 0.05) / (micros[i] - 0.05) + 0.005) << r.out;
  }
  for (const char* bad : {" --batch 0", " --batch 4097", " --batch 2,x"}) {
    const CliResult b = run_cli("forward-cost" + model("target") + bad);
    EXPECT_EQ(b.status, 2) << bad << ": " << b.all();
  }
}

TEST_F(Cli, PromptAndPromptFileAreRefusedTogetherAndOneIsNeeded) {
  write_file(scratch_dir() / "p.txt", "text");
  write_file(scratch_dir() / "empty.txt", "");
  const std::string p = quote((scratch_dir() / "p.txt").string());
  struct Case {
    std::string args;
    std::string phrase;
  };
  for (const Case& c : std::vector<Case>{
           {"generate" + model("target") + " --prompt x --prompt-file " + p, "--prompt excludes --prompt-file"},
           {"verify" + model("target") + " --lookup 2 --prompt x --prompt-file " + p,
            "--prompt excludes --prompt-file"},
           {"generate" + model("target"), "--prompt TEXT or --prompt-file FILE"},
           {"verify" + model("target") + " --lookup 2", "--prompt TEXT or --prompt-file FILE"},
           {"generate" + model("target") + " --prompt-file /nonexistent/prompt.txt", "/nonexistent/prompt.txt"},
           {"generate" + model("target") + " --prompt-file " + quote((scratch_dir() / "empty.txt").string()),
            "is empty"},
           {"generate" + model("target") + " --prompt-file -", "(standard input) is empty"},
       }) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.all();
    EXPECT_NE(r.all().find(c.phrase), std::string::npos) << c.args << "\n" << r.all();
  }
}

// ---- 2. --stats: prefill and decoding apart ------------------------------------------

TEST_F(Cli, StatsSeparateTimeToFirstTokenFromTheDecodeRate) {
  // A prompt long enough that its prefill dominates the wall time.
  std::string prompt;
  while (prompt.size() < 20000) prompt += "the LORD spake unto Moses, saying, ";
  const fs::path file = scratch_dir() / "prompt_20k.txt";
  write_file(file, prompt);
  const CliResult r = run_cli("generate" + model("linear") + " --prompt-file " + quote(file.string()) +
                              " --max-new-tokens 32 --stats");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = stats_of(r);
  const double seconds = j.at("seconds"), ttft = j.at("time_to_first_token_s");
  const double tps = j.at("tokens_per_second"), decode = j.at("decode_tokens_per_second");
  const double n = j.at("new_tokens");
  ASSERT_GE(n, 8) << "stopped at EOS too early to measure decoding: " << j.dump();
  EXPECT_GT(ttft, 0.0);
  EXPECT_LT(ttft, seconds);
  // tokens_per_second: end to end, prefill included.
  EXPECT_NEAR(tps, n / seconds, 1e-6 * tps) << j.dump();
  // decode_tokens_per_second: the tokens after the first over the time after it.
  EXPECT_NEAR(decode, (n - 1) / (seconds - ttft), 1e-6 * decode) << j.dump();
  EXPECT_GT(decode, tps) << "the prefill of 20,000 tokens must not count against decoding: " << j.dump();
}

// ---- 3. flags that would be ignored ------------------------------------------------------

TEST_F(Cli, FlagsThatWouldHaveNoEffectAreRefused) {
  struct Case {
    std::string flags;
    std::string phrase;
  };
  for (const Case& c : std::vector<Case>{
           {"--num-draft 8", "--num-draft applies to speculative decoding: it needs a draft source"},
           {"--adaptive", "--adaptive applies to speculative decoding: it needs a draft source"},
           {"--top-k 5", "--top-k applies to sampling only: it needs --temperature"},
           {"--top-p 0.5", "--top-p applies to sampling only: it needs --temperature"},
           {"--seed 3", "--seed applies to sampling only: it needs --temperature"},
           {"--temperature 0 --top-k 5", "--top-k applies to sampling only"},
       }) {
    const CliResult r = run_cli("generate" + model("target") + " --prompt x --max-new-tokens 4 " + c.flags);
    EXPECT_EQ(r.status, 2) << c.flags << "\n" << r.all();
    EXPECT_NE(r.err.find(c.phrase), std::string::npos) << c.flags << "\n" << r.all();
  }
  // With what they need, they are accepted.
  for (const std::string& ok :
       {std::string("--lookup 2 --num-draft 8 --adaptive"), "--draft " + quote(dir_ + "/draft") + " --num-draft 3",
        std::string("--temperature 0.8 --top-k 5 --top-p 0.9 --seed 3")}) {
    const CliResult r = run_cli("generate" + model("target") + " --prompt x --max-new-tokens 4 " + ok);
    EXPECT_EQ(r.status, 0) << ok << "\n" << r.all();
  }
}

// ---- 4. seeds ------------------------------------------------------------------------------

TEST_F(Cli, SamplingWithoutSeedDrawsOneAndReportsItSoTheRunCanBeRepeated) {
  for (const std::string& source : {std::string(), " --draft " + quote(dir_ + "/draft")}) {
    const std::string args = "generate" + model("target") + source +
                             " --prompt 'in the' --max-new-tokens 48 --temperature 2 --stats";
    const CliResult first = run_cli(args), second = run_cli(args);
    ASSERT_EQ(first.status, 0) << first.err;
    ASSERT_EQ(second.status, 0) << second.err;
    const nlohmann::json s1 = stats_of(first), s2 = stats_of(second);
    ASSERT_TRUE(s1.at("seed").is_number_unsigned()) << s1.dump();
    ASSERT_TRUE(s2.at("seed").is_number_unsigned()) << s2.dump();
    EXPECT_NE(s1.at("seed"), s2.at("seed")) << source;
    EXPECT_NE(text_of(first), text_of(second)) << "two unseeded runs at temperature 2 gave the same 48 tokens";
    // The printed seed reproduces the run exactly.
    const std::string seed = s1.at("seed").dump();
    const CliResult again = run_cli(args + " --seed " + seed);
    ASSERT_EQ(again.status, 0) << again.err;
    EXPECT_EQ(text_of(again), text_of(first)) << source;
    EXPECT_EQ(stats_of(again).at("seed").dump(), seed);
  }
}

// ---- 5. values -----------------------------------------------------------------------------

TEST_F(Cli, BadValuesAreRefusedWithTheReason) {
  const std::string gen = "generate" + model("target") + " --prompt x ";
  struct Case {
    std::string args;
    std::string phrase;
  };
  for (const Case& c : std::vector<Case>{
           {gen + "--temperature inf", "--temperature: 'inf' is not a finite number"},
           {gen + "--temperature nan", "--temperature: 'nan' is not a finite number"},
           {gen + "--temperature 1e39", "--temperature: '1e39' is not a finite number"},
           {gen + "--temperature -0.5", "--temperature: '-0.5' is outside"},
           {gen + "--temperature warm", "--temperature: 'warm' is not a number"},
           {gen + "--temperature 1 --top-p 0", "--top-p: '0' is outside (0, 1]"},
           {gen + "--temperature 1 --top-p nan", "--top-p: 'nan' is not a finite number"},
           {gen + "--temperature 1 --top-k -1", "--top-k: '-1' is outside"},
           {gen + "--temperature 1 --seed -1", "--seed: '-1' is negative"},
           {gen + "--temperature 1 --seed 1.5", "--seed: '1.5' is not an integer"},
           {gen + "--max-new-tokens abc", "--max-new-tokens: 'abc' is not an integer"},
           {gen + "--max-new-tokens 2.5", "--max-new-tokens: '2.5' is not an integer"},
           {gen + "--max-new-tokens -1", "--max-new-tokens: '-1' is outside [0, 1073741824]"},
           {gen + "--max-new-tokens 99999999999999999999", "is outside [0, 1073741824]"},
           {gen + "--threads 0", "--threads: '0' is outside"},
           {"inspect" + model("target") + " --rollback -1", "--rollback: '-1' is outside"},
           {"inspect" + model("target") + " --rollback 9223372036854775807", "--rollback 9223372036854775807: "},
           {"inspect" + model("target") + " --rollback 1099511627776", "--rollback 1099511627776: "},
           {"eval" + model("target") + " --text /dev/null --chunk 0", "--chunk: '0' is outside"},
           {"init-random --config /dev/null --out /tmp/x --seed -3", "--seed: '-3' is negative"},
       }) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.all();
    EXPECT_NE(r.err.find(c.phrase), std::string::npos) << c.args << "\n" << r.all();
  }
  // A large R within the library's bounds is computed, not wrapped around:
  // 10^9 tokens x 1,536 bytes per token (sliding 2 x 2 x 8 x 4, conv 32 x 4,
  // Gated DeltaNet conv 64 x 4 and state 4 x 8 x 8 x 4) = 1.40 TiB.
  const CliResult big = run_cli("inspect" + model("target") + " --rollback 1000000000");
  EXPECT_EQ(big.status, 0) << big.all();
  EXPECT_NE(big.out.find("rollback memory for R = 1000000000: at most 1.40 TiB more"), std::string::npos) << big.out;
}

TEST_F(Cli, HelpShowsTheDefaultOfEveryOptionThatTakesAValue) {
  for (const std::string sub : {"generate", "verify", "eval", "inspect", "bench", "init-random", "quantize",
                                "snapshot save", "snapshot load"}) {  // snapshot inspect takes only its required --file
    const CliResult r = run_cli(sub + " --help");
    ASSERT_EQ(r.status, 0) << r.all();
    std::istringstream lines(r.out);
    int checked = 0;
    for (std::string line; std::getline(lines, line);) {
      // "  --name ..." or, with a short flag, "  -n,--name ...".
      const bool with_short = line.size() > 6 && line.compare(0, 3, "  -") == 0 && line[3] != '-' && line[4] == ',';
      if (line.rfind("  --", 0) != 0 && !with_short) continue;
      if (with_short) line.erase(2, 3);
      if (line.rfind("  --help", 0) == 0) continue;
      // The option column ends at the first double space (or the line's end).
      const std::string column = line.substr(2, line.find("  ", 2) - 2);
      const bool takes_value = column.find(' ') != std::string::npos;
      const bool prompt = column.rfind("--prompt ", 0) == 0 || column.rfind("--prompt-file ", 0) == 0 ||
                          column.rfind("--prompts ", 0) == 0;  // the prompt has no default
      if (!takes_value || prompt || column.find("REQUIRED") != std::string::npos) continue;
      EXPECT_NE(column.find('='), std::string::npos) << sub << ": no default shown in '" << line << "'";
      ++checked;
    }
    EXPECT_GT(checked, 0) << sub << "\n" << r.out;
  }
  const CliResult gen = run_cli("generate --help");
  for (const char* shown : {"=128", "=4", "=random", "=1 or $OMP_NUM_THREADS", "tokens_per_second (end to end",
                            "decode_tokens_per_second"}) {
    EXPECT_NE(gen.out.find(shown), std::string::npos) << shown << "\n" << gen.out;
  }
}

TEST_F(Cli, NoProgressBarWhenStderrIsNotATerminal) {
  // About a second of work in a Release build: the old bar appeared after half a second.
  std::string text;
  while (text.size() < 400 * 1000) text += "In the beginning God created the heaven and the earth. ";
  const fs::path file = scratch_dir() / "eval.txt";
  write_file(file, text);
  const CliResult eval = run_cli("eval" + model("linear") + " --text " + quote(file.string()) + " --context 0");
  ASSERT_EQ(eval.status, 0) << eval.all();
  EXPECT_NE(eval.out.find("bits per byte"), std::string::npos) << eval.out;
  EXPECT_EQ(eval.err, "") << "eval drew on a non-terminal stderr";
  const CliResult verify = run_cli("verify" + model("target") + " --lookup 2 --prompt x --max-new-tokens 500");
  ASSERT_EQ(verify.status, 0) << verify.all();
  EXPECT_EQ(verify.err, "") << "verify drew on a non-terminal stderr";
}

// ---- 6. init-random ------------------------------------------------------------------------

TEST_F(Cli, InitRandomRefusesToOverwriteAModelUnlessForced) {
  const fs::path config = scratch_dir() / "config.json";
  write_file(config, read_file(fs::path(dir_) / "draft" / "config.json"));
  const fs::path out = scratch_dir() / "trained";
  fs::remove_all(out);
  const std::string init = "init-random --config " + quote(config.string()) + " --out " + quote(out.string());

  // A fresh directory: fine.
  ASSERT_EQ(run_cli(init + " --seed 1").status, 0);
  // Pretend it was trained: a model card and a training record.
  write_file(out / "README.md", "# trained\n\nheld-out bits per byte: 1.6\n");
  write_file(out / "training.json", "{\"steps\": 863}\n");
  const std::string weights = read_file(out / "model.safetensors");

  const CliResult refused = run_cli(init + " --seed 2");
  EXPECT_EQ(refused.status, 2) << refused.all();
  EXPECT_NE(refused.err.find("already holds a model"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("--force"), std::string::npos) << refused.err;
  EXPECT_EQ(read_file(out / "model.safetensors"), weights) << "the weights changed although refused";
  EXPECT_EQ(read_file(out / "README.md"), "# trained\n\nheld-out bits per byte: 1.6\n");

  const CliResult forced = run_cli(init + " --seed 2 --force");
  ASSERT_EQ(forced.status, 0) << forced.all();
  EXPECT_NE(read_file(out / "model.safetensors"), weights);
  const std::string card = read_file(out / "README.md");
  EXPECT_EQ(card.find("held-out"), std::string::npos) << "the stale card survived: " << card;
  EXPECT_NE(card.find("init-random"), std::string::npos) << card;
  EXPECT_NE(card.find("--seed 2"), std::string::npos) << card;
  EXPECT_FALSE(fs::exists(out / "training.json"));
  EXPECT_EQ(run_cli("inspect --model " + quote(out.string())).status, 0);

  // A directory with only some *.safetensors also holds a model.
  const fs::path other = scratch_dir() / "shards";
  fs::create_directories(other);
  write_file(other / "model-00001-of-00002.safetensors", "x");
  const CliResult shards = run_cli("init-random --config " + quote(config.string()) + " --out " +
                                   quote(other.string()) + " --seed 1");
  EXPECT_EQ(shards.status, 2) << shards.all();
  EXPECT_NE(shards.err.find("model-00001-of-00002.safetensors"), std::string::npos) << shards.err;
}

// ---- 7. threads ----------------------------------------------------------------------------

TEST_F(Cli, OneThreadUnlessThreadsOrOmpNumThreadsSayOtherwise) {
  const std::string gen = "generate" + model("target") + " --prompt x --max-new-tokens 2 --stats";
  struct Case {
    std::string env;
    std::string flags;
    int threads;
  };
  for (const Case& c : std::vector<Case>{
           {"env -u OMP_NUM_THREADS", "", 1},
           {"env -u OMP_NUM_THREADS", " --threads 3", 3},
           {"env OMP_NUM_THREADS=2", "", 2},
           {"env OMP_NUM_THREADS=2", " --threads 1", 1},
           {"env OMP_NUM_THREADS=", "", 1},
       }) {
    const CliResult r = run_cli(gen + c.flags, "/dev/null", c.env);
    ASSERT_EQ(r.status, 0) << c.env << c.flags << "\n" << r.all();
    EXPECT_EQ(stats_of(r).at("threads"), c.threads) << c.env << c.flags;
  }
}

// ---- 8. snapshot files that are not files, or empty (issue 28) ----------------------

// A device or a pipe has no end to read to and an empty file no header:
// each is one error line and exit 2, at once (/dev/zero was read without
// limit; an empty file passed a null pointer to memcpy).
TEST_F(Cli, SnapshotFileThatIsEmptyOrNotARegularFileIsRefused) {
  const fs::path empty = scratch_dir() / "empty.snap";
  write_file(empty, "");
  const fs::path fifo = scratch_dir() / "snap.fifo";
  fs::remove(fifo);
  ASSERT_EQ(std::system(("mkfifo " + quote(fifo.string())).c_str()), 0);
  struct Case {
    std::string file, phrase;
  };
  for (const Case& c : std::vector<Case>{
           {empty.string(), " is empty; a snapshot file starts with the 8 bytes \"RWNDSNAP\""},
           {"/dev/zero", "--file /dev/zero is a character device; a snapshot is read from a regular file"},
           {fifo.string(), " is a pipe; a snapshot is read from a regular file"},
       }) {
    for (const std::string& sub : {std::string("snapshot inspect"), "snapshot load" + model("target")}) {
      const CliResult r = run_cli(sub + " --file " + quote(c.file));
      EXPECT_EQ(r.status, 2) << sub << " " << c.file << "\n" << r.all();
      EXPECT_NE(r.err.find(c.phrase), std::string::npos) << sub << " " << c.file << "\n" << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
      EXPECT_TRUE(r.out.empty()) << r.out;
    }
  }
  // A saved snapshot still reads, also through a symbolic link to it.
  const fs::path saved = scratch_dir() / "saved.snap", link = scratch_dir() / "link.snap";
  const CliResult save = run_cli("snapshot save" + model("target") + " --prompt 'in the' --out " +
                                 quote(saved.string()));
  ASSERT_EQ(save.status, 0) << save.all();
  fs::remove(link);
  fs::create_symlink(saved, link);
  const CliResult inspect = run_cli("snapshot inspect --file " + quote(link.string()));
  EXPECT_EQ(inspect.status, 0) << inspect.all();
  EXPECT_NE(inspect.out.find("every checksum verified"), std::string::npos) << inspect.out;
}

// ---- 9. a long --prompts file streams in bounded batches (issue 28) --------------------

// 3,000 lines: without --max-batch at most 64 sequences decode at once
// (fewer when memory is short), and every line's text is what --prompt
// gives for it alone, in input order; --max-batch 7 gives the same lines
// with exactly 7 at once. Sampled and speculative decoding in groups give
// what one batch of the whole file (--max-batch 0) gives: sequence i samples
// with seed + i, its index in the file.
TEST_F(Cli, GeneratePromptsStreamsALongFileInBoundedBatches) {
  const std::vector<std::string> words{"in", "the", "beginning", "god", "created", "light", "and", "earth"};
  std::vector<std::string> lines;
  std::string text;
  for (std::size_t i = 0; i < 3000; ++i) {
    std::string line;
    for (std::size_t w = 0; w < i % 4; ++w) line += (w ? " " : "") + words[(i * 7 + w * 3) % words.size()];
    if (i % 4 == 0) line = words[i % words.size()] + std::to_string(i);
    lines.push_back(line);
    text += line + "\n";
  }
  const fs::path file = scratch_dir() / "many_prompts.txt";
  write_file(file, text);
  auto json_lines = [](const CliResult& r) {
    std::istringstream out(r.out);
    std::vector<nlohmann::json> json;
    for (std::string line; std::getline(out, line);) json.push_back(nlohmann::json::parse(line));
    return json;
  };
  const std::string gen = "generate" + model("target") + " --prompts " + quote(file.string()) + " --max-new-tokens 3";
  const CliResult r = run_cli(gen + " --stats");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<nlohmann::json> json = json_lines(r);
  ASSERT_EQ(json.size(), lines.size() + 1);
  for (std::size_t i = 0; i < lines.size(); ++i) ASSERT_EQ(json[i].at("index").get<std::size_t>(), i);
  const nlohmann::json& stats = json.back();
  EXPECT_EQ(stats.at("sequences").get<std::size_t>(), lines.size());
  const auto max_batch = stats.at("max_batch").get<std::int64_t>();
  EXPECT_GE(max_batch, 1);
  EXPECT_LE(max_batch, 64);
  EXPECT_GE(stats.at("peak_batch").get<std::int64_t>(), 1);
  EXPECT_LE(stats.at("peak_batch").get<std::int64_t>(), max_batch);
  std::int64_t tokens = 0;
  for (const nlohmann::json& s : stats.at("per_sequence")) tokens += s.at("new_tokens").get<std::int64_t>();
  EXPECT_EQ(stats.at("new_tokens").get<std::int64_t>(), tokens);
  for (const std::size_t i :
       {std::size_t{1}, std::size_t{4}, std::size_t{255}, std::size_t{256}, std::size_t{1999}, std::size_t{2999}}) {
    const CliResult alone = run_cli("generate" + model("target") + " --prompt " + quote(lines[i]) +
                                    " --max-new-tokens 3");
    ASSERT_EQ(alone.status, 0) << alone.err;
    const std::string expected = nlohmann::json::parse(
        nlohmann::json(alone.out.substr(0, alone.out.size() - 1))
            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    EXPECT_EQ(json[i].at("text").get<std::string>(), expected) << "line " << i << ": " << lines[i];
  }
  const std::string without_stats = r.out.substr(0, r.out.size() - stats.dump().size() - 1);
  const CliResult seven = run_cli(gen + " --max-batch 7 --stats");
  ASSERT_EQ(seven.status, 0) << seven.err;
  EXPECT_EQ(seven.out.substr(0, without_stats.size()), without_stats);
  EXPECT_EQ(stats_of(seven).at("max_batch"), 7);
  EXPECT_EQ(stats_of(seven).at("peak_batch"), 7);

  // The first 300 lines, sampled, plain and speculative: groups of 20 (--max-batch 5) and one batch agree.
  std::string head;
  for (std::size_t i = 0; i < 300; ++i) head += lines[i] + "\n";
  const fs::path head_file = scratch_dir() / "head_prompts.txt";
  write_file(head_file, head);
  for (const std::string& source : {std::string(), std::string(" --lookup 2"), " --draft " + quote(dir_ + "/draft")}) {
    const std::string sampled = "generate" + model("target") + " --prompts " + quote(head_file.string()) +
                                " --max-new-tokens 6 --temperature 1 --seed 11" + source;
    const CliResult grouped = run_cli(sampled + " --max-batch 5");
    const CliResult whole = run_cli(sampled + " --max-batch 0");
    ASSERT_EQ(grouped.status, 0) << source << ": " << grouped.err;
    ASSERT_EQ(whole.status, 0) << source << ": " << whole.err;
    EXPECT_EQ(std::count(grouped.out.begin(), grouped.out.end(), '\n'), 300) << source;
    EXPECT_EQ(grouped.out, whole.out) << source;
  }
}

// ---- 9. llama.cpp habits (issue 29) -------------------------------------------------

// -m -p -n -t -s -c as llama-cli users type them: the same run as the long
// flags, byte for byte, on every subcommand that has the long flag.
TEST_F(Cli, ShortFlagsAsLlamaCppUsersTypeThemEqualTheLongFlags) {
  const std::string dir = quote(dir_ + "/target");
  const std::string prompt = quote("in the beginning");
  auto same = [](const std::string& short_args, const std::string& long_args, const std::string& until = "") {
    const CliResult s = run_cli(short_args), l = run_cli(long_args);
    EXPECT_EQ(s.status, 0) << short_args << "\n" << s.all();
    EXPECT_EQ(l.status, 0) << long_args << "\n" << l.all();
    const std::string s_out = until.empty() ? s.out : s.out.substr(0, s.out.find(until));
    const std::string l_out = until.empty() ? l.out : l.out.substr(0, l.out.find(until));
    EXPECT_FALSE(l_out.empty()) << long_args;
    EXPECT_EQ(s_out, l_out) << short_args << "\nvs\n" << long_args;
    EXPECT_EQ(s.err, l.err) << short_args;
  };
  same(
      "generate -m " + dir + " -p " + prompt + " -n 8 -s 1 -t 1 --temperature 0.8",
      "generate --model " + dir + " --prompt " + prompt + " --max-new-tokens 8 --seed 1 --threads 1 --temperature 0.8");
  same("generate -m " + dir + " -p " + prompt + " -n 8 -t 1 -c 64",
       "generate --model " + dir + " --prompt " + prompt + " --max-new-tokens 8 --threads 1 --ctx-size 64");
  // A seed that differs gives other text: -s is not ignored.
  EXPECT_NE(run_cli("generate -m " + dir + " -p " + prompt + " -n 16 -s 1 --temperature 1.5").out,
            run_cli("generate -m " + dir + " -p " + prompt + " -n 16 -s 2 --temperature 1.5").out);
  // verify's and eval's lines end with timings: compared before them.
  same("verify -m " + dir + " -p " + prompt + " -n 12 -t 1 -c 64 --lookup 2",
       "verify --model " + dir + " --prompt " + prompt + " --max-new-tokens 12 --threads 1 --ctx-size 64 --lookup 2",
       "; greedy");
  const fs::path text = scratch_dir() / "habits_eval.txt";
  write_file(text, "in the beginning was the word\n");
  same("eval -m " + dir + " --text " + quote(text.string()) + " -t 1",
       "eval --model " + dir + " --text " + quote(text.string()) + " --threads 1", " bytes, ");
  same("inspect -m " + dir, "inspect --model " + dir, "weights in memory");
  const std::string snap = quote((scratch_dir() / "habits.snap").string());
  same("snapshot save -m " + dir + " -p " + prompt + " -t 1 -c 64 --out " + snap,
       "snapshot save --model " + dir + " --prompt " + prompt + " --threads 1 --ctx-size 64 --out " + snap);
  same("snapshot load -m " + dir + " --file " + snap + " -n 8 -s 3 -t 1 -c 64 --temperature 0.9",
       "snapshot load --model " + dir + " --file " + snap +
           " --max-new-tokens 8 --seed 3 --threads 1 --ctx-size 64 --temperature 0.9");
  const fs::path a = scratch_dir() / "habits_init_a", b = scratch_dir() / "habits_init_b";
  const std::string config = quote(dir_ + "/target/config.json");
  ASSERT_EQ(run_cli("init-random --config " + config + " --out " + quote(a.string()) + " -s 11").status, 0);
  ASSERT_EQ(run_cli("init-random --config " + config + " --out " + quote(b.string()) + " --seed 11").status, 0);
  EXPECT_EQ(read_file(a / "model.safetensors"), read_file(b / "model.safetensors"));
  // bench and forward-cost print timings only: their help names the flags.
  for (const auto& [sub, flags] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"bench", {"-m,--model", "-n,--max-new-tokens", "-t,--threads"}},
           {"forward-cost", {"-m,--model", "-t,--threads"}},
           {"generate",
            {"-m,--model", "-p,--prompt", "-n,--max-new-tokens", "-t,--threads", "-s,--seed", "-c,--ctx-size"}},
           {"verify", {"-m,--model", "-p,--prompt", "-n,--max-new-tokens", "-t,--threads", "-c,--ctx-size"}},
           {"eval", {"-m,--model", "-t,--threads"}},
           {"init-random", {"-s,--seed"}},
       }) {
    const CliResult h = run_cli(sub + " --help");
    for (const std::string& f : flags) EXPECT_NE(h.out.find("  " + f + " "), std::string::npos) << sub << " " << f;
  }
  const CliResult r = run_cli("forward-cost -m " + dir + " -t 1 --max-q 1 --samples 2 --context 4");
  EXPECT_EQ(r.status, 0) << r.all();
}

// --version prints the version of CMake's project() and exits 0, with or
// without a subcommand's help around it.
TEST_F(Cli, VersionPrintsTheProjectVersion) {
  const std::string cmake = read_file(std::string(REWIND_SOURCE_DIR) + "/CMakeLists.txt");
  const std::string marker = "project(rewind VERSION ";
  const std::size_t at = cmake.find(marker);
  ASSERT_NE(at, std::string::npos);
  const std::size_t from = at + marker.size();
  const std::string version = cmake.substr(from, cmake.find(' ', from) - from);
  ASSERT_FALSE(version.empty());
  const CliResult r = run_cli("--version");
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_EQ(r.out, "rewind " + version + "\n");
  EXPECT_EQ(r.err, "");
}

// A misspelt subcommand or flag: the nearest one, the list, exit 2.
TEST_F(Cli, MisspeltSubcommandsAndFlagsGetADidYouMean) {
#ifdef REWIND_HAVE_SERVER
  const std::string all =
      "(subcommands: generate, verify, eval, inspect, bench, forward-cost, snapshot, init-random, quantize, pack, "
      "serve)";
#else
  const std::string all =
      "(subcommands: generate, verify, eval, inspect, bench, forward-cost, snapshot, init-random, quantize)";
#endif
  struct Case {
    std::string args, err;
  };
  for (const Case& c : std::vector<Case>{
           {"generat --model x", "rewind: error: unknown subcommand 'generat'; did you mean 'generate'? " + all + "\n"},
           {"verfy", "rewind: error: unknown subcommand 'verfy'; did you mean 'verify'? " + all + "\n"},
           {"frobnicate", "rewind: error: unknown subcommand 'frobnicate' " + all + "\n"},
           {"snapshot sav",
            "rewind: error: unknown subcommand 'sav' of rewind snapshot; did you mean 'save'? "
            "(subcommands: save, inspect, load)\n"},
           {"generate" + model("target") + " -p x --max-new-token 3",
            "rewind: error: unknown flag '--max-new-token' for rewind generate; did you mean '--max-new-tokens'? "
            "(`rewind generate --help` lists its flags)\n"},
           {"generate" + model("target") + " --promt x",
            "rewind: error: unknown flag '--promt' for rewind generate; did you mean '--prompt'? "
            "(`rewind generate --help` lists its flags)\n"},
           {"-m " + quote(dir_ + "/target") + " -p x",
            "rewind: error: '-m' comes before any subcommand; give one first, as in `rewind generate -m DIR -p TEXT` " +
                all + "\n"},
           {"", "rewind: error: rewind needs a subcommand " + all.substr(0, all.size() - 1) +
                    "; `rewind --help` describes them)\n"},
       }) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.all();
    EXPECT_EQ(r.err, c.err) << c.args;
    EXPECT_EQ(r.out, "") << c.args;
  }
  // A value that starts with '-' is a value, not a flag to correct.
  const CliResult r = run_cli("generate" + model("target") + " -p -x -n 2");
  EXPECT_EQ(r.status, 0) << r.all();
}

// The context: prompt tokens + --max-new-tokens at most --ctx-size, by
// default the model's max_position_embeddings; refused before any work.
TEST_F(Cli, ContextLengthIsCheckedAgainstTheModels) {
  ModelConfig config = hybrid({"conv", "sliding_attention"}, 16, 4);
  config.max_position_embeddings = 16;
  const std::string ctx16 = dir_ + "/ctx16";
  write_random_model(config, ctx16, 9, DType::F32);
  const std::string m = " -m " + quote(ctx16);
  // "abc": BOS + 3 bytes = 4 tokens.
  const CliResult fits = run_cli("generate" + m + " -p abc -n 12");
  EXPECT_EQ(fits.status, 0) << fits.all();
  struct Case {
    std::string args, err;
  };
  for (const Case& c : std::vector<Case>{
           {"generate" + m + " -p abc -n 13",
            "rewind: error: the prompt (4 tokens) plus --max-new-tokens 13 needs 17 positions, past the context of 16 "
            "(the model's max_position_embeddings, -c / --ctx-size); shorten the prompt or lower -n / "
            "--max-new-tokens\n"},
           {"generate" + m + " -p abc -n 5 -c 8",
            "rewind: error: the prompt (4 tokens) plus --max-new-tokens 5 needs 9 positions, past the context of 8 "
            "(-c / --ctx-size); shorten the prompt or lower -n / --max-new-tokens\n"},
           {"generate" + model("target") + " -p abc -n 5 -c 8",
            "rewind: error: the prompt (4 tokens) plus --max-new-tokens 5 needs 9 positions, past the context of 8 "
            "(-c / --ctx-size); shorten the prompt or lower -n / --max-new-tokens\n"},
           {"generate" + m + " -p abc -n 4 -c 17",
            "rewind: error: --ctx-size 17 is past the model's max_position_embeddings (16); give at most 16\n"},
           {"verify" + m + " --lookup 2 -p abc -n 13",
            "rewind: error: the prompt (4 tokens) plus --max-new-tokens 13 needs 17 positions, past the context of 16 "
            "(the model's max_position_embeddings, -c / --ctx-size); shorten the prompt or lower -n / "
            "--max-new-tokens\n"},
       }) {
    const CliResult r = run_cli(c.args);
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.all();
    EXPECT_EQ(r.err, c.err) << c.args;
    EXPECT_EQ(r.out, "") << c.args;  // before any work: nothing generated
  }
  EXPECT_EQ(run_cli("generate" + m + " -p abc -n 4 -c 8").status, 0);
  EXPECT_EQ(run_cli("verify" + m + " --lookup 2 -p abc -n 12").status, 0);
  EXPECT_EQ(run_cli("generate" + model("target") + " -p abc -n 200").status, 0);  // no limit named: none
  // --prompts: the line past the context is named.
  const fs::path prompts = scratch_dir() / "ctx_prompts.txt";
  write_file(prompts, "abc\nabcdefghij\n");
  const CliResult batch = run_cli("generate" + m + " --prompts " + quote(prompts.string()) + " -n 8");
  EXPECT_EQ(batch.status, 2) << batch.all();
  EXPECT_NE(batch.err.find("--prompts line 2 (11 tokens) plus --max-new-tokens 8 needs 19 positions, past the "
                           "context of 16"),
            std::string::npos)
      << batch.all();
  // snapshot load: the saved sequence's length counts.
  const std::string snap = quote((scratch_dir() / "ctx.snap").string());
  ASSERT_EQ(run_cli("snapshot save" + m + " -p abc --out " + snap).status, 0);
  EXPECT_EQ(run_cli("snapshot load" + m + " --file " + snap + " -n 12").status, 0);
  // eval: a window is BOS + --context bytes (the whole file for 0); the
  // message is evaluate_text's.
  const fs::path text = scratch_dir() / "ctx_eval.txt";
  write_file(text, "in the beginning was the word\n");  // 30 bytes
  const std::string eval = "eval" + m + " --text " + quote(text.string());
  EXPECT_EQ(run_cli(eval + " --context 15").status, 0);
  const CliResult segments = run_cli(eval + " --context 16");
  EXPECT_EQ(segments.status, 2) << segments.all();
  EXPECT_EQ(segments.err,
            "rewind: error: evaluate_text: context 16 makes windows of 17 positions (1 before the text + "
            "16 bytes), past the model's max_position_embeddings (16); give a context of at most 15\n");
  const CliResult whole = run_cli(eval + " --context 0");
  EXPECT_EQ(whole.status, 2) << whole.all();
  EXPECT_NE(whole.err.find("context 0 makes windows of 31 positions (1 before the text + 30 bytes)"), std::string::npos)
      << whole.all();
  const CliResult long_save = run_cli("snapshot save" + m + " -p abcdefghijklmnop --out " + snap);
  EXPECT_EQ(long_save.status, 2) << long_save.all();
  EXPECT_EQ(long_save.err,
            "rewind: error: the prompt (17 tokens) is past the context of 16 (the model's "
            "max_position_embeddings, -c / --ctx-size); shorten the prompt\n");
  const CliResult over = run_cli("snapshot load" + m + " --file " + snap + " -n 13");
  EXPECT_EQ(over.status, 2) << over.all();
  EXPECT_NE(over.err.find("the snapshot's sequence (4 tokens) plus --max-new-tokens 13 needs 17 positions"),
            std::string::npos)
      << over.all();
}

}  // namespace
}  // namespace rwd::runtime
#endif
