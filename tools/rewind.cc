// rewind: the command-line front end of the reference runtime.
//
//   rewind generate    stream text, greedy / sampled / speculative
//   rewind verify      compare speculative with greedy decoding token by token
//   rewind eval        bits per byte of a text file (teacher forcing, chunked)
//   rewind inspect     layers, parameters and memory of a model
//   rewind init-random write a model with random weights
//
// Exit status: 0 success, 1 verify found a divergence, 2 bad input (unknown
// flag, missing or malformed model, bad value).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

#include "rewind/error.h"
#include "runtime/decode_bench.h"
#include "runtime/eval.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/model_config.h"
#include "runtime/weights_io.h"

namespace {

using namespace rwd;
using namespace rwd::runtime;
using Clock = std::chrono::steady_clock;

// A line on stderr at most once a second, only once work has taken a second.
class Progress {
 public:
  explicit Progress(std::string what) : what_(std::move(what)), start_(Clock::now()), last_(start_) {}
  void update(std::int64_t done, std::int64_t total) {
    const auto now = Clock::now();
    if (now - last_ < std::chrono::seconds(1)) return;
    last_ = now;
    shown_ = true;
    const double s = std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "\r%s: %lld/%lld tokens, %.1f s, %.1f tok/s   ", what_.c_str(), static_cast<long long>(done),
                 static_cast<long long>(total), s, static_cast<double>(done) / s);
    std::fflush(stderr);
  }
  ~Progress() {
    if (shown_) std::fprintf(stderr, "\n");
  }

 private:
  std::string what_;
  Clock::time_point start_, last_;
  bool shown_ = false;
};

// A progress bar on stderr, redrawn at most 5 times a second and only once
// the work has taken half a second; cleared by a newline at the end.
class ProgressBar {
 public:
  explicit ProgressBar(std::string what) : what_(std::move(what)), start_(Clock::now()), last_(start_) {}
  void update(std::int64_t done, std::int64_t total) {
    const auto now = Clock::now();
    if (done < total && (now - last_ < std::chrono::milliseconds(200) || now - start_ < std::chrono::milliseconds(500))) {
      return;
    }
    last_ = now;
    shown_ = true;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<std::size_t>(filled), '=');
    if (filled < kWidth) bar += '>' + std::string(static_cast<std::size_t>(kWidth - filled - 1), ' ');
    const double rate = s > 0 ? static_cast<double>(done) / s : 0.0;
    const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0.0;
    std::fprintf(stderr, "\r%s [%s] %3.0f%% %lld/%lld, %.0f/s, %.0f s, ETA %.0f s  ", what_.c_str(), bar.c_str(),
                 100.0 * frac, static_cast<long long>(done), static_cast<long long>(total), rate, s, eta);
    std::fflush(stderr);
  }
  ~ProgressBar() {
    if (shown_) std::fprintf(stderr, "\n");
  }

 private:
  std::string what_;
  Clock::time_point start_, last_;
  bool shown_ = false;
};

struct DraftChoice {
  std::string draft_dir;
  std::int64_t lookup = 0;
  std::int64_t num_draft = 4;
  bool adaptive = false;
  bool any() const { return !draft_dir.empty() || lookup > 0; }
};

void check_prompt_text(const std::string& prompt) {
  if (prompt.empty()) throw InvalidArgument("--prompt is empty; give some text to continue");
}

std::optional<Model> load_draft(const DraftChoice& choice, const Model& target) {
  if (choice.draft_dir.empty()) return std::nullopt;
  Model draft = Model::load(choice.draft_dir);
  const ModelConfig& t = target.config();
  const ModelConfig& d = draft.config();
  if (d.vocab_size != t.vocab_size || d.bos_token_id != t.bos_token_id || d.eos_token_id != t.eos_token_id) {
    throw InvalidArgument("draft model " + choice.draft_dir + " is incompatible with the target: vocabulary " +
                          std::to_string(d.vocab_size) + " (BOS " + std::to_string(d.bos_token_id) + ", EOS " +
                          std::to_string(d.eos_token_id) + ") vs " + std::to_string(t.vocab_size) + " (BOS " +
                          std::to_string(t.bos_token_id) + ", EOS " + std::to_string(t.eos_token_id) + ")");
  }
  return draft;
}

