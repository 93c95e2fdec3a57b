// rewind: the command-line front end of the reference runtime.
//
//   rewind generate    stream text, greedy / sampled / speculative
//   rewind verify      compare speculative with greedy decoding token by token
//   rewind eval        bits per byte of a text file (teacher forcing, chunked)
//   rewind inspect     layers, parameters and memory of a model
//   rewind bench       tokens/s of greedy and speculative decoding
//   rewind forward-cost the cost of a q-token forward in one-token forwards
//   rewind snapshot    save, inspect or load a sequence's state as a file
//   rewind init-random write a model with random weights
//   rewind quantize    write a model's Q8 checkpoint
//
// Each subcommand is a file of tools/ with one registration function
// (common.h); this file parses the command line and runs the chosen one.
//
// Short flags as llama.cpp's llama-cli spells them: -m --model, -p --prompt,
// -n --max-new-tokens, -t --threads, -s --seed, -c --ctx-size; --version.
//
// Exit status: 0 success, 1 verify or bench found a divergence, 2 bad input
// (unknown flag or subcommand, with the nearest known one; missing or
// malformed model, bad value, a flag that would have no effect, a run past
// the context length).
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common.h"
#include "rewind/error.h"

// CMake's project() version (tools/CMakeLists.txt passes it in);
// Cli.VersionPrintsTheProjectVersion checks it against CMakeLists.txt.
#ifndef REWIND_VERSION
#error "REWIND_VERSION must be defined by the build (tools/CMakeLists.txt)"
#endif

namespace rwd::cli {

// The registration function of each subcommand, in its own file.
Command add_generate_command(CLI::App& app, SharedFlags& shared);
Command add_verify_command(CLI::App& app, SharedFlags& shared);
Command add_eval_command(CLI::App& app, SharedFlags& shared);
Command add_inspect_command(CLI::App& app, SharedFlags& shared);
Command add_bench_command(CLI::App& app, SharedFlags& shared);
Command add_forward_cost_command(CLI::App& app, SharedFlags& shared);
Command add_snapshot_command(CLI::App& app, SharedFlags& shared);
Command add_init_random_command(CLI::App& app, SharedFlags& shared);
Command add_quantize_command(CLI::App& app, SharedFlags& shared);
Command add_pack_command(CLI::App& app, SharedFlags& shared);
#ifdef REWIND_HAVE_SERVER
Command add_serve_command(CLI::App& app, SharedFlags& shared);
#endif

}  // namespace rwd::cli

int main(int argc, char** argv) {
  using namespace rwd::cli;
  CLI::App app{"rewind: reference runtime for exact-rollback inference caches"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("rewind ") + REWIND_VERSION, "print the version and exit");
  // Every option's help line shows its default (subcommands copy this).
  app.option_defaults()->always_capture_default();
  app.footer(
      "Threads: one OpenMP thread unless --threads N or the environment variable OMP_NUM_THREADS says otherwise "
      "(OpenMP's one-thread-per-core default made small models several times slower on a busy machine).\n"
      "Exit status: 0 success, 1 verify/bench found a divergence, 2 bad input or usage.");

  // In the order `rewind --help` lists them.
  SharedFlags shared;
  std::vector<Command> commands = {
      add_generate_command(app, shared), add_verify_command(app, shared),      add_eval_command(app, shared),
      add_inspect_command(app, shared),  add_bench_command(app, shared),       add_forward_cost_command(app, shared),
      add_snapshot_command(app, shared), add_init_random_command(app, shared), add_quantize_command(app, shared),
      add_pack_command(app, shared),
  };
#ifdef REWIND_HAVE_SERVER
  commands.push_back(add_serve_command(app, shared));
#endif

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
    set_threads(shared.threads);
    set_load_options(shared.weights, shared.no_pack);
    for (const Command& command : commands) {
      if (*command.app) return command.run();
    }
  } catch (const rwd::Error& e) {
    std::fprintf(stderr, "rewind: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rewind: error: %s\n", e.what());
    return 2;
  }
  return 2;
}
