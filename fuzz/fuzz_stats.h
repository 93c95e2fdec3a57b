// Path counters of a fuzz target: REWIND_FUZZ_STATS=1 prints how often each
// path ran when the process ends (docs/reliability.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>

namespace rwt {

template <std::size_t N>
class FuzzStats {
 public:
  explicit FuzzStats(const char* const (&names)[N]) : names_(names) {}
  FuzzStats(const FuzzStats&) = delete;
  FuzzStats& operator=(const FuzzStats&) = delete;
  ~FuzzStats() {
    if (std::getenv("REWIND_FUZZ_STATS") == nullptr) return;
    for (std::size_t i = 0; i < N; ++i) std::fprintf(stderr, "%12llu  %s\n", counts_[i], names_[i]);
  }
  void count(std::size_t path, unsigned long long by = 1) { counts_[path] += by; }

 private:
  const char* const (&names_)[N];
  std::array<unsigned long long, N> counts_{};
};

}  // namespace rwt