std::unique_ptr<DraftSource> make_source(const DraftChoice& choice, const std::optional<Model>& draft,
                                         const SamplingParams& sampling) {
  if (draft) return std::make_unique<ModelDraft>(*draft, sampling, choice.num_draft);
  return std::make_unique<LookupDraft>(choice.lookup);
}

void check_num_draft(std::int64_t k) {
  if (k < 1 || k > 64) throw InvalidArgument("--num-draft must be in [1, 64], got " + std::to_string(k));
}

int run_generate(const std::string& model_dir, const std::string& prompt, std::int64_t max_new,
                 const DraftChoice& choice, const SamplingParams& sampling, bool stats_wanted) {
  check_prompt_text(prompt);
  check_num_draft(choice.num_draft);
  validate(sampling);
  const Model model = Model::load(model_dir);
  const std::optional<Model> draft = load_draft(choice, model);
  const std::vector<std::int32_t> tokens = encode_prompt(prompt, model.config());
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.sampling = sampling;
  options.on_token = [](std::int32_t t) {
    if (t < 256) {
      std::fputc(t, stdout);
      std::fflush(stdout);
    }
  };
  GenerationStats stats;
  if (choice.any()) {
    auto source = make_source(choice, draft, sampling);
    speculative_generate(model, *source, tokens, options, {choice.num_draft, choice.adaptive}, &stats);
  } else {
    generate(model, tokens, options, &stats);
  }
  std::fputc('\n', stdout);
  if (stats_wanted) std::printf("%s\n", stats.to_json().c_str());
  return 0;
}

