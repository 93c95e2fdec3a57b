// tools/common.cc: the helpers tools/common.h declares.
#include "common.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <system_error>

#include "rewind/error.h"
#include "rewind/open_store.h"
#include "rewind/store.h"

namespace rwd::cli {

namespace fs = std::filesystem;

// ---- option values ---------------------------------------------------------------

CLI::Validator integer_in(std::int64_t lo, std::int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        std::int64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        const bool whole = end == s.data() + s.size();
        const bool too_large = ec == std::errc::result_out_of_range;  // an integer beyond int64: outside too
        if (s.empty() || !whole || (ec != std::errc() && !too_large)) return "'" + s + "' is not an integer";
        if (too_large || v < lo || v > hi) {
          return "'" + s + "' is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
        }
        return {};
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", "integer_in");
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        std::uint64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (!s.empty() && s[0] == '-') return "'" + s + "' is negative; a seed is an integer in [0, 2^64)";
        if (ec != std::errc() || end != s.data() + s.size() || s.empty()) {
          return "'" + s + "' is not an integer in [0, 2^64)";
        }
        return {};
      },
      "UINT64", "unsigned_integer");
}

CLI::Validator finite_number(double lo, double hi, bool lo_open, std::string range) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return "'" + s + "' is not a number";
        if (!std::isfinite(v) || !std::isfinite(static_cast<float>(v))) {
          return "'" + s + "' is not a finite number; it must be in " + range;
        }
        if (v < lo || v > hi || (lo_open && v == lo)) return "'" + s + "' is outside " + range;
        return {};
      },
      "FLOAT in " + range, "finite_number");
}

// ---- progress ----------------------------------------------------------------------

Progress::Progress(std::string what, std::string unit)
    : what_(std::move(what)), unit_(std::move(unit)), tty_(::isatty(2) == 1), start_(Clock::now()), last_(start_) {}

void Progress::update(std::int64_t done, std::int64_t total) {
  if (!tty_) return;
  const auto now = Clock::now();
  if (done < total && (now - last_ < std::chrono::milliseconds(200) || now - start_ < std::chrono::milliseconds(500))) {
    return;
  }
  last_ = now;
  shown_ = true;
  const double s = std::chrono::duration<double>(now - start_).count();
  const double frac = total > 0 ? std::min(1.0, static_cast<double>(done) / static_cast<double>(total)) : 1.0;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<std::size_t>(filled), '=');
  if (filled < kWidth) bar += '>' + std::string(static_cast<std::size_t>(kWidth - filled - 1), ' ');
  const double rate = s > 0 ? static_cast<double>(done) / s : 0.0;
  const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0.0;
  std::fprintf(stderr, "\r%s [%s] %3.0f%% %lld/%lld %s, %.0f/s, %.0f s, ETA %.0f s  ", what_.c_str(), bar.c_str(),
               100.0 * frac, static_cast<long long>(done), static_cast<long long>(total), unit_.c_str(), rate, s, eta);
  std::fflush(stderr);
}
// Ends the bar's line (when it was shown), so that later output starts on

void Progress::finish() {
  if (shown_) std::fprintf(stderr, "\n");
  shown_ = false;
}

// ---- files -------------------------------------------------------------------------

