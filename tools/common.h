// tools/common.h: what the rewind CLI's subcommands share.
//
// Every subcommand lives in a file of its own (tools/generate.cc,
// tools/eval.cc, ...) and exposes one registration function,
//
//   Command add_NAME_command(CLI::App& app, SharedFlags& shared);
//
// which adds the subcommand and its flags to `app` (flags bound to state the
// returned Command owns) and returns the function that runs it. main.cc
// calls each in the order `rewind --help` lists them and runs the one the
// command line chose. A new subcommand is one new file, its declaration and
// its place in main.cc's list, and the file in tools/CMakeLists.txt.
//
// A subcommand's run function returns the exit status (0 success, 1 a
// divergence found, 2 bad input) and reports bad input by throwing an
// rwd::Error, which main prints as "rewind: error: ..." with status 2.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "rewind/prefix_cache.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"

namespace rwd::cli {

using namespace rwd::runtime;
using Clock = std::chrono::steady_clock;

// ---- registration ------------------------------------------------------------------

// A registered subcommand: the CLI11 subcommand and what runs it once the
// command line parsed and chose it.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// Flags main acts on for every subcommand before running it.
struct SharedFlags {
  std::optional<int> threads;          // -t / --threads (set_threads)
  std::optional<std::string> weights;  // --weights FORMAT (set_load_options); unset: as the checkpoint holds them
  bool no_pack = false;                // --no-pack: never map a pack file (LoadOptions::Pack::kNever)
};

// ---- option values -----------------------------------------------------------------

// Validators that say what is wrong with a value: not a number at all, or a
// number outside the allowed range (CLI11's Range says "not in range" for
// both). CLI11 prefixes the option's name.
// An integer in [lo, hi].
CLI::Validator integer_in(std::int64_t lo, std::int64_t hi);
// A seed: any integer in [0, 2^64).
CLI::Validator unsigned_integer();
// A finite number in [lo, hi] (lo_open: lo itself excluded), `range` its
// text in messages. Refuses "inf", "nan" and numbers that overflow to
// infinity as a float.
CLI::Validator finite_number(double lo, double hi, bool lo_open, std::string range);

// ---- progress ----------------------------------------------------------------------

// A progress bar on stderr, drawn only when stderr is a terminal (a log file
// or a pipe gets no carriage-return frames), redrawn at most 5 times a
// second and only once the work has taken half a second; ended by a newline.
class Progress {
 public:
  Progress(std::string what, std::string unit);
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  // Redraws the bar for `done` of `total` units (when due).
  void update(std::int64_t done, std::int64_t total);
  // Ends the bar's line (when it was shown), so that later output starts on
  // a line of its own.
  void finish();
  ~Progress() { finish(); }

 private:
  std::string what_, unit_;
  bool tty_;
  Clock::time_point start_, last_;
  bool shown_ = false;
};

// ---- files -------------------------------------------------------------------------

// Opens `path` (given as `flag`) for reading in binary mode. Throws
// InvalidArgument naming the flag and path when it is a directory (which
// opens, then fails on the first read) or cannot be opened.
std::ifstream open_input_file(const std::string& flag, const std::string& path);

// ---- prompts, draft and sampling choices -------------------------------------------
// Shared by subcommands; `cmd` is the one that ran, whose options tell which
// flags were given.

struct PromptChoice {
  std::string text;
  std::string file;                                        // "-": standard input
  std::string prompts;                                     // --prompts FILE: one prompt per line ("-": standard input)
  std::int64_t max_batch = 0;                              // --max-batch N: sequences decoding at once (0: all)
  std::int64_t max_prefill_rows = kDefaultMaxPrefillRows;  // --max-prefill-rows N

  // Refuses --max-batch without --prompts (it shapes batched decoding only).
  void check_batch(const CLI::App& cmd) const;
  // Whether --prompts was given.
  bool many(const CLI::App& cmd) const { return cmd.count("--prompts") > 0; }

  // The lines of --prompts FILE, one prompt each, read a few at a time (an
  // empty line is a prompt of BOS alone, refused when the tokenizer adds no
  // BOS; a final newline ends the last line, it adds none).
  class Lines {
   public:
    explicit Lines(const std::string& path);
    // Up to `n` more lines (fewer at the end of the input; none after it).
    // Throws InvalidArgument when the input holds no line at all.
    std::vector<std::string> next(std::size_t n);
    std::size_t read() const { return read_; }  // lines returned so far

   private:
    std::string path_;
    std::ifstream file_;
    std::size_t read_ = 0;
  };

