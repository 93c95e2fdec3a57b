// rewind pack: write a model's pack file, which later loads map in place
// (runtime/pack_file.h, docs/model-format.md).
#include <cstdio>

#include "common.h"
#include "rewind/error.h"
#include "runtime/model.h"

namespace rwd::cli {
namespace {

int run_pack(const std::string& model_dir) {
  const Clock::time_point start = Clock::now();
  // Packing a large model takes seconds; stdout keeps the summary alone.
  std::fprintf(stderr, "pack: loading and packing %s\n", model_dir.c_str());
  const PackResult r = write_pack_file(model_dir, load_options());
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("wrote %s: %lld matrices as %s, %.2f MB (%.1f s); loads of %s map it while its files are unchanged\n",
              r.path.c_str(), static_cast<long long>(r.matrices), r.weights.c_str(),
              static_cast<double>(r.file_bytes) / 1e6, seconds, model_dir.c_str());
  return 0;
}

}  // namespace

Command add_pack_command(CLI::App& app, SharedFlags& shared) {
  auto model_dir = std::make_shared<std::string>();
  auto* p = app.add_subcommand("pack",
                               "write the model's matrices, packed as loading packs them, to a file in its directory "
                               "that later loads map instead of packing (docs/model-format.md)");
  add_model_option(p, *model_dir, "model directory to pack (the pack file is written into it)");
  p->add_option("--weights", shared.weights,
                "the weights to pack: as-stored or q8 (quantized as --weights q8 does at load); loads with the "
                "same --weights map the pack")
      ->check(CLI::IsMember({"as-stored", "q8"}))
      ->default_str("as the checkpoint holds them");
  return {p, [model_dir] { return run_pack(*model_dir); }};
}

}  // namespace rwd::cli
