// rewind/store.h: where serialized snapshots live.
//
// A BlobStore maps keys to immutable byte strings (serialized snapshots and
// prefix-cache entries, rewind/snapshot.h). Three backends share the
// interface: an in-process LRU (make_memory_store), a directory
// (make_directory_store) and Redis (rewind/redis_store.h, a separate library:
// it needs hiredis). Every backend publishes a value whole: a reader sees a
// complete value or none, never a torn one, also with several processes
// writing the same keys concurrently.
//
// Keys: 1 to 200 characters from [A-Za-z0-9._:-] (they name files in a
// directory store). Values: at most 2^32 bytes.
//
// Thread safety: a store may be used from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "rewind/error.h"

namespace rwd {

class BlobStore {
 public:
  virtual ~BlobStore() = default;

  // The value stored under `key`, or nullopt when there is none (never
  // stored, evicted). Throws InvalidArgument for a malformed key, StoreError
  // when the backend cannot be reached or read.
  virtual std::optional<std::vector<std::byte>> get(const std::string& key) = 0;
  // Stores `value` under `key` (replacing an older value: values under one
  // key are expected to be equal, as content-addressed entries are). Returns
  // false when the backend refuses it for room (larger than the store's
  // cap, a full Redis under `maxmemory` without eviction); the store is
  // unchanged then. Throws InvalidArgument for a malformed key or a value
  // over 2^32 bytes, StoreError when the backend cannot be reached or
  // written.
  virtual bool put(const std::string& key, std::span<const std::byte> value) = 0;
  // True when `key` holds a value now. Throws as get.
  virtual bool contains(const std::string& key) = 0;
  // Bytes of values held (for stores that know it; Redis reports the keys
  // under its prefix).
  virtual std::size_t bytes_used() = 0;
  // "memory store (cap 64 MiB)", "directory /tmp/x", "redis://127.0.0.1:6379",
  // for messages.
  virtual std::string describe() const = 0;
};

// Throws InvalidArgument naming the key and the rule when `key` is not 1 to
// 200 characters from [A-Za-z0-9._:-].
void check_store_key(const std::string& key);

// An in-process store holding at most `capacity_bytes` of values (0: no
// cap); past the cap it evicts the least recently used (get or put) values.
// A value larger than the cap is refused (put returns false).
std::unique_ptr<BlobStore> make_memory_store(std::size_t capacity_bytes);

// A store in directory `path` (created when missing, parents included), one
// file per key, written to a temporary name and renamed into place, so that
// several processes may share it. With capacity_bytes > 0, a put that
// brings the directory's values past the cap removes the least recently
// used files (by modification time; a get refreshes it) first. Throws
// StoreError when the directory cannot be created or is not writable.
std::unique_ptr<BlobStore> make_directory_store(const std::string& path, std::size_t capacity_bytes = 0);

}  // namespace rwd
