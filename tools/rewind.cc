// rewind: the command-line front end of the reference runtime.
//
//   rewind generate    stream text, greedy / sampled / speculative
//   rewind verify      compare speculative with greedy decoding token by token
//   rewind eval        bits per byte of a text file (teacher forcing, chunked)
//   rewind inspect     layers, parameters and memory of a model
//   rewind bench       tokens/s of greedy and speculative decoding
//   rewind forward-cost the cost of a q-token forward in one-token forwards
//   rewind init-random write a model with random weights
//
// Short flags as llama.cpp's llama-cli spells them: -m --model, -p --prompt,
// -n --max-new-tokens, -t --threads, -s --seed, -c --ctx-size; --version.
//
// Exit status: 0 success, 1 verify or bench found a divergence, 2 bad input
// (unknown flag or subcommand, with the nearest known one; missing or
// malformed model, bad value, a flag that would have no effect, a run past
// the context length).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <system_error>

#include <CLI/CLI.hpp>

#include "rewind/error.h"
#include "rewind/prefix_cache.h"
#if REWIND_HAVE_REDIS
#include "rewind/redis_store.h"
#endif
#include "rewind/snapshot.h"
#include "rewind/store.h"
#include "runtime/decode_bench.h"
#include "runtime/eval.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/model_config.h"
#include "runtime/tokenizer.h"
#include "runtime/weights_io.h"

// CMake's project() version (tools/CMakeLists.txt passes it in);
// Cli.VersionPrintsTheProjectVersion checks it against CMakeLists.txt.
#ifndef REWIND_VERSION
#error "REWIND_VERSION must be defined by the build (tools/CMakeLists.txt)"
#endif

