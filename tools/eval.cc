// rewind eval: bits per byte and perplexity of a text file (teacher forcing, runtime/eval.h).
#include <cstdio>
#include <sstream>

#include "common.h"
#include "rewind/error.h"
#include "runtime/eval.h"

namespace rwd::cli {
namespace {

struct EvalFlags {
  std::string model_dir, text_path;
  std::int64_t chunk = 128, context = 512, stride = 0;
};

// The scoring rules, their checks and their messages are evaluate_text's
// (runtime/eval.h); this reads the file and prints the figures.
int run_eval(const EvalFlags& f) {
  std::ifstream in = open_input_file("--text", f.text_path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  if (text.empty()) throw InvalidArgument(f.text_path + " is empty");
  const Model model = load_model(f.model_dir);
  const Tokenizer tokenizer = load_tokenizer(f.model_dir, model);
  EvalOptions options;
  options.chunk = f.chunk;
  options.context = f.context;
  options.stride = f.stride;
  EvalResult r;
  {
    Progress bar("eval", "tokens");
    options.on_progress = [&](std::int64_t done, std::int64_t total) { bar.update(done, total); };
    r = evaluate_text(model, tokenizer, text, options);
  }
  std::printf(
      "%s on %s: %.4f bits per byte, perplexity %.4f per token (%lld bytes, %lld tokens scored of %lld, "
      "%lld windows, chunk %lld; %.1f s, %.0f tokens/s)\n",
      f.model_dir.c_str(), f.text_path.c_str(), r.bits_per_byte(), r.perplexity(), static_cast<long long>(r.bytes),
      static_cast<long long>(r.tokens), static_cast<long long>(r.text_tokens), static_cast<long long>(r.segments),
      static_cast<long long>(f.chunk), r.seconds, r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0);
  return 0;
}

}  // namespace

Command add_eval_command(CLI::App& app, SharedFlags& shared) {
  auto flags = std::make_shared<EvalFlags>();
  EvalFlags& f = *flags;
  auto* evl = app.add_subcommand("eval", "bits per byte and perplexity of a text file under a model (teacher forcing)");
  add_model_option(evl, f.model_dir);
  evl->add_option("--text", f.text_path, "text file, scored token by token (the model's tokenizer)")
      ->required()
      ->check(CLI::ExistingFile);
  evl->add_option("--chunk", f.chunk, "tokens per forward (the result does not depend on it)")
      ->check(integer_in(1, std::int64_t{1} << 30));
  evl->add_option("--context", f.context,
                  "text tokens per window, each fed through a fresh cache after the tokenizer's prefix (BOS); "
                  "0 = the whole file as one window")
      ->check(integer_in(0, std::numeric_limits<std::int64_t>::max()));
  evl->add_option("--stride", f.stride,
                  "tokens each window moves on, in [1, --context]; earlier tokens of a window are context only "
                  "(default: --context, disjoint windows)")
      ->check(integer_in(0, std::numeric_limits<std::int64_t>::max()));
  add_weights_option(evl, shared);
  add_threads_option(evl, shared.threads);
  return {evl, [flags] { return run_eval(*flags); }};
}

}  // namespace rwd::cli
