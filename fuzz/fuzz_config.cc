// libFuzzer target: config.json parsing and validation on arbitrary text.
// Every input either parses into a config that survives a to_json round
// trip and whose weight list can be computed, or raises rwd::FormatError.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "rewind/error.h"
#include "runtime/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const rwd::runtime::ModelConfig config = rwd::runtime::parse_model_config(text, "fuzz/config.json");
    const rwd::runtime::ModelConfig again = rwd::runtime::parse_model_config(rwd::runtime::to_json(config), "again");
    if (!(again == config)) std::abort();
    (void)rwd::runtime::expected_weights(config);
  } catch (const rwd::FormatError&) {
  }
  return 0;
}