namespace {

using namespace rwd;
using namespace rwd::runtime;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// ---- option values ---------------------------------------------------------------

// Validators that say what is wrong with a value: not a number at all, or a
// number outside the allowed range (CLI11's Range says "not in range" for
// both). CLI11 prefixes the option's name.
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

// A seed: any integer in [0, 2^64).
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

// A finite number in [lo, hi] (lo_open: lo itself excluded). Refuses "inf",
// "nan" and numbers that overflow to infinity as a float.
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

// A progress bar on stderr, drawn only when stderr is a terminal (a log file
// or a pipe gets no carriage-return frames), redrawn at most 5 times a
// second and only once the work has taken half a second; ended by a newline.
class Progress {
 public:
  Progress(std::string what, std::string unit)
      : what_(std::move(what)), unit_(std::move(unit)), tty_(::isatty(2) == 1), start_(Clock::now()), last_(start_) {}
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void update(std::int64_t done, std::int64_t total) {
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
  // a line of its own.
  void finish() {
    if (shown_) std::fprintf(stderr, "\n");
    shown_ = false;
  }
  ~Progress() { finish(); }

 private:
  std::string what_, unit_;
  bool tty_;
  Clock::time_point start_, last_;
  bool shown_ = false;
};

// ---- prompts, draft and sampling choices ------------------------------------------------

// Opens `path` (given as `flag`) for reading in binary mode. Throws
// InvalidArgument naming the flag and path when it is a directory (which
// opens, then fails on the first read) or cannot be opened.
std::ifstream open_input_file(const std::string& flag, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw InvalidArgument(flag + " " + path + ": is a directory; give a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(flag + " " + path + ": cannot open it");
  return in;
}

// The choices below are shared by subcommands; `cmd` is the one that ran,
// whose options tell which flags were given.
struct PromptChoice {
  std::string text;
  std::string file;     // "-": standard input
  std::string prompts;  // --prompts FILE: one prompt per line ("-": standard input)
  std::int64_t max_batch = 0;  // --max-batch N: sequences decoding at once (0: all)
  std::int64_t max_prefill_rows = rwd::runtime::kDefaultMaxPrefillRows;  // --max-prefill-rows N

  // --max-batch shapes batched decoding; without --prompts it would be ignored.
  void check_batch(const CLI::App& cmd) const {
    if (cmd.count("--max-batch") > 0 && !many(cmd)) {
      throw InvalidArgument("--max-batch applies to batched decoding: it needs --prompts FILE");
    }
  }

  bool many(const CLI::App& cmd) const { return cmd.count("--prompts") > 0; }

  // The lines of --prompts FILE, one prompt each, read a few at a time (an
  // empty line is a prompt of BOS alone, refused when the tokenizer adds no
  // BOS; a final newline ends the last line, it adds none).
  class Lines {
   public:
    explicit Lines(const std::string& path) : path_(path) {
      if (path_ != "-") file_ = open_input_file("--prompts", path_);
    }
    // Up to `n` more lines (fewer at the end of the input; none after it).
    // Throws InvalidArgument when the input holds no line at all.
    std::vector<std::string> next(std::size_t n) {
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
    std::size_t read() const { return read_; }  // lines returned so far

   private:
    std::string path_;
    std::ifstream file_;
    std::size_t read_ = 0;
  };

  // Every line of --prompts FILE.
  std::vector<std::string> read_many() const {
    Lines lines(prompts);
    return lines.next(std::numeric_limits<std::size_t>::max());
  }

  // The prompt text: --prompt TEXT or the bytes of --prompt-file FILE (a
  // long prompt does not fit in argv: Linux caps one argument at 128 KiB).
  std::string read(const CLI::App& cmd) const {
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
  TreeOptions tree_options() const { return {tree_width, tree_nodes, num_draft}; }

  // --num-draft, --adaptive and the tree flags shape speculative decoding;
  // without a draft source they would be ignored.
  void check(const CLI::App& cmd) const {
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
};

// --prefix-cache SPEC: a directory, ro:DIR (read, never written), or
// redis://HOST:PORT[/PREFIX].
struct PrefixChoice {
  std::string spec;
  std::int64_t interval = 256;
  std::int64_t bytes = 0;  // cap of a directory store (0: none)

  // The prefix cache for `model`, or null without --prefix-cache. A store
  // that cannot be reached now is a warning and no prefix cache: generation
  // recomputes (the output does not depend on the cache).
  std::unique_ptr<PrefixCache> open(const CLI::App& cmd, const Model& model) const {
    if (cmd.count("--prefix-cache") == 0) {
      if (cmd.count("--prefix-interval") > 0 || cmd.count("--prefix-cache-bytes") > 0)
        throw InvalidArgument("--prefix-interval and --prefix-cache-bytes need --prefix-cache");
      return nullptr;
    }
    const std::string accepted =
        "accepted: a directory path, ro:DIR (a directory read but never written) or redis://HOST:PORT[/PREFIX]";
    const bool read_only = spec.rfind("ro:", 0) == 0;
    const std::string path = read_only ? spec.substr(3) : spec;
    const bool redis = !read_only && spec.rfind("redis://", 0) == 0;
    if (read_only && path.empty()) throw InvalidArgument("--prefix-cache 'ro:' names no directory; " + accepted);
    if (!redis) {
      // "rediss://h", "REDIS://h", "file:///x", "redis:/x": a URL of a kind
      // this build does not speak must not become a local directory.
      std::size_t n = 0;
      while (n < path.size() && (std::isalnum(static_cast<unsigned char>(path[n])) != 0 ||
                                 (n > 0 && (path[n] == '+' || path[n] == '.' || path[n] == '-')))) {
        ++n;
      }
      if (n > 0 && std::isalpha(static_cast<unsigned char>(path[0])) != 0 && path.compare(n, 2, ":/") == 0) {
        throw InvalidArgument("--prefix-cache '" + path + "' is a '" + path.substr(0, n + 1) +
                              "' URL, which rewind does not take; " + accepted + " (for a directory of that name, " +
                              "write ./" + path + ")");
      }
    }
    if ((redis || read_only) && cmd.count("--prefix-cache-bytes") > 0) {
      throw InvalidArgument(redis ? "--prefix-cache-bytes caps a directory cache; a Redis server caps itself (maxmemory)"
                                  : "--prefix-cache-bytes caps a cache that is written; ro:DIR is never written");
    }
    std::shared_ptr<BlobStore> store;
    try {
      if (redis) {
#if REWIND_HAVE_REDIS
        store = make_redis_store(parse_redis_url(spec));
#else
        throw InvalidArgument("--prefix-cache " + spec +
                              ": this build has no Redis support (built with -DREWIND_BUILD_REDIS=OFF); " +
                              "give a directory or ro:DIR");
#endif
      } else if (read_only) {
        store = make_directory_store(path, DirectoryStoreOptions{static_cast<std::size_t>(bytes), true});
      } else {
        try {
          store = make_directory_store(path, static_cast<std::size_t>(bytes));
        } catch (const StoreError& e) {
          // A directory this user may read but not write (a pre-built
          // cache, another user's) still serves its entries.
          std::error_code ec;
          if (!std::filesystem::is_directory(path, ec)) throw;
          store = make_directory_store(path, DirectoryStoreOptions{static_cast<std::size_t>(bytes), true});
          std::fprintf(stderr, "rewind: warning: prefix cache: %s; reading its entries without storing new ones\n",
                       e.what());
        }
      }
    } catch (const StoreError& e) {
      std::fprintf(stderr, "rewind: warning: prefix cache: %s; continuing without it (prefixes are recomputed)\n",
                   e.what());
      return nullptr;
    }
    PrefixCacheOptions options;
    options.interval = interval;
    options.model_fingerprint = model.fingerprint();
    // An entry ending at b holds at most b tokens' rows, the fixed states and
    // the logits; twice that (and 1 MiB of headers) bounds what a file under
    // a short prompt's key is read for.
    const std::size_t logits_bytes = static_cast<std::size_t>(model.vocab_size()) * sizeof(float);
    options.entry_bytes_per_token = 2 * (model.kv_bytes_per_token() + sizeof(std::int32_t));
    options.entry_fixed_bytes = 2 * (model.fixed_state_bytes() + logits_bytes) + (std::size_t{1} << 20);
    return std::make_unique<PrefixCache>(std::move(store), options);
  }
};

// `json` (one object) with "prefix_cache": the counters of `pc` (--stats),
// unchanged without a prefix cache.
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
                ll(s.lookups), ll(s.hits), ll(s.lookups - s.hits),
                ll(s.hit_tokens), ll(s.entries_read), ll(s.entries_rejected), ll(s.entries_unusable),
                ll(s.entries_corrupt), ll(s.entries_foreign), ll(s.entries_written), ll(s.writes_refused),
                ll(s.store_errors), ll(s.slow_calls), ll(s.calls_skipped), ll(s.lookups_over_budget), s.store_seconds,
                static_cast<unsigned long long>(s.bytes_read), static_cast<unsigned long long>(s.bytes_written));
  json.pop_back();
  return json + buf;
}

struct SamplingChoice {
  SamplingParams params;

  // Refuses sampling flags without sampling, and draws a seed when sampling
  // without --seed (std::random_device: a fresh seed per run, reported by
  // --stats so the run can be repeated with --seed N). 32 bits, so that any
  // JSON reader (many parse numbers as doubles) gets it exactly.
  SamplingParams resolve(const CLI::App& cmd) const {
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
};

// ---- tokenizers ----------------------------------------------------------------------------

// The tokenizer of model directory `dir` (runtime/tokenizer.h).
Tokenizer load_tokenizer(const std::string& dir, const Model& model) { return tokenizer_for_model(dir, model.config()); }

// `text` (named `what` in messages) encoded for generation: the
// tokenizer's BOS / template tokens, then the text's tokens.
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

// Streams generated tokens to stdout as complete UTF-8 (a byte-level model's
// bytes as they come, as before); finish() writes what is held back.
class StdoutStream {
 public:
  explicit StdoutStream(const Tokenizer& tokenizer) : decoder_(tokenizer) {}
  void push(std::int32_t id) { write(decoder_.push(id)); }
  void finish() { write(decoder_.finish()); }

 private:
  static void write(const std::string& bytes) {
    if (bytes.empty()) return;
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    std::fflush(stdout);
  }
  StreamDecoder decoder_;
};

std::optional<Model> load_draft(const DraftChoice& choice, const Model& target, const Tokenizer& target_tokenizer) {
  if (choice.draft_dir.empty()) return std::nullopt;
  Model draft = Model::load(choice.draft_dir);
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
    throw InvalidArgument("draft model " + choice.draft_dir +
                          " is incompatible with the target: the tokenizers' vocabularies differ (target first): " +
                          why);
  }
  return draft;
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

// ---- threads ---------------------------------------------------------------------------

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
void set_threads(const std::optional<int>& threads) {
  if (threads) {
    omp_set_num_threads(*threads);
    return;
  }
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env != nullptr && *env != '\0') return;  // OpenMP read it at start-up
  omp_set_num_threads(1);
}

// ---- context length ----------------------------------------------------------------

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
  const std::string context = std::to_string(ctx) + (ctx_from_flag ? " (-c / --ctx-size)"
                                                                    : " (the model's max_position_embeddings, -c / --ctx-size)");
  if (max_new == 0) {  // snapshot save
    throw InvalidArgument(what + " (" + std::to_string(prompt_tokens) + " tokens) is past the context of " + context +
                          "; shorten the prompt");
  }
  throw InvalidArgument(what + " (" + std::to_string(prompt_tokens) + " tokens) plus --max-new-tokens " +
                        std::to_string(max_new) + " needs " + std::to_string(prompt_tokens + max_new) +
                        " positions, past the context of " + context + "; shorten the prompt or lower -n / --max-new-tokens");
}

// ---- subcommands -------------------------------------------------------------------

// The prompts of --prompts (every line), encoded for `model`.
std::vector<std::vector<std::int32_t>> encode_prompts(const PromptChoice& prompt_choice, const Tokenizer& tokenizer) {
  std::vector<std::vector<std::int32_t>> prompts;
  for (const auto& line : prompt_choice.read_many()) {
    prompts.push_back(encode_for_generation(tokenizer, line, "--prompts line " + std::to_string(prompts.size() + 1)));
  }
  return prompts;
}

// The drafts of a batch of n prompts: a draft model runs every sequence's
// draft steps in one batched forward; prompt lookup looks in each sequence.
std::unique_ptr<BatchDraftSource> make_sources(std::size_t n, const DraftChoice& choice,
                                               const std::optional<Model>& draft, const SamplingParams& sampling,
                                               std::int64_t max_prefill_rows) {
  if (draft) return std::make_unique<BatchedModelDraft>(*draft, sampling, choice.num_draft, max_prefill_rows);
  std::vector<std::unique_ptr<DraftSource>> sources;
  for (std::size_t i = 0; i < n; ++i) sources.push_back(make_source(choice, draft, sampling, max_prefill_rows));
  return std::make_unique<PerSequenceDrafts>(std::move(sources));
}

// The most sequences --prompts decodes at once without --max-batch.
constexpr std::int64_t kMaxDefaultBatch = 64;
// generate --prompts reads, decodes and prints this many times --max-batch
// lines at a time: enough waiting prompts for finished sequences to be
// replaced, few enough that neither the prompts nor the outputs pile up.
constexpr std::int64_t kLinesPerBatch = 4;

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

// --max-batch without the flag: as many sequences as a quarter of the
// available memory holds, each with the state of a prompt of
// --max-prefill-rows tokens plus --max-new-tokens (KV rows, fixed states,
// a round's rollback record and logits; of the draft model too), between
// 1 and kMaxDefaultBatch; kMaxDefaultBatch when the available memory is
// unknown. With the flag: its value (0: every prompt at once).
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

// generate --prompts: the lines go kLinesPerBatch x max_batch at a time
// (all at once for --max-batch 0) through one batched call each, at most
// max_batch sequences decoding at once, and each group's JSON lines are
// printed (input order) before the next group is read: a file of any length
// holds only one group's prompts, states and outputs. Every sequence's
// tokens are what one call over the whole file would give: sequence i
// samples with seed + i (its index in the file), and the forward is batch
// invariant. The --stats line covers every group: seconds and per-sequence
// times count from the start of the first, decode_tokens_per_second
// divides by the sum of each group's decoding time (after its last first
// token), as one call's does for its own.
int run_generate_batch(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                       std::int64_t max_new, const DraftChoice& choice, const SamplingParams& sampling,
                       const PrefixChoice& prefix_choice, bool stats_wanted, const std::optional<std::int64_t>& ctx_size) {
  const Model model = Model::load(model_dir);
  const std::int64_t ctx = resolve_ctx_size(ctx_size, model);
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  const std::int64_t max_batch = resolve_max_batch(cmd, prompt_choice, model, draft ? &*draft : nullptr, max_new,
                                                   choice.any() ? choice.num_draft : 0);
  PromptChoice::Lines lines(prompt_choice.prompts);
  const std::unique_ptr<PrefixCache> prefix = prefix_choice.open(cmd, model);
  GenerationOptions options;
  options.prefix_cache = prefix.get();
  options.max_new_tokens = max_new;
  options.max_batch = max_batch;
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  const std::size_t group = max_batch == 0 ? std::numeric_limits<std::size_t>::max()
                                           : static_cast<std::size_t>(max_batch * kLinesPerBatch);
  BatchGenerationStats total;
  const auto t0 = Clock::now();
  while (true) {
    const std::size_t first = lines.read();
    const std::vector<std::string> text = lines.next(group);
    if (text.empty()) break;
    std::vector<std::vector<std::int32_t>> prompts;
    for (const std::string& line : text) {
      const std::string what = "--prompts line " + std::to_string(first + prompts.size() + 1);
      prompts.push_back(encode_for_generation(tokenizer, line, what));
      check_context(static_cast<std::int64_t>(prompts.back().size()), max_new, ctx, ctx_size.has_value(), what);
    }
    options.sampling = sampling;
    options.sampling.seed = sampling.seed + first;  // sequence i of the file samples with seed + i
    const double offset = std::chrono::duration<double>(Clock::now() - t0).count();
    BatchGenerationStats stats;
    std::vector<std::vector<std::int32_t>> out;
    if (choice.any()) {
      const auto sources = make_sources(prompts.size(), choice, draft, options.sampling, options.max_prefill_rows);
      out = speculative_generate_batch(model, *sources, prompts, options, {choice.num_draft, choice.adaptive}, &stats);
    } else {
      out = generate_batch(model, prompts, options, &stats);
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::printf("%s\n", indexed_text_json(first + i, tokenizer.decode(out[i], true)).c_str());
    }
    std::fflush(stdout);
    total.new_tokens += stats.new_tokens;
    total.forwards += stats.forwards;
    total.peak_batch = std::max(total.peak_batch, stats.peak_batch);
    total.draft_cache_seconds += stats.draft_cache_seconds;
    total.seconds = offset + stats.seconds;  // from the first group's start to the end of this one's decoding
    {
      // Decoding time of this group: after its last first token (as one call's).
      double last_first = 0.0;
      for (const GenerationStats& s : stats.sequences) {
        if (s.new_tokens > 0) last_first = std::max(last_first, s.time_to_first_token);
      }
      total.decode_seconds = total.decode_seconds.value_or(0.0) + std::max(0.0, stats.seconds - last_first);
    }
    if (stats_wanted) {
      for (GenerationStats& s : stats.sequences) {
        if (s.new_tokens > 0) s.time_to_first_token += offset;
        s.seconds += offset;
        total.sequences.push_back(std::move(s));
      }
    }
  }
  total.max_batch = max_batch == 0 ? static_cast<std::int64_t>(lines.read()) : max_batch;
  if (stats_wanted) std::printf("%s\n", with_prefix_stats(total.to_json(), prefix.get()).c_str());
  return 0;
}

int run_generate(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                 std::int64_t max_new, const DraftChoice& choice, const SamplingChoice& sampling_choice,
                 const PrefixChoice& prefix_choice, bool stats_wanted, const std::optional<std::int64_t>& ctx_size) {
  choice.check(cmd);
  const SamplingParams sampling = sampling_choice.resolve(cmd);
  prompt_choice.check_batch(cmd);
  if (prompt_choice.many(cmd)) {
    if (choice.tree()) throw InvalidArgument("--tree decodes one prompt (--prompt / --prompt-file); batched tree speculation is not built yet");
    return run_generate_batch(cmd, model_dir, prompt_choice, max_new, choice, sampling, prefix_choice, stats_wanted,
                              ctx_size);
  }
  const std::string prompt = prompt_choice.read(cmd);
  const Model model = Model::load(model_dir);
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  const std::vector<std::int32_t> tokens = encode_for_generation(tokenizer, prompt, "the prompt");
  check_context(static_cast<std::int64_t>(tokens.size()), max_new, resolve_ctx_size(ctx_size, model),
                ctx_size.has_value(), "the prompt");
  const std::unique_ptr<PrefixCache> prefix = prefix_choice.open(cmd, model);
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.sampling = sampling;
  options.prefix_cache = prefix.get();
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  Progress prefill_progress("prefill", "tokens");  // on a terminal, for a prompt that takes over half a second
  options.on_prefill = [&prefill_progress](std::int64_t done, std::int64_t total) {
    prefill_progress.update(done, total);
    if (done == total) prefill_progress.finish();
  };
  StdoutStream stream(tokenizer);
  options.on_token = [&stream](std::int32_t t) { stream.push(t); };
  GenerationStats stats;
  if (choice.tree()) {
    auto source = make_tree_source(choice, draft, options.max_prefill_rows);
    tree_speculative_generate(model, *source, tokens, options, choice.tree_options(), &stats);
  } else if (choice.any()) {
    auto source = make_source(choice, draft, sampling, options.max_prefill_rows);
    speculative_generate(model, *source, tokens, options, {choice.num_draft, choice.adaptive}, &stats);
  } else {
    generate(model, tokens, options, &stats);
  }
  stream.finish();
  std::fputc('\n', stdout);
  if (stats_wanted) std::printf("%s\n", with_prefix_stats(stats.to_json(), prefix.get()).c_str());
  return 0;
}

// "; accepted by position 0.930 0.840 ...": stats.acceptance_at(i) for each
// draft position of a round; empty when nothing was counted per position
// (tree speculation). Not worded "acceptance ...": scripts/demo.sh takes the
// overall rate from the line's last "acceptance " (sed's greedy .*).
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

// Decodes greedily and speculatively `repeats` times each, alternating (so
// that a burst of load on a shared machine hits both), checks every
// speculative run against the greedy output token by token and reports the
// median tokens/s of each.
// verify --prompts: every prompt decoded speculatively in one batch, each
// checked against greedy decoding of that prompt alone.
int run_verify_batch(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                     std::int64_t max_new, const DraftChoice& choice, const std::optional<std::int64_t>& ctx_size) {
  const Model model = Model::load(model_dir);
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  const std::vector<std::vector<std::int32_t>> prompts = encode_prompts(prompt_choice, tokenizer);
  const std::int64_t ctx = resolve_ctx_size(ctx_size, model);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    check_context(static_cast<std::int64_t>(prompts[i].size()), max_new, ctx, ctx_size.has_value(),
                  "--prompts line " + std::to_string(i + 1));
  }
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.max_batch = resolve_max_batch(cmd, prompt_choice, model, draft ? &*draft : nullptr, max_new, choice.num_draft);
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  std::vector<std::vector<std::int32_t>> greedy;
  double greedy_seconds = 0.0;
  {
    Progress progress("greedy, one prompt at a time", "prompts");
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      GenerationStats s;
      greedy.push_back(generate(model, prompts[i], options, &s));
      greedy_seconds += s.seconds;
      progress.update(static_cast<std::int64_t>(i + 1), static_cast<std::int64_t>(prompts.size()));
    }
  }
  BatchGenerationStats stats;
  const auto sources = make_sources(prompts.size(), choice, draft, options.sampling, options.max_prefill_rows);
  const auto spec =
      speculative_generate_batch(model, *sources, prompts, options, {choice.num_draft, choice.adaptive}, &stats);
  std::int64_t tokens = 0;
  GenerationStats total;  // drafts and acceptances over every sequence
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const std::size_t common = std::min(greedy[i].size(), spec[i].size());
    for (std::size_t j = 0; j < common; ++j) {
      if (greedy[i][j] != spec[i][j]) {
        std::printf("DIVERGED: prompt %zu at new token %zu: greedy %d, speculative %d\n", i, j, greedy[i][j], spec[i][j]);
        return 1;
      }
    }
    if (greedy[i].size() != spec[i].size()) {
      std::printf("DIVERGED: prompt %zu: greedy produced %zu tokens, speculative %zu\n", i, greedy[i].size(),
                  spec[i].size());
      return 1;
    }
    tokens += static_cast<std::int64_t>(greedy[i].size());
    const GenerationStats& s = stats.sequences[i];
    total.drafted += s.drafted;
    total.accepted += s.accepted;
    total.drafted_at.resize(std::max(total.drafted_at.size(), s.drafted_at.size()), 0);
    total.accepted_at.resize(total.drafted_at.size(), 0);
    for (std::size_t j = 0; j < s.drafted_at.size(); ++j) {
      total.drafted_at[j] += s.drafted_at[j];
      total.accepted_at[j] += s.accepted_at[j];
    }
  }
  std::printf("IDENTICAL: %zu prompts, %lld new tokens; greedy one at a time %.1f tok/s, speculative batch "
              "%.1f tok/s, acceptance %.3f (%lld/%lld)%s\n",
              prompts.size(), static_cast<long long>(tokens),
              greedy_seconds > 0 ? static_cast<double>(tokens) / greedy_seconds : 0.0, stats.tokens_per_second(),
              total.acceptance_rate(), static_cast<long long>(total.accepted), static_cast<long long>(total.drafted),
              acceptance_by_position(total).c_str());
  return 0;
}

