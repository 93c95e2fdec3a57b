// rewind quantize: write a model's Q8 checkpoint (docs/quantization.md).
#include <cstdio>
#include <filesystem>

#include "common.h"
#include "rewind/error.h"
#include "runtime/weights_io.h"

namespace rwd::cli {
namespace {

struct QuantizeFlags {
  std::string model_dir, out_dir, weights = "q8";
};

int run_quantize(const QuantizeFlags& f) {
  const Clock::time_point start = Clock::now();
  // One line per tensor group on stderr: a large model takes seconds per
  // layer, and stdout keeps the summary alone.
  const QuantizeResult r = write_q8_checkpoint(
      f.model_dir, f.out_dir, [](std::int64_t done, std::int64_t total, const std::string& group) {
        std::fprintf(stderr, "quantize: %lld/%lld %s\n", static_cast<long long>(done), static_cast<long long>(total),
                     group.c_str());
      });
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("wrote %s: %lld matrices as q8, %lld other tensors as stored, model.safetensors %.2f MB (%.1f s)\n",
              f.out_dir.c_str(), static_cast<long long>(r.quantized), static_cast<long long>(r.kept),
              static_cast<double>(r.file_bytes) / 1e6, seconds);
  return 0;
}

}  // namespace

Command add_quantize_command(CLI::App& app, SharedFlags&) {
  auto flags = std::make_shared<QuantizeFlags>();
  QuantizeFlags& f = *flags;
  auto* q = app.add_subcommand("quantize",
                               "write a model's Q8 checkpoint, which loads as q8 without re-quantizing "
                               "(docs/quantization.md)");
  add_model_option(q, f.model_dir, "model directory to quantize (f32, bf16 or f16 weights)");
  q->add_option("--out", f.out_dir,
                "output directory: must not exist or be empty; written into a temporary directory beside it, "
                "then renamed")
      ->required();
  q->add_option("--weights", f.weights, "the format to write (q8 only, for now)")->check(CLI::IsMember({"q8"}));
  return {q, [flags] { return run_quantize(*flags); }};
}

}  // namespace rwd::cli
