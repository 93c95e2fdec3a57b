// Running the rewind CLI from tests (cli_test.cc, cli_hostile_test.cc).
//
// ctest runs every test in a process of its own, several at a time, so all
// paths are per process: TempDir()/rewind_cli_<pid>/...
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#ifdef REWIND_CLI_PATH
namespace rwd::runtime::cli_test {

namespace fs = std::filesystem;

// This process's scratch directory (created on first use).
inline fs::path scratch_dir() {
  const fs::path dir = fs::path(::testing::TempDir()) / ("rewind_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A word for /bin/sh: `s` in single quotes.
inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

struct CliResult {
  int status = -1;  // exit status; -1 when the CLI died from a signal
  std::string out;  // stdout
  std::string err;  // stderr
  std::string all() const { return out + err; }
};

// Runs `env_prefix rewind args < stdin_path` through /bin/sh (args are shell
// words: quote paths and texts with quote()). stdout and stderr go to files,
// so the CLI sees neither as a terminal.
inline CliResult run_cli(const std::string& args, const std::string& stdin_path = "/dev/null",
                         const std::string& env_prefix = "") {
  const fs::path out = scratch_dir() / "stdout.txt", err = scratch_dir() / "stderr.txt";
  const std::string cmd = env_prefix + " " + quote(REWIND_CLI_PATH) + " " + args + " < " + quote(stdin_path) + " > " +
                          quote(out.string()) + " 2> " + quote(err.string());
  const int raw = std::system(cmd.c_str());
  CliResult r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

}  // namespace rwd::runtime::cli_test
#endif