int run_verify(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
               std::int64_t max_new, const DraftChoice& choice, int repeats, const std::optional<std::int64_t>& ctx_size) {
  if (!choice.any()) throw InvalidArgument("verify needs a draft source: --draft DIR or --lookup N");
  choice.check(cmd);
  prompt_choice.check_batch(cmd);
  if (prompt_choice.many(cmd)) {
    if (choice.tree()) throw InvalidArgument("verify --tree checks one prompt (--prompt / --prompt-file); batched tree speculation is not built yet");
    if (cmd.count("--repeats") > 0) throw InvalidArgument("verify --prompts runs once; --repeats applies to --prompt");
    return run_verify_batch(cmd, model_dir, prompt_choice, max_new, choice, ctx_size);
  }
  const std::string prompt = prompt_choice.read(cmd);
  const Model model = Model::load(model_dir);
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  const std::vector<std::int32_t> tokens = encode_for_generation(tokenizer, prompt, "the prompt");
  check_context(static_cast<std::int64_t>(tokens.size()), max_new, resolve_ctx_size(ctx_size, model),
                ctx_size.has_value(), "the prompt");
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  GenerationStats greedy_stats, spec_stats;
  std::vector<std::int32_t> greedy;
  std::vector<double> greedy_rates, spec_rates;
  for (int run = 1; run <= repeats; ++run) {
    const std::string suffix = repeats > 1 ? " " + std::to_string(run) + "/" + std::to_string(repeats) : "";
    {
      Progress progress("greedy" + suffix, "tokens");
      std::int64_t n = 0;
      options.on_token = [&](std::int32_t) { progress.update(++n, max_new); };
      std::vector<std::int32_t> out = generate(model, tokens, options, &greedy_stats);
      // Greedy decoding is deterministic; a difference between its runs
      // would be a bug of its own.
      if (run == 1) greedy = std::move(out);
      else if (out != greedy) throw StateError("verify: greedy decoding gave different tokens in run " + std::to_string(run));
    }
    greedy_rates.push_back(greedy_stats.tokens_per_second());
    std::vector<std::int32_t> spec;
    {
      Progress progress("speculative" + suffix, "tokens");
      std::int64_t n = 0;
      options.on_token = [&](std::int32_t) { progress.update(++n, max_new); };
      if (choice.tree()) {
        auto source = make_tree_source(choice, draft, options.max_prefill_rows);
        spec = tree_speculative_generate(model, *source, tokens, options, choice.tree_options(), &spec_stats);
      } else {
        auto source = make_source(choice, draft, options.sampling, options.max_prefill_rows);
        spec = speculative_generate(model, *source, tokens, options, {choice.num_draft, choice.adaptive}, &spec_stats);
      }
    }
    spec_rates.push_back(spec_stats.tokens_per_second());
    const std::size_t common = std::min(greedy.size(), spec.size());
    for (std::size_t i = 0; i < common; ++i) {
      if (greedy[i] != spec[i]) {
        std::printf("DIVERGED at new token %zu: greedy %d, speculative %d\n", i, greedy[i], spec[i]);
        return 1;
      }
    }
    if (greedy.size() != spec.size()) {
      std::printf("DIVERGED: greedy produced %zu tokens, speculative %zu\n", greedy.size(), spec.size());
      return 1;
    }
  }
  const double g = median(greedy_rates), sp = median(spec_rates);
  std::printf("IDENTICAL: %zu new tokens; greedy %.1f tok/s, speculative %.1f tok/s (%.2fx), acceptance %.3f "
              "(%lld/%lld), %lld rounds, %lld rollbacks%s%s\n",
              greedy.size(), g, sp, g > 0 ? sp / g : 0.0, spec_stats.acceptance_rate(),
              static_cast<long long>(spec_stats.accepted), static_cast<long long>(spec_stats.drafted),
              static_cast<long long>(spec_stats.rounds), static_cast<long long>(spec_stats.rollbacks),
              repeats > 1 ? ("; tok/s are medians of " + std::to_string(repeats) + " runs each").c_str() : "",
              acceptance_by_position(spec_stats).c_str());
  return 0;
}