std::ifstream open_input_file(const std::string& flag, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw InvalidArgument(flag + " " + path + ": is a directory; give a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(flag + " " + path + ": cannot open it");
  return in;
}

// ---- prompts, draft and sampling choices -------------------------------------------

void PromptChoice::check_batch(const CLI::App& cmd) const {
  if (cmd.count("--max-batch") > 0 && !many(cmd)) {
    throw InvalidArgument("--max-batch applies to batched decoding: it needs --prompts FILE");
  }
}

PromptChoice::Lines::Lines(const std::string& path) : path_(path) {
  if (path_ != "-") file_ = open_input_file("--prompts", path_);
}

std::vector<std::string> PromptChoice::Lines::next(std::size_t n) {
  std::istream& in = path_ == "-" ? std::cin : file_;
  std::vector<std::string> lines;
  for (std::string line; lines.size() < n && std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
  }
  if (in.bad()) throw InvalidArgument("--prompts " + path_ + ": read error");
  read_ += lines.size();
  if (read_ == 0) {
    throw InvalidArgument("--prompts " + (path_ == "-" ? std::string("- (standard input)") : path_) +
                          " has no line; give one prompt per line");
  }
  return lines;
}

std::vector<std::string> PromptChoice::read_many() const {
  Lines lines(prompts);
  return lines.next(std::numeric_limits<std::size_t>::max());
}

std::string PromptChoice::read(const CLI::App& cmd) const {
  const bool has_text = cmd.count("--prompt") > 0, has_file = cmd.count("--prompt-file") > 0;
  if (!has_text && !has_file) {
    throw InvalidArgument("no prompt: give --prompt TEXT or --prompt-file FILE ('-' reads standard input)");
  }
  if (has_text) {
    if (text.empty()) throw InvalidArgument("--prompt is empty; give some text to continue");
    return text;
  }
  std::ostringstream buffer;
  if (file == "-") {
    buffer << std::cin.rdbuf();
  } else {
    std::ifstream in = open_input_file("--prompt-file", file);
    buffer << in.rdbuf();
    if (in.bad()) throw InvalidArgument("--prompt-file " + file + ": read error");
  }
  std::string prompt = buffer.str();
  if (prompt.empty()) {
    throw InvalidArgument("--prompt-file " + (file == "-" ? std::string("- (standard input)") : file) +
                          " is empty; give some text to continue");
  }
  return prompt;
}

void DraftChoice::check(const CLI::App& cmd) const {
  if (cmd.count("--tree-nodes") > 0 && !tree()) {
    throw InvalidArgument("--tree-nodes sizes tree speculation: it needs --tree W (W >= 2)");
  }
  if (tree()) {
    if (!any()) throw InvalidArgument("--tree needs a draft source: --draft DIR or --lookup N");
    if (adaptive) throw InvalidArgument("--adaptive adapts a chain's K; a tree's depth is --num-draft, fixed");
    check_tree_options(tree_options());
  }
  if (any()) return;
  for (const char* flag : {"--num-draft", "--adaptive"}) {
    if (cmd.count(flag) > 0) {
      throw InvalidArgument(std::string(flag) + " applies to speculative decoding: it needs a draft source, " +
                            "--draft DIR or --lookup N");
    }
  }
}

std::unique_ptr<PrefixCache> PrefixChoice::open(const CLI::App& cmd, const Model& model) const {
  if (cmd.count("--prefix-cache") == 0) {
    if (cmd.count("--prefix-interval") > 0 || cmd.count("--prefix-cache-bytes") > 0)
      throw InvalidArgument("--prefix-interval and --prefix-cache-bytes need --prefix-cache");
    return nullptr;
  }
  StoreSpecOptions spec_options;
  if (cmd.count("--prefix-cache-bytes") > 0) spec_options.capacity_bytes = static_cast<std::size_t>(bytes);
  std::shared_ptr<BlobStore> store = open_store_spec(spec, spec_options);
  if (!store) return nullptr;
  return std::make_unique<PrefixCache>(std::move(store), prefix_cache_options(model, interval));
}

std::string with_prefix_stats(std::string json, const PrefixCache* pc) {
  if (pc == nullptr || json.empty() || json.back() != '}') return json;
  const PrefixCacheStats& s = pc->stats();
  const auto ll = [](std::int64_t v) { return static_cast<long long>(v); };
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                ",\"prefix_cache\":{\"lookups\":%lld,\"hits\":%lld,\"misses\":%lld,"
                "\"hit_tokens\":%lld,\"entries_read\":%lld,\"entries_rejected\":%lld,\"rejected_unusable\":%lld,"
                "\"rejected_corrupt\":%lld,\"rejected_foreign\":%lld,\"entries_written\":%lld,"
                "\"writes_refused\":%lld,\"store_errors\":%lld,\"slow_calls\":%lld,\"calls_skipped\":%lld,"
                "\"lookups_over_budget\":%lld,\"store_seconds\":%.6f,\"bytes_read\":%llu,\"bytes_written\":%llu}}",
                ll(s.lookups), ll(s.hits), ll(s.lookups - s.hits), ll(s.hit_tokens), ll(s.entries_read),
                ll(s.entries_rejected), ll(s.entries_unusable), ll(s.entries_corrupt), ll(s.entries_foreign),
                ll(s.entries_written), ll(s.writes_refused), ll(s.store_errors), ll(s.slow_calls), ll(s.calls_skipped),
                ll(s.lookups_over_budget), s.store_seconds, static_cast<unsigned long long>(s.bytes_read),
                static_cast<unsigned long long>(s.bytes_written));
  json.pop_back();
  return json + buf;
}