  // Every line of --prompts FILE.
  std::vector<std::string> read_many() const;
  // The prompt text: --prompt TEXT or the bytes of --prompt-file FILE (a
  // long prompt does not fit in argv: Linux caps one argument at 128 KiB).
  // Throws InvalidArgument for no prompt or an empty one.
  std::string read(const CLI::App& cmd) const;
};

struct DraftChoice {
  std::string draft_dir;
  std::int64_t lookup = 0;
  std::int64_t num_draft = 4;
  bool adaptive = false;
  std::int64_t tree_width = 0;   // --tree W: W >= 2 turns tree speculation on
  std::int64_t tree_nodes = 16;  // --tree-nodes N
  bool any() const { return !draft_dir.empty() || lookup > 0; }
  bool tree() const { return tree_width >= 2; }
  // `options` with the speculation (or tree) these flags choose.
  GenerationOptions applied_to(GenerationOptions options) const {
    options.speculation = {num_draft, adaptive};
    if (tree()) options.tree = tree_options();
    return options;
  }
  TreeOptions tree_options() const { return {tree_width, tree_nodes, num_draft}; }

  // Refuses --num-draft, --adaptive and the tree flags where they would be
  // ignored (no draft source) or contradict each other.
  void check(const CLI::App& cmd) const;
};

// --prefix-cache SPEC: a directory, ro:DIR (read, never written), or
// redis://HOST:PORT[/PREFIX].
struct PrefixChoice {
  std::string spec;
  std::int64_t interval = 256;
  std::int64_t bytes = 0;  // cap of a directory store (0: none)

  // The prefix cache for `model`, or null without --prefix-cache. A store
  // that cannot be reached now is a warning and no prefix cache: generation
  // recomputes (the output does not depend on the cache). Throws
  // InvalidArgument for a malformed SPEC or flags it makes meaningless.
  std::unique_ptr<PrefixCache> open(const CLI::App& cmd, const Model& model) const;
};

// `json` (one object) with "prefix_cache": the counters of `pc` (--stats),
// unchanged without a prefix cache.
std::string with_prefix_stats(std::string json, const PrefixCache* pc);

struct SamplingChoice {
  SamplingParams params;

  // Refuses sampling flags without sampling, and draws a seed when sampling
  // without --seed (std::random_device: a fresh seed per run, reported by
  // --stats so the run can be repeated with --seed N). 32 bits, so that any
  // JSON reader (many parse numbers as doubles) gets it exactly.
  SamplingParams resolve(const CLI::App& cmd) const;
};

// ---- flags several subcommands declare ---------------------------------------------

// -m / --model DIR (required, an existing directory).
void add_model_option(CLI::App* cmd, std::string& dir, const std::string& help = "model directory");
// -n / --max-new-tokens N in [0, 2^30].
void add_max_new_option(CLI::App* cmd, std::int64_t& max_new);
// -p / --prompt, --prompt-file, --max-prefill-rows.
void add_prompt_options(CLI::App* cmd, PromptChoice& prompt);
// --prompts FILE (`what` its help) and --max-batch.
void add_prompts_option(CLI::App* cmd, PromptChoice& prompt, const char* what);
// --draft, --lookup, --num-draft, --adaptive, --tree, --tree-nodes.
void add_draft_options(CLI::App* cmd, DraftChoice& choice);
// -t / --threads.
void add_threads_option(CLI::App* cmd, std::optional<int>& threads);
// --weights as-stored|q8: how the loaded models hold their linear weights;
// --no-pack: load them from the checkpoint even when a pack file is there.
void add_weights_option(CLI::App* cmd, SharedFlags& shared);
// -c / --ctx-size.
void add_ctx_option(CLI::App* cmd, std::optional<std::int64_t>& ctx_size);
// --temperature, --top-k, --top-p, -s / --seed.
void add_sampling_options(CLI::App* cmd, SamplingChoice& sampling);

// ---- threads, weights and context --------------------------------------------------

// Makes load_model use the --weights format in `weights` ("as-stored" or
// "q8", as add_weights_option allows; unset: as the checkpoint holds its
// weights). Throws InvalidArgument otherwise.
// With no_pack, models never map a pack file (rewind pack).
void set_load_options(const std::optional<std::string>& weights, bool no_pack);
// The options set_load_options chose (default: as the checkpoint holds them).
LoadOptions load_options();
// Model::load(dir, load_options()): the model a subcommand runs.
Model load_model(const std::string& dir);
// Model::load(dir, options), printing its pack_note() (a pack file found and
// not used) to stderr as "rewind: note: ...".
Model loaded_model(const std::string& dir, const LoadOptions& options);

// The OpenMP thread count: --threads N, else OMP_NUM_THREADS when the user
// set it, else one thread (common.cc says why).
void set_threads(const std::optional<int>& threads);

// The most positions a run may use: --ctx-size N, else the model's
// max_position_embeddings (0: no limit, for a config that names none).
// Throws InvalidArgument for a --ctx-size past max_position_embeddings.
std::int64_t resolve_ctx_size(const std::optional<std::int64_t>& ctx_size, const Model& model);

// Refuses (InvalidArgument), before any work, `what` of `prompt_tokens`
// tokens (BOS included) whose run of `max_new` new tokens would go past
// `ctx` positions (0: no limit); ctx_from_flag: ctx came from --ctx-size.
void check_context(std::int64_t prompt_tokens, std::int64_t max_new, std::int64_t ctx, bool ctx_from_flag,
                   const std::string& what);

// ---- tokenizers, drafts, batches ---------------------------------------------------

// The tokenizer of model directory `dir` (runtime/tokenizer.h).
Tokenizer load_tokenizer(const std::string& dir, const Model& model);

// `text` (named `what` in messages) encoded for generation: the
// tokenizer's BOS / template tokens, then the text's tokens. Throws
// InvalidArgument naming `what` for text that encodes to nothing.
std::vector<std::int32_t> encode_for_generation(const Tokenizer& tokenizer, const std::string& text,
                                                const std::string& what);

// The prompts of --prompts (every line), encoded.
std::vector<std::vector<std::int32_t>> encode_prompts(const PromptChoice& prompt_choice, const Tokenizer& tokenizer);

// Streams generated tokens to stdout as complete UTF-8 (a byte-level model's
// bytes as they come); finish() writes what is held back.
class StdoutStream {
 public:
  explicit StdoutStream(const Tokenizer& tokenizer) : decoder_(tokenizer) {}
  void push(std::int32_t id) { write(decoder_.push(id)); }
  void finish() { write(decoder_.finish()); }