int run_eval(const std::string& model_dir, const std::string& text_path, std::int64_t chunk, std::int64_t context) {
  std::ifstream in = open_input_file("--text", text_path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  if (text.empty()) throw InvalidArgument(text_path + " is empty");
  const Model model = Model::load(model_dir);
  // Bits per byte with teacher forcing over byte tokens: a model with its
  // own tokenizer would be scored on ids it never saw as text.
  if (load_tokenizer(model_dir, model).kind() != TokenizerKind::ByteLevel) {
    throw InvalidArgument("eval scores byte-level models only; " + model_dir +
                          " has a tokenizer.json (BPE), whose tokens are not bytes");
  }
  // Each segment is BOS + its bytes: positions the model must have been built for.
  if (const std::int64_t limit = model.config().max_position_embeddings; limit > 0) {
    const auto bytes = static_cast<std::int64_t>(text.size());
    const std::int64_t segment = context > 0 ? std::min(context, bytes) : bytes;
    if (segment + 1 > limit) {
      throw InvalidArgument((context > 0 ? "--context " + std::to_string(context) + " makes segments of "
                                         : "--context 0 makes the whole file (" + std::to_string(bytes) +
                                               " bytes) one segment of ") +
                            std::to_string(segment + 1) + " positions (BOS + bytes), past the model's "
                            "max_position_embeddings (" + std::to_string(limit) + "); give --context at most " +
                            std::to_string(limit - 1));
    }
  }
  EvalOptions options;
  options.chunk = chunk;
  options.context = context;
  EvalResult r;
  {
    Progress bar("eval", "bytes");
    options.on_progress = [&](std::int64_t done, std::int64_t total) { bar.update(done, total); };
    r = evaluate_text(model, text, options);
  }
  std::printf("%s on %s: %.4f bits per byte (%lld bytes, %lld segments of <= %lld bytes, chunk %lld; %.1f s, "
              "%.0f bytes/s)\n",
              model_dir.c_str(), text_path.c_str(), r.bits_per_byte(), static_cast<long long>(r.bytes),
              static_cast<long long>(r.segments), static_cast<long long>(context > 0 ? context : r.bytes),
              static_cast<long long>(chunk), r.seconds, r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds : 0.0);
  return 0;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (b >= 1024.0 && u < 6) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

int run_inspect(const std::string& model_dir, std::int64_t rollback) {
  const Model model = Model::load(model_dir);
  const ModelConfig& c = model.config();
  // The library refuses R above 2^40 and figures above 2^48 bytes (rather
  // than wrap around); either is a bad --rollback here.
  std::size_t rollback_total = 0;
  try {
    rollback_total = model.rollback_bytes(rollback);
  } catch (const rwd::Error& e) {
    throw InvalidArgument("--rollback " + std::to_string(rollback) + ": " + e.what());
  }
  std::printf("model %s: %s, %lld layers, hidden %lld, vocab %lld, weights stored as %s\n", model_dir.c_str(),
              c.model_type.c_str(), static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.vocab_size), std::string(dtype_name(c.torch_dtype)).c_str());
  std::printf("tokenizer: %s\n", load_tokenizer(model_dir, model).describe().c_str());
  std::printf("parameters: %lld\n", static_cast<long long>(model.parameter_count()));
  {
    std::map<std::string, int> mix;
    for (const LayerKind kind : c.layer_types) ++mix[std::string(layer_kind_name(kind))];
    std::string mix_text;
    for (const auto& [kind, count] : mix) mix_text += (mix_text.empty() ? "" : ", ") + std::to_string(count) + " " + kind;
    std::string variants;
    auto add = [&variants](bool on, const std::string& what) {
      if (on) variants += (variants.empty() ? "" : ", ") + what;
    };
    add(c.norm_plus_one, "(1 + w) RMSNorm");
    add(c.qk_norm, "q/k norm");
    add(c.attn_output_gate, "attention output gate");
    add(c.rope_dim() != c.head_dim, "partial RoPE " + std::to_string(c.rope_dim()) + "/" + std::to_string(c.head_dim));
    add(c.fused_gdn_projections, "fused in_proj_qkvz / in_proj_ba");
    add(c.tie_word_embeddings, "tied embeddings");
    std::printf("family: %s (model_type %s); layers: %s%s%s\n", model_family_name(c.family), c.model_type.c_str(),
                mix_text.c_str(), variants.empty() ? "" : "; ", variants.c_str());
  }
  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    const LayerKind kind = c.layer_types[i];
    std::string detail;
    switch (kind) {
      case LayerKind::FullAttention:
      case LayerKind::SlidingAttention:
        detail = std::to_string(c.num_attention_heads) + " heads / " + std::to_string(c.num_key_value_heads) +
                 " kv heads x " + std::to_string(c.head_dim);
        if (kind == LayerKind::SlidingAttention) detail += ", window " + std::to_string(c.sliding_window);
        break;
      case LayerKind::LinearAttention:
        detail = "Gated DeltaNet, conv " + std::to_string(c.linear_conv_dim()) + " x K=" +
                 std::to_string(c.linear_conv_kernel_dim) + ", state [" + std::to_string(c.linear_num_value_heads) +
                 ", " + std::to_string(c.linear_key_head_dim) + ", " + std::to_string(c.linear_value_head_dim) + "]";
        break;
      case LayerKind::Conv:
        detail = "short conv, " + std::to_string(c.hidden_size) + " channels x K=" + std::to_string(c.conv_L_cache);
        break;
      case LayerKind::ChunkedAttention:
      case LayerKind::Hybrid:
      case LayerKind::HybridSliding:
      case LayerKind::SparseAttention:
      case LayerKind::Moe:
      case LayerKind::Mlp: break;  // a ModelConfig never holds them
    }
    const std::string t(layer_kind_name(kind));
    std::printf("  layer %2zu  %-18s %s\n", i, t.c_str(), detail.c_str());
  }
  {
    // VmHWM: the peak resident memory of this process so far, i.e. what
    // loading the model cost on top of the CLI itself.
    std::ifstream status("/proc/self/status");
    std::string line, peak = "unknown";
    while (std::getline(status, line)) {
      if (line.rfind("VmHWM:", 0) == 0) peak = line.substr(6);
    }
    peak.erase(0, peak.find_first_not_of(" \t"));
    std::printf("weights in memory: %s (in the stored dtype); peak resident memory of this process: %s\n",
                human_bytes(static_cast<double>(model.weight_bytes())).c_str(), peak.c_str());
  }
  std::printf("KV bytes per token (full-attention layers, f32): %s\n",
              human_bytes(static_cast<double>(model.kv_bytes_per_token())).c_str());
  std::printf("fixed state bytes per sequence (sliding windows + conv + recurrent states): %s\n",
              human_bytes(static_cast<double>(model.fixed_state_bytes())).c_str());
  std::printf("rollback memory for R = %lld: at most %s more\n", static_cast<long long>(rollback),
              human_bytes(static_cast<double>(rollback_total)).c_str());
  return 0;
}

