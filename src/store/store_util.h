// Helpers shared by the store backends (src/store/*.cc and the Redis
// library in src/store/redis/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace rwd::detail {

// The largest value a store accepts (rewind/store.h).
inline constexpr std::uint64_t kMaxStoreValueBytes = std::uint64_t{1} << 32;

// True when `key` follows the rule check_store_key enforces.
bool valid_store_key(const std::string& key);

// Throws InvalidArgument naming `store` and `key` when `bytes` passes
// kMaxStoreValueBytes.
void check_store_value_size(const std::string& store, const std::string& key, std::size_t bytes);

// `text` for a message: printable ASCII kept, other bytes as \xNN, cut to
// about 80 characters, so that a hostile key cannot flood a log.
std::string printable(const std::string& text);

// "64 MiB", "3 KiB", "100 bytes": a size for describe() and messages.
std::string format_bytes(std::size_t bytes);

}  // namespace rwd::detail