SamplingParams SamplingChoice::resolve(const CLI::App& cmd) const {
  SamplingParams p = params;
  validate(p);
  if (p.greedy()) {
    for (const char* flag : {"--top-k", "--top-p", "--seed"}) {
      if (cmd.count(flag) > 0) {
        throw InvalidArgument(std::string(flag) + " applies to sampling only: it needs --temperature T with T > 0 " +
                              "(without it decoding is greedy)");
      }
    }
    return p;
  }
  if (cmd.count("--seed") == 0) p.seed = std::random_device{}();
  return p;
}

// ---- flags several subcommands declare ---------------------------------------------

void add_model_option(CLI::App* cmd, std::string& dir, const std::string& help) {
  cmd->add_option("-m,--model", dir, help)->required()->check(CLI::ExistingDirectory);
}

void add_max_new_option(CLI::App* cmd, std::int64_t& max_new) {
  cmd->add_option("-n,--max-new-tokens", max_new, "token budget")->check(integer_in(0, std::int64_t{1} << 30));
}

void add_prompt_options(CLI::App* cmd, PromptChoice& prompt) {
  auto* text = cmd->add_option("-p,--prompt", prompt.text, "prompt text (or --prompt-file)");
  auto* file = cmd->add_option("--prompt-file", prompt.file,
                               "read the prompt from FILE ('-' = standard input), for prompts too long for "
                               "the command line (Linux caps one argument at 128 KiB)")
                   ->type_name("FILE");
  text->excludes(file);
  cmd->add_option("--max-prefill-rows", prompt.max_prefill_rows,
                  "prompt tokens one forward feeds at most (all joining prompts together; the target's and a "
                  "--draft model's forwards alike); longer prompts go in several forwards, with the same output, "
                  "so that a forward's memory stays bounded")
      ->check(integer_in(1, std::int64_t{1} << 24))
      ->capture_default_str();
}

void add_draft_options(CLI::App* cmd, DraftChoice& choice) {
  auto* d = cmd->add_option("--draft", choice.draft_dir, "draft model directory")
                ->check(CLI::ExistingDirectory)
                ->default_str("none");
  auto* l = cmd->add_option("--lookup", choice.lookup, "prompt lookup with n-grams up to N")
                ->check(integer_in(1, 64))
                ->default_str("off");
  d->excludes(l);
  cmd->add_option("--num-draft", choice.num_draft, "draft tokens per round K; needs --draft or --lookup")
      ->check(integer_in(1, 64));
  cmd->add_flag("--adaptive", choice.adaptive,
                "adapt K from the acceptance (K is the maximum); needs --draft or --lookup");
  cmd->add_option("--tree", choice.tree_width,
                  "tree speculation: W children per node (W >= 2), depth --num-draft; the draft model grows a beam "
                  "of W nodes per level, prompt lookup merges several earlier matches; one forward verifies every "
                  "node. Needs --draft or --lookup")
      ->check(integer_in(2, 64))
      ->default_str("off");
  cmd->add_option("--tree-nodes", choice.tree_nodes, "with --tree: at most N nodes per round (the root included)")
      ->check(integer_in(2, 1024));
}

void add_threads_option(CLI::App* cmd, std::optional<int>& threads) {
  cmd->add_option("-t,--threads", threads,
                  "OpenMP threads; default 1, or OMP_NUM_THREADS when set. More threads help only models "
                  "too big for the caches, or long prompts, on an idle machine: on a busy one they can make "
                  "decoding many times slower")
      ->check(integer_in(1, 1024))
      ->default_str("1 or $OMP_NUM_THREADS");
}

void add_weights_option(CLI::App* cmd, SharedFlags& shared) {
  cmd->add_option("--weights", shared.weights,
                  "how the linear weights are held: as-stored (the checkpoint's dtype, exact) or q8 (int8 "
                  "blocks of 32 with a bf16 scale each, quantized at load: about half of bf16's bytes; "
                  "docs/quantization.md). A checkpoint written by `rewind quantize` loads as q8 without the flag "
                  "and refuses as-stored")
      ->check(CLI::IsMember({"as-stored", "q8"}))
      ->default_str("as the checkpoint holds them");
  cmd->add_flag("--no-pack", shared.no_pack,
                "load the weights from the checkpoint even when a current pack file of them is in the model "
                "directory (rewind pack: mapped in place instead of packed at load)");
}

