// tools/usage.cc: "did you mean" messages for unknown subcommands and flags.
#include <algorithm>
#include <cctype>

#include "common.h"

namespace rwd::cli {
namespace {

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

}  // namespace

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

}  // namespace rwd::cli
