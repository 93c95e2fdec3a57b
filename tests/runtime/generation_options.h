// tests/runtime/generation_options.h: GenerationOptions with the speculation
// or tree set, for tests that hold those apart from the other options.
#pragma once

#include "runtime/generate.h"

namespace rwd::runtime {

// `options` with options.speculation = spec.
inline GenerationOptions with_chain(GenerationOptions options, const SpeculativeOptions& spec) {
  options.speculation = spec;
  return options;
}

// `options` with options.tree = tree.
inline GenerationOptions with_tree(GenerationOptions options, const TreeOptions& tree) {
  options.tree = tree;
  return options;
}

}  // namespace rwd::runtime