void add_ctx_option(CLI::App* cmd, std::optional<std::int64_t>& ctx_size) {
  cmd->add_option("-c,--ctx-size", ctx_size,
                  "the most positions a run may use (prompt tokens + --max-new-tokens): a run past it is refused "
                  "before any work; at most the model's max_position_embeddings (no limit when its config names "
                  "none)")
      ->check(integer_in(1, std::int64_t{1} << 40))
      ->default_str("max_position_embeddings");
}

void add_prompts_option(CLI::App* cmd, PromptChoice& prompt, const char* what) {
  cmd->add_option("--prompts", prompt.prompts, what)
      ->type_name("FILE")
      ->excludes("--prompt")
      ->excludes("--prompt-file");
  cmd->add_option("--max-batch", prompt.max_batch,
                  "with --prompts: at most N sequences decode at once; the others join, in order, as "
                  "sequences finish. Default: as many as a quarter of the available memory holds (each with "
                  "the state of --max-prefill-rows + --max-new-tokens tokens, a draft model's included), at "
                  "most 64; --stats reports it as max_batch. 0: every prompt at once (generate then reads the "
                  "whole file before it prints)")
      ->check(integer_in(0, std::int64_t{1} << 24))
      ->default_str("64 or what memory holds");
}

void add_sampling_options(CLI::App* cmd, SamplingChoice& sampling) {
  cmd->add_option("--temperature", sampling.params.temperature, "sampling temperature; 0 = greedy decoding")
      ->check(finite_number(0.0, 1e30, false, "[0, 1e30]"));
  cmd->add_option("--top-k", sampling.params.top_k, "sample among the K likeliest (0 = off); needs --temperature")
      ->check(integer_in(0, std::numeric_limits<std::int32_t>::max()));
  cmd->add_option("--top-p", sampling.params.top_p, "nucleus mass (1 = off); needs --temperature")
      ->check(finite_number(0.0, 1.0, true, "(0, 1]"));
  cmd->add_option("-s,--seed", sampling.params.seed,
                  "sampling seed; needs --temperature; default: a random seed, printed by --stats")
      ->check(unsigned_integer())
      ->default_str("random");
}

// ---- threads and context -----------------------------------------------------------

// The OpenMP thread count: --threads N, else OMP_NUM_THREADS when the user
// set it, else one thread. OpenMP's own default, one thread per core, is the
// wrong default here: a forward of the shipped models (2.6M and 0.35M
// parameters) takes about 0.2 ms and runs dozens of small parallel kernels,
// each ending in a barrier. When another process holds a core, each barrier
// waits for a descheduled thread (time slices are milliseconds). On a busy
// 2-core machine two threads ran speculative decoding at a third of greedy's
// speed (322 vs 955 tok/s) where one thread ran it at twice greedy's, and in
// another run greedy decoding fell to 26 tok/s against 4,103 with one
// thread. One thread waits for nobody. Larger models, whose weights stream
// from main memory, and the prefill of long prompts gain from more threads
// on an idle machine: the user asks for them with --threads or
// OMP_NUM_THREADS.
namespace {
LoadOptions chosen_load_options;
}  // namespace

void set_load_options(const std::optional<std::string>& weights, bool no_pack) {
  chosen_load_options.weights.reset();
  if (weights) chosen_load_options.weights = weight_format_from_name(*weights, "--weights");
  chosen_load_options.pack = no_pack ? LoadOptions::Pack::kNever : LoadOptions::Pack::kIfCurrent;
}

LoadOptions load_options() { return chosen_load_options; }

Model load_model(const std::string& dir) { return loaded_model(dir, chosen_load_options); }

Model loaded_model(const std::string& dir, const LoadOptions& options) {
  Model m = Model::load(dir, options);
  // A stale pack costs the load time it was written to save: say so.
  if (!m.pack_note().empty()) std::fprintf(stderr, "rewind: note: %s\n", m.pack_note().c_str());
  return m;
}

void set_threads(const std::optional<int>& threads) {
  if (threads) {
    omp_set_num_threads(*threads);
    return;
  }
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env != nullptr && *env != '\0') return;  // OpenMP read it at start-up
  omp_set_num_threads(1);
}

