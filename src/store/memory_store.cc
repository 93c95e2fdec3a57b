// The in-process store: an LRU list of values under one mutex.

#include <list>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>

#include "rewind/store.h"
#include "store/store_util.h"

namespace rwd {
namespace {

// Runs `fn`, reporting a refused allocation as CapacityError, as the library
// does everywhere (rewind/error.h).
template <typename Fn>
auto allocating(const BlobStore& store, const std::string& key, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    throw CapacityError(store.describe() + ": cannot allocate memory for the value of key '" + key + "'");
  }
}

class MemoryStore final : public BlobStore {
 public:
  explicit MemoryStore(std::size_t capacity_bytes) : capacity_(capacity_bytes) {}

  std::optional<std::vector<std::byte>> get(const std::string& key) override {
    check_store_key(key);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = index_.find(key);
    if (it == index_.end()) return std::nullopt;
    // Copy first: a refused allocation leaves the recency order as it was.
    std::vector<std::byte> copy = allocating(*this, key, [&] { return it->second->value; });
    lru_.splice(lru_.end(), lru_, it->second);
    return copy;
  }

  bool put(const std::string& key, std::span<const std::byte> value) override {
    check_store_key(key);
    detail::check_store_value_size(describe(), key, value.size());
    if (capacity_ > 0 && value.size() > capacity_) return false;
    // Everything that can fail (the copy, the list node, the index slot)
    // happens before the first eviction.
    std::list<Entry> node;
    allocating(*this, key, [&] {
      node.push_back(Entry{key, std::vector<std::byte>(value.begin(), value.end())});
      return 0;
    });
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(key);
    if (it == index_.end()) {
      it = allocating(*this, key, [&] { return index_.emplace(key, node.begin()).first; });
    } else {
      bytes_ -= it->second->value.size();
      lru_.erase(it->second);
      it->second = node.begin();
    }
    bytes_ += value.size();
    lru_.splice(lru_.end(), node);
    // The new value is the most recent and fits the cap alone, so eviction
    // stops before reaching it.
    while (capacity_ > 0 && bytes_ > capacity_) {
      Entry& oldest = lru_.front();
      bytes_ -= oldest.value.size();
      index_.erase(oldest.key);
      lru_.pop_front();
    }
    return true;
  }

  bool contains(const std::string& key) override {
    check_store_key(key);
    std::lock_guard<std::mutex> lock(mutex_);
    return index_.count(key) != 0;
  }

  std::size_t bytes_used() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return bytes_;
  }

  std::string describe() const override {
    return capacity_ == 0 ? "memory store (no cap)" : "memory store (cap " + detail::format_bytes(capacity_) + ")";
  }

 private:
  struct Entry {
    std::string key;
    std::vector<std::byte> value;
  };

  const std::size_t capacity_;
  std::mutex mutex_;
  std::list<Entry> lru_;  // least recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
  std::size_t bytes_ = 0;
};

}  // namespace

std::unique_ptr<BlobStore> make_memory_store(std::size_t capacity_bytes) {
  return std::make_unique<MemoryStore>(capacity_bytes);
}

}  // namespace rwd
