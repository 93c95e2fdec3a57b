// Shared by the budget sweeps (budget_sweep_test.cc for Cache,
// budget_sweep_sequences_test.cc for SequenceCache).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {

// The smallest budget that lets the refused allocation through: what was
// reserved plus what it asked for, from "N more bytes were needed, M of the
// budget's ..." (or reset's "a new cache reserves N"). A message without
// figures (not a budget refusal) steps by the smallest unit.
inline std::size_t next_budget(const std::string& m, std::size_t b) {
  std::size_t out = b + 1;
  const std::string more = " more bytes were needed, ";
  if (auto at = m.find(more); at != std::string::npos) {
    std::size_t start = at;
    while (start > 0 && m[start - 1] >= '0' && m[start - 1] <= '9') --start;
    const std::size_t need = std::stoull(m.substr(start, at - start));
    const std::size_t reserved = std::stoull(m.substr(at + more.size()));
    out = reserved + need;
  } else if (auto r = m.find("a new cache reserves "); r != std::string::npos) {
    out = std::stoull(m.substr(r + 21));
  }
  return out > b ? out : b + 1;
}

// Mixes of 1..N layers: every prefix of the kinds in two orders, so each
// kind refuses first, last and in between.
inline std::vector<std::vector<LayerKind>> sweep_mixes() {
  std::vector<LayerKind> kinds = kEveryLayerKind;
  std::vector<std::vector<LayerKind>> out;
  for (int order = 0; order < 2; ++order) {
    for (std::size_t n = 1; n <= kinds.size(); ++n) {
      // A cache of moe / mlp layers only keeps nothing (and allocates nothing).
      if (std::all_of(kinds.begin(), kinds.begin() + static_cast<long>(n),
                      [](LayerKind k) { return k == LayerKind::Moe || k == LayerKind::Mlp; }))
        continue;
      out.emplace_back(kinds.begin(), kinds.begin() + static_cast<long>(n));
    }
    std::reverse(kinds.begin(), kinds.end());
  }
  return out;
}

}  // namespace rwt