// The most positions a run may use: --ctx-size N, else the model's
// max_position_embeddings (0: no limit, for a config that names none). A
// --ctx-size past max_position_embeddings is refused: the model was not
// built for those positions, and its output there means nothing.
std::int64_t resolve_ctx_size(const std::optional<std::int64_t>& ctx_size, const Model& model) {
  const std::int64_t trained = model.config().max_position_embeddings;
  if (!ctx_size) return trained;
  if (trained > 0 && *ctx_size > trained) {
    throw InvalidArgument("--ctx-size " + std::to_string(*ctx_size) + " is past the model's max_position_embeddings (" +
                          std::to_string(trained) + "); give at most " + std::to_string(trained));
  }
  return *ctx_size;
}

// Refuses, before any work, `what` of `prompt_tokens` tokens (BOS included)
// whose run of `max_new` new tokens would go past `ctx` positions (0: no
// limit).
void check_context(std::int64_t prompt_tokens, std::int64_t max_new, std::int64_t ctx, bool ctx_from_flag,
                   const std::string& what) {
  if (ctx <= 0 || prompt_tokens + max_new <= ctx) return;
  const std::string context = std::to_string(ctx) + (ctx_from_flag
                                                         ? " (-c / --ctx-size)"
                                                         : " (the model's max_position_embeddings, -c / --ctx-size)");
  if (max_new == 0) {  // snapshot save
    throw InvalidArgument(what + " (" + std::to_string(prompt_tokens) + " tokens) is past the context of " + context +
                          "; shorten the prompt");
  }
  throw InvalidArgument(what + " (" + std::to_string(prompt_tokens) + " tokens) plus --max-new-tokens " +
                        std::to_string(max_new) + " needs " + std::to_string(prompt_tokens + max_new) +
                        " positions, past the context of " + context +
                        "; shorten the prompt or lower -n / --max-new-tokens");
}

// ---- tokenizers, drafts, batches ---------------------------------------------------

Tokenizer load_tokenizer(const std::string& dir, const Model& model) {
  return tokenizer_for_model(dir, model.config());
}

std::vector<std::int32_t> encode_for_generation(const Tokenizer& tokenizer, const std::string& text,
                                                const std::string& what) {
  std::vector<std::int32_t> ids;
  try {
    ids = tokenizer.encode(text, true);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(what + ": " + e.what());
  }
  if (ids.empty()) {
    throw InvalidArgument(what + " encodes to no token (this tokenizer adds no BOS); give some text to continue");
  }
  return ids;
}

std::vector<std::vector<std::int32_t>> encode_prompts(const PromptChoice& prompt_choice, const Tokenizer& tokenizer) {
  std::vector<std::vector<std::int32_t>> prompts;
  for (const auto& line : prompt_choice.read_many()) {
    prompts.push_back(encode_for_generation(tokenizer, line, "--prompts line " + std::to_string(prompts.size() + 1)));
  }
  return prompts;
}

void StdoutStream::write(const std::string& bytes) {
  if (bytes.empty()) return;
  std::fwrite(bytes.data(), 1, bytes.size(), stdout);
  std::fflush(stdout);
}

std::optional<Model> load_draft(const DraftChoice& choice, const Model& target, const Tokenizer& target_tokenizer) {
  if (choice.draft_dir.empty()) return std::nullopt;
  // A Q8 target gets a Q8 draft (quantized at load, or a Q8 checkpoint's);
  // otherwise the draft loads as its checkpoint holds it (as stored, or a
  // Q8 checkpoint's Q8: the draft only proposes).
  LoadOptions options;
  if (target.weight_format() == WeightFormat::kQ8) options.weights = WeightFormat::kQ8;
  options.pack = chosen_load_options.pack;  // --no-pack holds for the draft too
  Model draft = loaded_model(choice.draft_dir, options);
  const ModelConfig& t = target.config();
  const ModelConfig& d = draft.config();
  // A draft proposes token ids the target scores: the vocabularies must be
  // the same ids (size, BOS and its use, every EOS).
  auto ids = [](const std::vector<std::int64_t>& v) {
    std::string s;
    for (std::int64_t id : v) s += (s.empty() ? "" : ",") + std::to_string(id);
    return "[" + s + "]";
  };
  auto describe = [&](const ModelConfig& c) {
    return std::to_string(c.vocab_size) + " (BOS " + std::to_string(c.bos_token_id) + (c.add_bos ? "" : " not added") +
           ", EOS " + ids(c.eos_token_ids) + ")";
  };
  if (d.vocab_size != t.vocab_size || d.bos_token_id != t.bos_token_id || d.add_bos != t.add_bos ||
      d.eos_token_ids != t.eos_token_ids) {
    throw InvalidArgument("draft model " + choice.draft_dir + " is incompatible with the target: vocabulary " +
                          describe(d) + " vs " + describe(t));
  }
  // The draft proposes ids that the target verifies: the same id must be
  // the same text for both.
  const Tokenizer draft_tokenizer = load_tokenizer(choice.draft_dir, draft);
  std::string why;
  if (!target_tokenizer.compatible_with(draft_tokenizer, &why)) {
    throw InvalidArgument(
        "draft model " + choice.draft_dir +
        " is incompatible with the target: the tokenizers' vocabularies differ (target first): " + why);
  }
  return draft;
}

