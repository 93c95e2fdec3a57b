// rewind init-random: write a model with random weights.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common.h"
#include "rewind/error.h"
#include "runtime/model_config.h"
#include "runtime/weights_io.h"

namespace rwd::cli {
namespace {

namespace fs = std::filesystem;

struct InitRandomFlags {
  std::string config_path, out_dir, dtype = "f32";
  std::uint64_t seed = 0;
  bool force = false;
};

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

}  // namespace

Command add_init_random_command(CLI::App& app, SharedFlags&) {
  auto flags = std::make_shared<InitRandomFlags>();
  InitRandomFlags& f = *flags;
  auto* ini = app.add_subcommand("init-random", "write a model with random weights");
  ini->add_option("--config", f.config_path, "config.json to use")->required()->check(CLI::ExistingFile);
  ini->add_option("--out", f.out_dir, "output directory (refused if it already holds a model, unless --force)")
      ->required();
  ini->add_option("-s,--seed", f.seed, "random seed")->required()->check(unsigned_integer())->default_str("");
  ini->add_option("--dtype", f.dtype, "f32, f16 or bf16");
  ini->add_flag("--force", f.force,
                "overwrite the model in --out; its model card (README.md) is replaced and training.json removed");
  return {ini, [flags] {
            const InitRandomFlags& o = *flags;
            return run_init_random(o.config_path, o.out_dir, o.seed, o.dtype, o.force);
          }};
}

}  // namespace rwd::cli
