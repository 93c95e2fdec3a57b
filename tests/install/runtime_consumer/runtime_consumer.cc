// Built by tests/install/install_test.sh against an installed runtime
// component: reads a model's config.json through librewind_runtime.so and
// prints its family and layer count.
#include <cstdio>

#include "runtime/model_config.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const rwd::runtime::ModelConfig config = rwd::runtime::load_model_config(argv[1]);
  std::printf("family %s, %zu layers\n", rwd::runtime::model_family_name(config.family), config.layer_types.size());
  return 0;
}
