// Built by tests/install/install_test.sh against an installed rewind, with a
// newer standard than the headers' C++20 minimum: prints __cplusplus (the
// installed package must not pin -std=c++20) and catches, through the base
// class, an error thrown inside librewind.so.
#include <cstdio>

#include "rewind/cache.h"
#include "rewind/error.h"

int main() {
  std::printf("__cplusplus %ld\n", static_cast<long>(__cplusplus));
  rwd::LayerOptions options;
  options.num_kv_heads = 1;
  options.key_dim = 4;
  rwd::Cache cache({"full_attention"}, options);
  try {
    cache.layer(7);  // IndexError, thrown in the library
  } catch (const rwd::Error& e) {
    const bool index_error = dynamic_cast<const rwd::IndexError*>(&e) != nullptr;
    std::printf("caught rwd::Error (%s): %s\n", index_error ? "IndexError" : "other type", e.what());
    return index_error ? 0 : 1;
  }
  std::printf("no exception\n");
  return 1;
}