int run_bench(const CLI::App& cmd, const std::string& model_dir, const DraftChoice& tree_choice, std::int64_t max_new,
              int repeats, const std::vector<std::int64_t>& ks, const std::vector<std::int64_t>& batch_sizes,
              const std::string& json_path) {
  if (cmd.count("--tree-nodes") > 0 && !tree_choice.tree()) {
    throw InvalidArgument("--tree-nodes sizes tree speculation: it needs --tree W (W >= 2)");
  }
  const Model model = Model::load(model_dir);
  DraftChoice choice;
  choice.draft_dir = tree_choice.draft_dir;
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  DecodeBenchOptions options;
  options.encode = [&tokenizer](const std::string& text) {
    return encode_for_generation(tokenizer, text, "bench prompt '" + text + "'");
  };
  std::size_t prompt_tokens = 0;
  for (const std::string& p : default_bench_prompts()) prompt_tokens += options.encode(p).size();
  std::fprintf(stderr, "bench: %zu prompts, %zu prompt tokens (%s tokenizer)\n", default_bench_prompts().size(),
               prompt_tokens, tokenizer.kind_name().c_str());
  options.max_new_tokens = max_new;
  options.repeats = repeats;
  if (!ks.empty()) options.ks = ks;
  options.batch_sizes = batch_sizes;
  options.tree_width = tree_choice.tree_width;
  options.tree_nodes = tree_choice.tree_nodes;
  const auto rows = run_decode_bench(model, draft ? &*draft : nullptr, options, [](const std::string& line) {
    std::fprintf(stderr, "bench: %s\n", line.c_str());
  });
  std::printf("%-12s %5s %3s %12s %9s %12s %9s %11s %12s %10s\n", "method", "batch", "K", "tokens/s", "speedup",
              "decode tok/s", "speedup", "acceptance", "cache share", "identical");
  bool all_identical = true;
  for (const auto& r : rows) {
    char share[32];
    if (r.cache_share < 0) {
      std::snprintf(share, sizeof share, "n/a");
    } else {
      std::snprintf(share, sizeof share, "%.3f%%", 100.0 * r.cache_share);
    }
    std::printf("%-12s %5lld %3lld %12.1f %8.2fx %12.1f %8.2fx %11.3f %12s %10s\n", r.method.c_str(),
                static_cast<long long>(r.batch), static_cast<long long>(r.k), r.tokens_per_second, r.speedup,
                r.decode_tokens_per_second, r.decode_speedup, r.acceptance_rate, share, r.identical ? "yes" : "NO");
    all_identical = all_identical && r.identical;
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << decode_bench_json(rows) << "\n";
    if (!out) throw Error("cannot write " + json_path);
  }
  return all_identical ? 0 : 1;
}

int run_forward_cost(const std::string& model_dir, std::int64_t max_q, std::int64_t context, int samples,
                     const std::vector<std::int64_t>& batch_sizes) {
  const Model model = Model::load(model_dir);
  std::fprintf(stderr, "forward-cost: %lld samples per q after %lld tokens of context\n",
               static_cast<long long>(samples), static_cast<long long>(context));
  const auto rows = measure_forward_costs(model, max_q, context, samples);
  std::printf("%3s %14s %20s\n", "q", "microseconds", "one-token forwards");
  for (const auto& r : rows) {
    std::printf("%3lld %14.1f %19.2fx\n", static_cast<long long>(r.q), r.microseconds, r.one_token_forwards);
  }
  if (!batch_sizes.empty()) {
    std::fprintf(stderr, "forward-cost: decoding rounds of B sequences, each holding %lld tokens\n",
                 static_cast<long long>(context));
    std::printf("\n%5s %14s %14s %12s\n", "B", "microseconds", "per token", "gain");
    for (const auto& r : measure_batch_round_costs(model, batch_sizes, context, samples)) {
      std::printf("%5lld %14.1f %14.1f %11.2fx\n", static_cast<long long>(r.batch), r.microseconds, r.per_token, r.gain);
    }
  }
  return 0;
}

// ---- snapshot files (rewind/snapshot.h, docs/snapshot-format.md) ----

// The bytes of snapshot file `path` (given as --file). Only a regular file
// is read, and only as many bytes as its size says: a device or a pipe
// (/dev/zero) has no end to read to, and the format's header does not give
// the total length. Throws InvalidArgument for a file that is not there or
// not regular, FormatError for an empty one.
std::vector<std::byte> read_file_bytes(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!ec && fs::exists(status) && !fs::is_regular_file(status) && !fs::is_directory(status)) {
    const char* kind = fs::is_character_file(status) ? "a character device"
                       : fs::is_block_file(status)   ? "a block device"
                       : fs::is_fifo(status)         ? "a pipe"
                       : fs::is_socket(status)       ? "a socket"
                                                     : "not a regular file";
    throw InvalidArgument("--file " + path + " is " + kind + "; a snapshot is read from a regular file (written by "
                          "`rewind snapshot save`): copy the bytes to a file first");
  }
  std::ifstream in = open_input_file("--file", path);
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) throw InvalidArgument("--file " + path + ": cannot read its size (" + ec.message() + ")");
  if (size == 0) {
    throw FormatError("--file " + path + " is empty; a snapshot file starts with the 8 bytes \"RWNDSNAP\" and a "
                      "52-byte header (docs/snapshot-format.md)");
  }
  std::vector<std::byte> out(static_cast<std::size_t>(size));
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  if (in.bad() || static_cast<std::uintmax_t>(in.gcount()) != size) {
    throw InvalidArgument("--file " + path + ": read error (read " + std::to_string(in.gcount()) + " of its " +
                          std::to_string(size) + " bytes; did it change while being read?)");
  }
  return out;
}

