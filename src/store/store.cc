#include "rewind/store.h"

#include <cstdio>

#include "store/store_util.h"

namespace rwd {
namespace {

constexpr std::size_t kMaxKeyLength = 200;

bool key_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '-';
}

}  // namespace

namespace detail {

bool valid_store_key(const std::string& key) {
  if (key.empty() || key.size() > kMaxKeyLength || key[0] == '.') return false;
  for (const char c : key) {
    if (!key_char(c)) return false;
  }
  return true;
}

std::string printable(const std::string& text) {
  constexpr std::size_t kShown = 80;
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    }
  }
  if (text.size() > kShown) out += "... (" + std::to_string(text.size()) + " characters)";
  return out;
}

std::string format_bytes(std::size_t bytes) {
  constexpr std::size_t kKiB = 1024;
  constexpr std::size_t kMiB = kKiB * kKiB;
  if (bytes >= kMiB && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + " MiB";
  if (bytes >= kKiB && bytes % kKiB == 0) return std::to_string(bytes / kKiB) + " KiB";
  return std::to_string(bytes) + " bytes";
}

void check_store_value_size(const std::string& store, const std::string& key, std::size_t bytes) {
  if (static_cast<std::uint64_t>(bytes) > kMaxStoreValueBytes) {
    throw InvalidArgument(store + ": put of key '" + key + "' with a value of " + std::to_string(bytes) +
                          " bytes; values may be at most 2^32 = " + std::to_string(kMaxStoreValueBytes) + " bytes");
  }
}

}  // namespace detail

std::optional<std::vector<std::byte>> BlobStore::get_bounded(const std::string& key, std::size_t max_bytes) {
  std::optional<std::vector<std::byte>> value = get(key);
  if (value && value->size() > max_bytes) {
    throw StoreValueError(describe() + ": get of key '" + detail::printable(key) + "': its value of " +
                          std::to_string(value->size()) + " bytes is over the limit of " + std::to_string(max_bytes) +
                          " bytes the caller accepts");
  }
  return value;
}

void check_store_key(const std::string& key) {
  const auto fail = [&](const std::string& why) {
    throw InvalidArgument("store key '" + detail::printable(key) + "' " + why +
                          "; a key is 1 to 200 characters from [A-Za-z0-9._:-], not starting with '.'");
  };
  if (key.empty()) fail("is empty");
  if (key.size() > kMaxKeyLength) fail("has " + std::to_string(key.size()) + " characters");
  for (std::size_t i = 0; i < key.size(); ++i) {
    if (!key_char(key[i])) fail("has a character outside the set at offset " + std::to_string(i));
  }
  if (key[0] == '.') fail("starts with '.'");
}

}  // namespace rwd