// Decodes greedily and speculatively `repeats` times each, alternating (so
// that a burst of load on a shared machine hits both), checks every
// speculative run against the greedy output token by token and reports the
// median tokens/s of each.
int run_verify(const std::string& model_dir, const std::string& prompt, std::int64_t max_new,
               const DraftChoice& choice, int repeats) {
  check_prompt_text(prompt);
  check_num_draft(choice.num_draft);
  if (!choice.any()) throw InvalidArgument("verify needs a draft source: --draft DIR or --lookup N");
  const Model model = Model::load(model_dir);
  const std::optional<Model> draft = load_draft(choice, model);
  const std::vector<std::int32_t> tokens = encode_prompt(prompt, model.config());
  GenerationOptions options;
  options.max_new_tokens = max_new;
  GenerationStats greedy_stats, spec_stats;
  std::vector<std::int32_t> greedy;
  std::vector<double> greedy_rates, spec_rates;
  for (int run = 1; run <= repeats; ++run) {
    const std::string suffix = repeats > 1 ? " " + std::to_string(run) + "/" + std::to_string(repeats) : "";
    {
      Progress progress("greedy" + suffix);
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
      Progress progress("speculative" + suffix);
      std::int64_t n = 0;
      options.on_token = [&](std::int32_t) { progress.update(++n, max_new); };
      auto source = make_source(choice, draft, options.sampling);
      spec = speculative_generate(model, *source, tokens, options, {choice.num_draft, choice.adaptive}, &spec_stats);
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
              "(%lld/%lld), %lld rounds, %lld rollbacks%s\n",
              greedy.size(), g, sp, g > 0 ? sp / g : 0.0, spec_stats.acceptance_rate(),
              static_cast<long long>(spec_stats.accepted), static_cast<long long>(spec_stats.drafted),
              static_cast<long long>(spec_stats.rounds), static_cast<long long>(spec_stats.rollbacks),
              repeats > 1 ? ("; tok/s are medians of " + std::to_string(repeats) + " runs each").c_str() : "");
  return 0;
}

int run_eval(const std::string& model_dir, const std::string& text_path, std::int64_t chunk, std::int64_t context) {
  if (chunk < 1) throw InvalidArgument("--chunk must be >= 1, got " + std::to_string(chunk));
  if (context < 0) throw InvalidArgument("--context must be >= 0 (0 = the whole file), got " + std::to_string(context));
  std::ifstream in(text_path, std::ios::binary);
  if (!in) throw Error("cannot open " + text_path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  if (text.empty()) throw InvalidArgument(text_path + " is empty");
  const Model model = Model::load(model_dir);
  EvalOptions options;
  options.chunk = chunk;
  options.context = context;
  EvalResult r;
  {
    ProgressBar bar("eval bytes");
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
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024.0 && u < 3) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

int run_inspect(const std::string& model_dir, std::int64_t rollback) {
  if (rollback < 0) throw InvalidArgument("--rollback must be >= 0, got " + std::to_string(rollback));
  const Model model = Model::load(model_dir);
  const ModelConfig& c = model.config();
  std::printf("model %s: %s, %lld layers, hidden %lld, vocab %lld, weights stored as %s\n", model_dir.c_str(),
              c.model_type.c_str(), static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.vocab_size), std::string(dtype_name(c.torch_dtype)).c_str());
  std::printf("parameters: %lld\n", static_cast<long long>(model.parameter_count()));
  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    const std::string& t = c.layer_types[i];
    std::string detail;
    if (t == "full_attention" || t == "sliding_attention") {
      detail = std::to_string(c.num_attention_heads) + " heads / " + std::to_string(c.num_key_value_heads) +
               " kv heads x " + std::to_string(c.head_dim);
      if (t == "sliding_attention") detail += ", window " + std::to_string(c.sliding_window);
    } else if (t == "linear_attention") {
      detail = "Gated DeltaNet, conv " + std::to_string(c.linear_conv_dim()) + " x K=" +
               std::to_string(c.linear_conv_kernel_dim) + ", state [" + std::to_string(c.linear_num_value_heads) +
               ", " + std::to_string(c.linear_key_head_dim) + ", " + std::to_string(c.linear_value_head_dim) + "]";
    } else if (t == "conv") {
      detail = "short conv, " + std::to_string(c.hidden_size) + " channels x K=" + std::to_string(c.conv_L_cache);
    }
    std::printf("  layer %2zu  %-18s %s\n", i, t.c_str(), detail.c_str());
  }
  std::printf("KV bytes per token (full + sliding layers, f32): %s\n",
              human_bytes(static_cast<double>(model.kv_bytes_per_token())).c_str());
  std::printf("fixed state bytes per sequence (conv + recurrent + sliding windows): %s\n",
              human_bytes(static_cast<double>(model.fixed_state_bytes())).c_str());
  std::printf("rollback memory for R = %lld: at most %s more\n", static_cast<long long>(rollback),
              human_bytes(static_cast<double>(model.rollback_bytes(rollback))).c_str());
  return 0;
}

int run_bench(const std::string& model_dir, const std::string& draft_dir, std::int64_t max_new, int repeats,
              const std::vector<std::int64_t>& ks, const std::string& json_path) {
  const Model model = Model::load(model_dir);
  DraftChoice choice;
  choice.draft_dir = draft_dir;
  const std::optional<Model> draft = load_draft(choice, model);
  DecodeBenchOptions options;
  options.max_new_tokens = max_new;
  options.repeats = repeats;
  if (!ks.empty()) options.ks = ks;
  const auto rows = run_decode_bench(model, draft ? &*draft : nullptr, options, [](const std::string& line) {
    std::fprintf(stderr, "bench: %s\n", line.c_str());
  });
  std::printf("%-8s %3s %12s %9s %11s %12s %10s\n", "method", "K", "tokens/s", "speedup", "acceptance",
              "cache share", "identical");
  bool all_identical = true;
  for (const auto& r : rows) {
    std::printf("%-8s %3lld %12.1f %8.2fx %11.3f %11.3f%% %10s\n", r.method.c_str(), static_cast<long long>(r.k),
                r.tokens_per_second, r.speedup, r.acceptance_rate, 100.0 * r.cache_share, r.identical ? "yes" : "NO");
    all_identical = all_identical && r.identical;
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << decode_bench_json(rows) << "\n";
    if (!out) throw Error("cannot write " + json_path);
  }
  return all_identical ? 0 : 1;
}

int run_init_random(const std::string& config_path, const std::string& out_dir, std::uint64_t seed,
                    const std::string& dtype) {
  const ModelConfig config = load_model_config(config_path);
  write_random_model(config, out_dir, seed, parse_dtype(dtype));
  std::printf("wrote %s/config.json and %s/model.safetensors (seed %llu, %s)\n", out_dir.c_str(), out_dir.c_str(),
              static_cast<unsigned long long>(seed), dtype.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"rewind: reference runtime for exact-rollback inference caches"};
  app.require_subcommand(1);

  std::string model_dir, prompt, draft_dir, config_path, out_dir, dtype = "f32", text_path;
  std::int64_t max_new = 128, rollback = 8, chunk = 128, context = 512;
  std::uint64_t seed = 0;
  bool stats = false;
  DraftChoice choice;
  SamplingParams sampling;

  auto add_draft_options = [&](CLI::App* cmd) {
    auto* d = cmd->add_option("--draft", choice.draft_dir, "draft model directory")->check(CLI::ExistingDirectory);
    auto* l = cmd->add_option("--lookup", choice.lookup, "prompt lookup with n-grams up to N")->check(CLI::Range(1, 64));
    d->excludes(l);
    cmd->add_option("--num-draft", choice.num_draft, "draft tokens per round K (1..64)");
    cmd->add_flag("--adaptive", choice.adaptive, "adapt K from the acceptance (K is the maximum)");
  };

  auto* gen = app.add_subcommand("generate", "generate text (greedy, sampled or speculative)");
  gen->add_option("--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  gen->add_option("--prompt", prompt, "prompt text")->required();
  gen->add_option("--max-new-tokens", max_new, "token budget")->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  add_draft_options(gen);
  gen->add_option("--temperature", sampling.temperature, "0 = greedy");
  gen->add_option("--top-k", sampling.top_k, "0 = off");
  gen->add_option("--top-p", sampling.top_p, "1 = off");
  gen->add_option("--seed", sampling.seed, "sampling seed");
  gen->add_flag("--stats", stats, "end with one JSON line of statistics");

  int verify_repeats = 1;
  auto* ver = app.add_subcommand("verify", "check that speculative decoding equals greedy decoding");
  ver->add_option("--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  ver->add_option("--prompt", prompt, "prompt text")->required();
  ver->add_option("--max-new-tokens", max_new, "token budget")->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  add_draft_options(ver);
  ver->add_option("--repeats", verify_repeats,
                  "decode greedily and speculatively this many times each, alternating; every run is "
                  "checked and tok/s are medians")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();

  auto* evl = app.add_subcommand("eval", "bits per byte of a text file under a model (teacher forcing)");
  evl->add_option("--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  evl->add_option("--text", text_path, "text file, scored byte by byte")->required()->check(CLI::ExistingFile);
  evl->add_option("--chunk", chunk, "tokens per forward (the result does not depend on it)")->capture_default_str();
  evl->add_option("--context", context,
                  "bytes per segment: each is fed as its own sequence (BOS + bytes) through a fresh cache; "
                  "0 = the whole file as one sequence")
      ->capture_default_str();

  auto* ins = app.add_subcommand("inspect", "describe a model's layers and memory");
  ins->add_option("--model", model_dir, "model directory")->required()->check(CLI::ExistingDirectory);
  ins->add_option("--rollback", rollback, "R for the rollback-memory figure");

  std::string bench_json;
  int repeats = 3;
  std::vector<std::int64_t> bench_ks;
  auto* ben = app.add_subcommand("bench", "tokens/s of greedy and speculative decoding over a fixed prompt set");
  ben->add_option("--model", model_dir, "target model directory")->required()->check(CLI::ExistingDirectory);
  ben->add_option("--draft", choice.draft_dir, "draft model directory")->check(CLI::ExistingDirectory);
  ben->add_option("--max-new-tokens", max_new, "tokens per prompt")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  ben->add_option("--repeats", repeats, "runs per configuration (median reported)")->check(CLI::Range(1, 100));
  ben->add_option("--k", bench_ks, "draft lengths to try (default 2..8)")->delimiter(',');
  ben->add_option("--json", bench_json, "also write the rows as JSON to this file");

  auto* ini = app.add_subcommand("init-random", "write a model with random weights");
  ini->add_option("--config", config_path, "config.json to use")->required()->check(CLI::ExistingFile);
  ini->add_option("--out", out_dir, "output directory")->required();
  ini->add_option("--seed", seed, "random seed")->required();
  ini->add_option("--dtype", dtype, "f32, f16 or bf16");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  try {
    if (*gen) return run_generate(model_dir, prompt, max_new, choice, sampling, stats);
    if (*ver) return run_verify(model_dir, prompt, max_new, choice, verify_repeats);
    if (*evl) return run_eval(model_dir, text_path, chunk, context);
    if (*ins) return run_inspect(model_dir, rollback);
    if (*ini) return run_init_random(config_path, out_dir, seed, dtype);
    if (*ben) return run_bench(model_dir, choice.draft_dir, max_new, repeats, bench_ks, bench_json);
  } catch (const rwd::Error& e) {
    std::fprintf(stderr, "rewind: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rewind: error: %s\n", e.what());
    return 2;
  }
  return 2;
}