// Writes to a temporary name beside `path`, then renames: a reader never
// sees half a file.
void write_file_atomically(const std::string& path, const std::vector<std::byte>& bytes) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error("--out " + path + ": cannot write " + tmp);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      throw Error("--out " + path + ": writing " + tmp + " failed");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("--out " + path + ": cannot rename " + tmp + " into place");
  }
}

int run_snapshot_save(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                      const std::string& out_path, const std::optional<std::int64_t>& ctx_size) {
  const std::string prompt = prompt_choice.read(cmd);
  const Model model = Model::load(model_dir);
  const std::vector<std::int32_t> tokens =
      encode_for_generation(load_tokenizer(model_dir, model), prompt, "the prompt");
  check_context(static_cast<std::int64_t>(tokens.size()), 0, resolve_ctx_size(ctx_size, model), ctx_size.has_value(),
                "the prompt");
  Cache cache = model.make_cache();
  std::vector<float> logits;
  GenerationStats stats;
  prefill(model, tokens, cache, logits, nullptr, stats, prompt_choice.max_prefill_rows);
  Snapshot snap = cache.snapshot();
  snap.tokens = tokens;
  snap.logits = Tensor(DType::F32, {static_cast<std::int64_t>(logits.size())});
  std::memcpy(snap.logits.data<float>(), logits.data(), logits.size() * sizeof(float));
  const std::vector<std::byte> bytes = serialize_snapshot(snap, model.fingerprint());
  write_file_atomically(out_path, bytes);
  std::printf("wrote %s: %lld tokens of %s, %zu bytes\n", out_path.c_str(), static_cast<long long>(snap.length),
              model.fingerprint().c_str(), bytes.size());
  return 0;
}

// The snapshot in file `path`, every field checked; FormatError names the file.
Snapshot read_snapshot_file(const std::string& path, const std::vector<std::byte>& bytes, std::string& fingerprint) {
  try {
    return deserialize_snapshot(bytes, &fingerprint);
  } catch (const FormatError& e) {
    throw FormatError(path + ": " + e.what());
  }
}

int run_snapshot_inspect(const std::string& path) {
  const std::vector<std::byte> bytes = read_file_bytes(path);
  std::string fingerprint;
  const Snapshot snap = read_snapshot_file(path, bytes, fingerprint);
  const SnapshotHeader header = read_snapshot_header(bytes);
  std::printf("%s: rewind snapshot, format version %u, %zu bytes, every checksum verified\n", path.c_str(),
              header.version, bytes.size());
  std::printf("model fingerprint: %s\n", fingerprint.c_str());
  std::printf("length: %lld tokens (%zu token ids stored), logits: %s\n", static_cast<long long>(snap.length),
              snap.tokens.size(), snap.logits.view().data ? snap.logits.view().describe().c_str() : "none");
  if (!snap.parent.empty()) std::printf("continues entry: %s\n", snap.parent.c_str());
  for (std::size_t i = 0; i < snap.layers.size(); ++i) {
    const LayerSnapshot& l = snap.layers[i];
    std::string parts;
    auto add = [&](const char* what, const Tensor& t) {
      parts += std::string(parts.empty() ? "" : ", ") + what + " " + t.view().describe();
    };
    if (l.keys.view().data || l.keys.view().rank > 0) {
      parts = "positions [" + std::to_string(l.first) + ", " + std::to_string(snap.length) + ")";
      add("keys", l.keys);
      add("values", l.values);
      for (const Tensor& t : l.sides) add("side", t);
    }
    for (const Tensor& t : l.conv_states) add("conv", t);
    for (const Tensor& t : l.recurrent_states) add("recurrent", t);
    auto bytes_of = [](const Tensor& t) { return t.view().data ? t.bytes() : std::size_t{0}; };
    std::size_t layer_bytes = bytes_of(l.keys) + bytes_of(l.values);
    for (const Tensor& t : l.sides) layer_bytes += bytes_of(t);
    for (const Tensor& t : l.conv_states) layer_bytes += bytes_of(t);
    for (const Tensor& t : l.recurrent_states) layer_bytes += bytes_of(t);
    const std::string kind(layer_kind_name(l.kind));
    std::printf("  layer %2zu  %-18s %10zu bytes  %s\n", i, kind.c_str(), layer_bytes,
                parts.empty() ? "(no state)" : parts.c_str());
  }
  return 0;
}

int run_snapshot_load(const CLI::App& cmd, const std::string& model_dir, const std::string& path, std::int64_t max_new,
                      const SamplingChoice& sampling_choice, bool stats_wanted, const std::optional<std::int64_t>& ctx_size) {
  const SamplingParams sampling = sampling_choice.resolve(cmd);
  const std::vector<std::byte> bytes = read_file_bytes(path);
  std::string fingerprint;
  const Snapshot snap = read_snapshot_file(path, bytes, fingerprint);
  const Model model = Model::load(model_dir);
  if (fingerprint != model.fingerprint()) {
    throw InvalidArgument(path + " holds a state of model " + fingerprint + ", but " + model_dir + " is model " +
                          model.fingerprint() + " (other weights or config): it cannot continue it");
  }
  if (snap.logits.numel() != model.vocab_size() || snap.length < 1) {
    throw InvalidArgument(path + " holds no logits of its last token (or no token): `snapshot save` files do");
  }
  check_context(snap.length, max_new, resolve_ctx_size(ctx_size, model), ctx_size.has_value(),
                "the snapshot's sequence");
  Cache cache = model.make_cache();
  cache.restore(snap);
  std::vector<float> logits(snap.logits.data<float>(), snap.logits.data<float>() + model.vocab_size());
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.sampling = sampling;
  StdoutStream stream(tokenizer);
  options.on_token = [&stream](std::int32_t t) { stream.push(t); };
  GenerationStats stats;
  continue_generation(model, cache, logits, options, &stats);
  stream.finish();
  std::fputc('\n', stdout);
  if (stats_wanted) std::printf("%s\n", stats.to_json().c_str());
  return 0;
}

// The files of a model directory that init-random would overwrite or leave
// stale: config.json and any *.safetensors.
std::vector<std::string> model_files_in(const fs::path& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "config.json" || entry.path().extension() == ".safetensors") found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

int run_init_random(const std::string& config_path, const std::string& out_dir, std::uint64_t seed,
                    const std::string& dtype, bool force) {
  const ModelConfig config = load_model_config(config_path);
  const DType stored = parse_dtype(dtype);
  const fs::path dir(out_dir);
  const std::vector<std::string> existing = model_files_in(dir);
  if (!existing.empty() && !force) {
    std::string list;
    for (const auto& f : existing) list += (list.empty() ? "" : ", ") + f;
    throw InvalidArgument("--out " + out_dir + " already holds a model (" + list +
                          "); init-random would overwrite its weights: pass --force to replace it, or choose "
                          "another directory");
  }
  write_random_model(config, out_dir, seed, stored);
  std::printf("wrote %s/config.json and %s/model.safetensors (seed %llu, %s)\n", out_dir.c_str(), out_dir.c_str(),
              static_cast<unsigned long long>(seed), dtype.c_str());
  if (!existing.empty()) {
    // The model card and the training record describe the weights just
    // replaced: a card of the new, untrained weights takes the old card's place.
    std::error_code ec;
    if (fs::remove(dir / "training.json", ec)) std::printf("removed the stale %s/training.json\n", out_dir.c_str());
    const bool had_card = fs::exists(dir / "README.md", ec);
    std::ofstream card(dir / "README.md", std::ios::trunc);
    card << "# " << dir.filename().string() << "\n\n"
         << "Random weights written by `rewind init-random --config " << config_path << " --seed " << seed
         << " --dtype " << dtype << "`: an untrained model, for tests and benchmarks only. "
         << "It replaced an earlier model in this directory (" << existing.size() << " file(s) overwritten); "
         << "that model's card and training record were removed.\n";
    if (!card) throw Error(out_dir + "/README.md: cannot write the model card");
    std::printf("%s %s/README.md: the card now describes these random weights\n", had_card ? "replaced" : "wrote",
                out_dir.c_str());
  }
  return 0;
}