OnePrompt::OnePrompt(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                     const DraftChoice& choice, std::int64_t max_new, const std::optional<std::int64_t>& ctx_size)
    : prompt(prompt_choice.read(cmd)), model(load_model(model_dir)), tokenizer(load_tokenizer(model_dir, model)),
      draft(load_draft(choice, model, tokenizer)), tokens(encode_for_generation(tokenizer, prompt, "the prompt")) {
  check_context(static_cast<std::int64_t>(tokens.size()), max_new, resolve_ctx_size(ctx_size, model),
                ctx_size.has_value(), "the prompt");
}

std::unique_ptr<DraftSource> make_source(const DraftChoice& choice, const std::optional<Model>& draft,
                                         const SamplingParams& sampling, std::int64_t max_prefill_rows) {
  if (draft) return std::make_unique<ModelDraft>(*draft, sampling, choice.num_draft, max_prefill_rows);
  return std::make_unique<LookupDraft>(choice.lookup);
}

std::unique_ptr<TreeDraftSource> make_tree_source(const DraftChoice& choice, const std::optional<Model>& draft,
                                                  std::int64_t max_prefill_rows) {
  if (draft) return std::make_unique<ModelTreeDraft>(*draft, max_prefill_rows);
  return std::make_unique<LookupTreeDraft>(choice.lookup);
}

std::unique_ptr<BatchDraftSource> make_sources(std::size_t n, const DraftChoice& choice,
                                               const std::optional<Model>& draft, const SamplingParams& sampling,
                                               std::int64_t max_prefill_rows) {
  if (draft) return std::make_unique<BatchedModelDraft>(*draft, sampling, choice.num_draft, max_prefill_rows);
  std::vector<std::unique_ptr<DraftSource>> sources;
  for (std::size_t i = 0; i < n; ++i) sources.push_back(make_source(choice, draft, sampling, max_prefill_rows));
  return std::make_unique<PerSequenceDrafts>(std::move(sources));
}

namespace {

// The most sequences --prompts decodes at once without --max-batch.
constexpr std::int64_t kMaxDefaultBatch = 64;

// The bytes of memory available now (MemAvailable in /proc/meminfo); 0 when unknown.
std::uint64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::uint64_t kib = 0;
    std::istringstream(line.substr(13)) >> kib;
    return kib * 1024;
  }
  return 0;
}

}  // namespace

std::int64_t resolve_max_batch(const CLI::App& cmd, const PromptChoice& prompt_choice, const Model& model,
                               const Model* draft, std::int64_t max_new, std::int64_t rollback) {
  if (cmd.count("--max-batch") > 0) return prompt_choice.max_batch;
  const auto context = static_cast<std::size_t>(prompt_choice.max_prefill_rows + max_new);
  auto per_sequence = [&](const Model& m) {
    return m.fixed_state_bytes() + m.kv_bytes_per_token() * context + (rollback > 0 ? m.rollback_bytes(rollback) : 0) +
           static_cast<std::size_t>(m.vocab_size()) * sizeof(float) * static_cast<std::size_t>(rollback + 1);
  };
  const std::size_t each = per_sequence(model) + (draft ? per_sequence(*draft) : 0);
  const std::uint64_t available = available_memory_bytes();
  if (available == 0 || each == 0) return kMaxDefaultBatch;
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(available / 4 / each), 1, kMaxDefaultBatch);
}

std::string acceptance_by_position(const GenerationStats& stats) {
  if (stats.drafted_at.empty()) return "";
  std::string out = "; accepted by position";
  char buf[32];
  for (std::size_t i = 0; i < stats.drafted_at.size(); ++i) {
    std::snprintf(buf, sizeof buf, " %.3f", stats.acceptance_at(i));
    out += buf;
  }
  return out;
}

}  // namespace rwd::cli