 private:
  static void write(const std::string& bytes);
  StreamDecoder decoder_;
};

// The --draft model, checked against the target (same vocabulary ids and
// tokenizer; InvalidArgument otherwise), its weights held as the target's
// (Model::weight_format); empty without --draft.
std::optional<Model> load_draft(const DraftChoice& choice, const Model& target, const Tokenizer& target_tokenizer);

// What generate and verify decode one prompt (--prompt / --prompt-file)
// with, loaded in the order they report bad input in: the prompt, the model,
// its tokenizer, the --draft model, then the prompt's tokens, refused
// (check_context) when they and max_new new tokens would not fit.
struct OnePrompt {
  OnePrompt(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
            const DraftChoice& choice, std::int64_t max_new, const std::optional<std::int64_t>& ctx_size);
  const std::string prompt;
  const Model model;
  const Tokenizer tokenizer;
  const std::optional<Model> draft;
  const std::vector<std::int32_t> tokens;
};

// The chain draft source: the draft model, else prompt lookup.
std::unique_ptr<DraftSource> make_source(const DraftChoice& choice, const std::optional<Model>& draft,
                                         const SamplingParams& sampling, std::int64_t max_prefill_rows);
// The tree draft source: the draft model, else prompt lookup.
std::unique_ptr<TreeDraftSource> make_tree_source(const DraftChoice& choice, const std::optional<Model>& draft,
                                                  std::int64_t max_prefill_rows);
// The drafts of a batch of n prompts: a draft model runs every sequence's
// draft steps in one batched forward; prompt lookup looks in each sequence.
std::unique_ptr<BatchDraftSource> make_sources(std::size_t n, const DraftChoice& choice,
                                               const std::optional<Model>& draft, const SamplingParams& sampling,
                                               std::int64_t max_prefill_rows);

// --max-batch without the flag: as many sequences as a quarter of the
// available memory holds, each with the state of a prompt of
// --max-prefill-rows tokens plus --max-new-tokens (KV rows, fixed states,
// a round's rollback record and logits; of the draft model too), between
// 1 and 64; 64 when the available memory is unknown. With the flag: its
// value (0: every prompt at once).
std::int64_t resolve_max_batch(const CLI::App& cmd, const PromptChoice& prompt_choice, const Model& model,
                               const Model* draft, std::int64_t max_new, std::int64_t rollback);

// "; accepted by position 0.930 0.840 ...": stats.acceptance_at(i) for each
// draft position of a round; empty when nothing was counted per position
// (tree speculation).
std::string acceptance_by_position(const GenerationStats& stats);

// ---- usage errors ------------------------------------------------------------------

// After a parse error: a message naming the unknown subcommand or flag in
// argv, with the nearest known one, or "" when argv holds none (CLI11's own
// message is printed then).
std::string diagnose_usage(const CLI::App& app, int argc, char** argv);

}  // namespace rwd::cli