// ---- unknown subcommands and flags ---------------------------------------------------

// Levenshtein distance, for "did you mean" suggestions.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "; did you mean 'X'?" for the candidate nearest to `typed` (at most 2
// edits, or a third of its length for long names), or "" when none is near.
std::string did_you_mean(const std::string& typed, const std::vector<std::string>& candidates) {
  const std::size_t limit = std::max<std::size_t>(2, typed.size() / 3);
  std::string best;
  std::size_t best_distance = limit + 1;
  for (const std::string& c : candidates) {
    const std::size_t d = edit_distance(typed, c);
    if (d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  return best.empty() ? "" : "; did you mean '" + best + "'?";
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// After a parse error: a message naming the unknown subcommand or flag in
// argv, with the nearest known one, or "" when argv holds none (CLI11's own
// message is printed then). Option values are skipped, so that a prompt
// such as "-x" is not taken for a flag.
std::string diagnose_usage(const CLI::App& app, int argc, char** argv) {
  const CLI::App* cur = &app;
  std::string path = "rewind";
  auto subcommand_names = [](const CLI::App* a) {
    std::vector<std::string> names;
    for (const CLI::App* s : a->get_subcommands([](const CLI::App*) { return true; })) names.push_back(s->get_name());
    return names;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    const bool number = arg.size() > 1 && (std::isdigit(static_cast<unsigned char>(arg[1])) != 0 || arg[1] == '.');
    if (arg.size() > 1 && arg[0] == '-' && !number) {
      const std::string name = arg.substr(0, arg.find('='));
      const CLI::Option* known = nullptr;
      for (const CLI::Option* opt : cur->get_options()) {
        if (opt->check_name(name)) known = opt;
      }
      if (known != nullptr) {
        if (name.size() == arg.size() && known->get_items_expected_min() > 0) ++i;  // its value
        continue;
      }
      const std::vector<std::string> subcommands = subcommand_names(cur);
      if (cur == &app) {
        return "'" + name + "' comes before any subcommand; give one first, as in `rewind generate -m DIR -p TEXT` " +
               "(subcommands: " + joined(subcommands) + ")";
      }
      std::vector<std::string> flags;
      for (const CLI::Option* opt : cur->get_options()) {
        for (const std::string& l : opt->get_lnames()) flags.push_back("--" + l);
        for (const std::string& sn : opt->get_snames()) flags.push_back("-" + sn);
      }
      return "unknown flag '" + name + "' for " + path + did_you_mean(name, flags) + " (`" + path +
             " --help` lists its flags)";
    }
    const std::vector<std::string> subcommands = subcommand_names(cur);
    if (subcommands.empty()) return "";  // a stray word: CLI11 names it
    bool found = false;
    for (const CLI::App* s : cur->get_subcommands([](const CLI::App*) { return true; })) {
      if (s->check_name(arg)) {
        cur = s;
        path += " " + s->get_name();
        found = true;
      }
    }
    if (!found) {
      return "unknown subcommand '" + arg + "'" + (cur == &app ? "" : " of " + path) + did_you_mean(arg, subcommands) +
             " (subcommands: " + joined(subcommands) + ")";
    }
  }
  if (cur->get_require_subcommand_min() > 0) {
    return path + " needs a subcommand (subcommands: " + joined(subcommand_names(cur)) + "; `" + path +
           " --help` describes them)";
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"rewind: reference runtime for exact-rollback inference caches"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("rewind ") + REWIND_VERSION, "print the version and exit");
  // Every option's help line shows its default (subcommands copy this).
  app.option_defaults()->always_capture_default();
  app.footer(
      "Threads: one OpenMP thread unless --threads N or the environment variable OMP_NUM_THREADS says otherwise "
      "(OpenMP's one-thread-per-core default made small models several times slower on a busy machine).\n"
      "Exit status: 0 success, 1 verify/bench found a divergence, 2 bad input or usage.");

  std::string model_dir, text_path, config_path, out_dir, dtype = "f32";
  std::int64_t max_new = 128, rollback = 8, chunk = 128, context = 512;
  std::uint64_t init_seed = 0;
  bool stats = false, force = false;
  std::optional<int> threads;
  std::optional<std::int64_t> ctx_size;
  PromptChoice prompt;
  DraftChoice choice;
  SamplingChoice sampling;
  PrefixChoice prefix;

  const CLI::Validator max_new_range = integer_in(0, std::int64_t{1} << 30);
  auto add_prompt_options = [&](CLI::App* cmd) {
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
  };
  auto add_draft_options = [&](CLI::App* cmd) {
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
  };
  auto add_threads_option = [&](CLI::App* cmd) {
    cmd->add_option("-t,--threads", threads,
                    "OpenMP threads; default 1, or OMP_NUM_THREADS when set. More threads help only models "
                    "too big for the caches, or long prompts, on an idle machine: on a busy one they can make "
                    "decoding many times slower")
        ->check(integer_in(1, 1024))
        ->default_str("1 or $OMP_NUM_THREADS");
  };

  auto add_ctx_option = [&](CLI::App* cmd) {
    cmd->add_option("-c,--ctx-size", ctx_size,
                    "the most positions a run may use (prompt tokens + --max-new-tokens): a run past it is refused "
                    "before any work; at most the model's max_position_embeddings (no limit when its config names "
                    "none)")
        ->check(integer_in(1, std::int64_t{1} << 40))
        ->default_str("max_position_embeddings");
  };
  auto add_prompts_option = [&](CLI::App* cmd, const char* what) {
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
  };
  auto add_sampling_options = [&](CLI::App* cmd) {
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
  };
  auto* gen = app.add_subcommand("generate", "generate text (greedy, sampled or speculative)");
  gen->add_option("-m,--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  add_prompt_options(gen);
  add_prompts_option(gen,
                     "decode every line of FILE ('-' = standard input) as a prompt, in batches of at most "
                  "--max-batch sequences; prints one JSON line per prompt, {\"index\": i, \"text\": ...}, in "
                  "input order (bytes that are not UTF-8 become U+FFFD), 4 x --max-batch lines at a time, each "
                  "group read, decoded and printed before the next is read (a line that cannot be encoded "
                  "stops with exit 2 after the groups before it); speculative with --draft / --lookup (each "
                  "sequence its own drafts and rollbacks); with --stats a last line: sequences, new_tokens, "
                  "forwards, max_batch, peak_batch (the most sequences in one forward), seconds, "
                  "tokens_per_second (all sequences' tokens over the wall time), time_to_first_token_s and "
                  "per_sequence figures (acceptance included)");
  gen->add_option("-n,--max-new-tokens", max_new, "token budget")->check(max_new_range);
  gen->add_option("--prefix-cache", prefix.spec,
                  "reuse prompt prefixes across runs and processes: a directory, ro:DIR (a directory read but "
                  "never written, e.g. a pre-built cache), or redis://HOST:PORT[/PREFIX]; other URLs are refused. "
                  "The prefill restores the longest stored prefix (attention rows with the conv and recurrent "
                  "states at the same position) and stores an entry every --prefix-interval tokens and at the "
                  "prompt's end; output is identical with or without it. Junk under an entry's name is a miss; a "
                  "store that fails or is slow (a call over 0.25 s) is skipped for 2 s to 64 s with one warning, "
                  "then tried again; --stats adds the counters (prefix_cache)")
      ->type_name("DIR|ro:DIR|URL")
      ->default_str("none");
  gen->add_option("--prefix-interval", prefix.interval, "tokens between prefix-cache entries")
      ->check(integer_in(1, std::int64_t{1} << 40));
  gen->add_option("--prefix-cache-bytes", prefix.bytes,
                  "cap of a directory prefix cache in bytes; least recently used entries go first (0: no cap)")
      ->check(integer_in(0, std::int64_t{1} << 50));
  add_draft_options(gen);
  add_sampling_options(gen);
  add_threads_option(gen);
  add_ctx_option(gen);
  gen->add_flag("--stats", stats,
                "end with one JSON line: new_tokens, prompt_tokens, seconds (wall time of prefill + decoding), "
                "time_to_first_token_s (prefill + the forward of the first token), tokens_per_second "
                "(end to end: new_tokens / seconds, prefill included), decode_tokens_per_second "
                "(decoding alone: (new_tokens - 1) / (seconds - time_to_first_token_s)), drafted, accepted, "
                "acceptance_rate, drafted_at, accepted_at, acceptance_at (per draft position within a round; "
                "speculative decoding without --tree), rollbacks, rounds, forwards, cache_seconds, peak_cache_bytes, "
                "prefix_hit_tokens (prompt tokens restored from --prefix-cache), seed (null when greedy), threads");

  int verify_repeats = 1;
  auto* ver = app.add_subcommand("verify", "check that speculative decoding equals greedy decoding");
  ver->add_option("-m,--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  add_prompt_options(ver);
  add_prompts_option(ver,
                     "decode every line of FILE ('-' = standard input) speculatively, in batches of at most "
                     "--max-batch sequences, and check "
                     "each against greedy decoding of that prompt alone; exit 1 names the first divergence "
                     "(prompt and position)");
  ver->add_option("-n,--max-new-tokens", max_new, "token budget")->check(max_new_range);
  add_draft_options(ver);
  ver->add_option("--repeats", verify_repeats,
                  "decode greedily and speculatively this many times each, alternating; every run is "
                  "checked and tok/s (end to end, prefill included) are medians")
      ->check(integer_in(1, 100));
  add_threads_option(ver);
  add_ctx_option(ver);

  auto* evl = app.add_subcommand("eval", "bits per byte of a text file under a model (teacher forcing)");
  evl->add_option("-m,--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  evl->add_option("--text", text_path, "text file, scored byte by byte")->required()->check(CLI::ExistingFile);
  evl->add_option("--chunk", chunk, "tokens per forward (the result does not depend on it)")
      ->check(integer_in(1, std::int64_t{1} << 30));
  evl->add_option("--context", context,
                  "bytes per segment: each is fed as its own sequence (BOS + bytes) through a fresh cache; "
                  "0 = the whole file as one sequence")
      ->check(integer_in(0, std::numeric_limits<std::int64_t>::max()));
  add_threads_option(evl);

  auto* ins = app.add_subcommand("inspect", "describe a model's layers and memory");
  ins->add_option("-m,--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  ins->add_option("--rollback", rollback, "R for the rollback-memory figure")
      ->check(integer_in(0, std::numeric_limits<std::int64_t>::max()));

  std::string bench_json;
  int repeats = 3;
  std::vector<std::int64_t> bench_ks, bench_batches;
  std::int64_t bench_max_new = 128;
  auto* ben = app.add_subcommand("bench", "tokens/s of greedy and speculative decoding over a fixed prompt set");
  ben->add_option("-m,--model", model_dir, "target model directory")->required()->check(CLI::ExistingDirectory);
  ben->add_option("--draft", choice.draft_dir, "draft model directory (none: no draft-model rows)")
      ->check(CLI::ExistingDirectory)
      ->default_str("none");
  ben->add_option("-n,--max-new-tokens", bench_max_new, "tokens per prompt")->check(integer_in(1, std::int64_t{1} << 20));
  ben->add_option("--repeats", repeats, "runs per configuration (median reported)")->check(integer_in(1, 100));
  ben->add_option("--batch", bench_batches,
                  "batch sizes to add, comma-separated: B prompts decoded together (greedy, and with --draft "
                  "speculatively at the first K), aggregate tokens/s")
      ->delimiter(',')
      ->check(integer_in(1, 4096))
      ->default_str("none");
  ben->add_option("--tree", choice.tree_width,
                  "also rows draft_tree / lookup_tree: tree speculation with W children per node, depth each K")
      ->check(integer_in(2, 64))
      ->default_str("off");
  ben->add_option("--tree-nodes", choice.tree_nodes, "with --tree: at most N nodes per round")->check(integer_in(2, 1024));
  ben->add_option("--k", bench_ks, "draft lengths to try, comma-separated")
      ->delimiter(',')
      ->check(integer_in(1, 64))
      ->default_str("2,3,4,5,6,7,8");
  ben->add_option("--json", bench_json, "also write the rows as JSON to this file")->default_str("none");
  add_threads_option(ben);

  std::int64_t cost_max_q = 8, cost_context = 128;
  int cost_samples = 200;
  std::vector<std::int64_t> cost_batches;
  auto* cst = app.add_subcommand("forward-cost", "what a forward of q tokens costs, in one-token forwards (the "
                                                 "verification term of speculative decoding)");
  cst->add_option("-m,--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  cst->add_option("--max-q", cost_max_q, "q from 1 to this")->check(integer_in(1, 64));
  cst->add_option("--context", cost_context, "tokens in the cache before each forward")
      ->check(integer_in(1, std::int64_t{1} << 20));
  cst->add_option("--samples", cost_samples, "forwards timed per q (median reported)")->check(integer_in(1, 1 << 20));
  cst->add_option("--batch", cost_batches,
                  "batch sizes, comma-separated: also time decoding rounds of B sequences (one token each, every "
                  "sequence holding --context tokens) and print each round, its cost per token and its gain "
                  "(B x the one-sequence round / this round)")
      ->delimiter(',')
      ->check(integer_in(1, 4096));
  add_threads_option(cst);

  std::string snapshot_out, snapshot_file;
  auto* snp = app.add_subcommand("snapshot", "save, inspect or load a sequence's whole state as a file");
  snp->require_subcommand(1);
  auto* snp_save = snp->add_subcommand("save", "prefill a prompt and write the state (with the logits of its last "
                                                "token) to a snapshot file");
  snp_save->add_option("-m,--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  add_prompt_options(snp_save);
  snp_save->add_option("--out", snapshot_out, "snapshot file to write (written whole, then renamed into place)")
      ->required();
  add_threads_option(snp_save);
  add_ctx_option(snp_save);
  auto* snp_inspect = snp->add_subcommand("inspect", "validate a snapshot file (every checksum) and describe it");
  snp_inspect->add_option("--file", snapshot_file, "snapshot file")->required();
  auto* snp_load = snp->add_subcommand("load", "restore a snapshot file and continue generating from it (same "
                                                "tokens as generating from its prompt)");
  snp_load->add_option("-m,--model", model_dir, "model directory (must be the snapshot's model)")
      ->required()
      ->check(CLI::ExistingDirectory);
  snp_load->add_option("--file", snapshot_file, "snapshot file")->required();
  snp_load->add_option("-n,--max-new-tokens", max_new, "token budget")->check(max_new_range);
  add_sampling_options(snp_load);
  snp_load->add_flag("--stats", stats, "end with one JSON line of figures (as generate --stats)");
  add_threads_option(snp_load);
  add_ctx_option(snp_load);

  auto* ini = app.add_subcommand("init-random", "write a model with random weights");
  ini->add_option("--config", config_path, "config.json to use")->required()->check(CLI::ExistingFile);
  ini->add_option("--out", out_dir, "output directory (refused if it already holds a model, unless --force)")
      ->required();
  ini->add_option("-s,--seed", init_seed, "random seed")->required()->check(unsigned_integer())->default_str("");
  ini->add_option("--dtype", dtype, "f32, f16 or bf16");
  ini->add_flag("--force", force,
                "overwrite the model in --out; its model card (README.md) is replaced and training.json removed");

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::string usage = diagnose_usage(app, argc, argv);
    if (usage.empty()) {
      app.exit(e);
    } else {
      std::fprintf(stderr, "rewind: error: %s\n", usage.c_str());
    }
    return 2;
  }
  try {
    set_threads(threads);
    if (*gen) return run_generate(*gen, model_dir, prompt, max_new, choice, sampling, prefix, stats, ctx_size);
    if (*ver) return run_verify(*ver, model_dir, prompt, max_new, choice, verify_repeats, ctx_size);
    if (*evl) return run_eval(model_dir, text_path, chunk, context);
    if (*ins) return run_inspect(model_dir, rollback);
    if (*ini) return run_init_random(config_path, out_dir, init_seed, dtype, force);
    if (*snp_save) return run_snapshot_save(*snp_save, model_dir, prompt, snapshot_out, ctx_size);
    if (*snp_inspect) return run_snapshot_inspect(snapshot_file);
    if (*snp_load) return run_snapshot_load(*snp_load, model_dir, snapshot_file, max_new, sampling, stats, ctx_size);
    if (*ben) return run_bench(*ben, model_dir, choice, bench_max_new, repeats, bench_ks, bench_batches, bench_json);
    if (*cst) return run_forward_cost(model_dir, cost_max_q, cost_context, cost_samples, cost_batches);
  } catch (const rwd::Error& e) {
    std::fprintf(stderr, "rewind: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rewind: error: %s\n", e.what());
    return 2;
  }
  return 2;
}
