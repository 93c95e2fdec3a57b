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
// Keys: 1 to 200 characters from [A-Za-z0-9._:-], not starting with '.'
// (they name files in a directory store: "." and ".." would name
// directories, and names starting with a dot are the store's temporary
// files). "a..b" is a key like any other. Values: at most 2^32 bytes.
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

// What a store holds under a key is not a value it hands out: a directory
// store's file that is not a regular file (a FIFO, socket, device, directory,
// or a symbolic link to one) or larger than 2^32 bytes or the caller's limit
// (get_bounded), a Redis key of another type than string. The message names
// the store, the key and what was found. A StoreError, so callers that treat
// a failing store as a miss still do; the prefix cache tells the two apart
// (it counts this as a rejected entry and keeps using the store).
class StoreValueError : public StoreError {
 public:
  using StoreError::StoreError;
};

class BlobStore {
 public:
  virtual ~BlobStore() = default;

  // The value stored under `key`, or nullopt when there is none (never
  // stored, evicted), and a use of it for the LRU stores. Throws
  // InvalidArgument for a malformed key, StoreValueError when the key holds
  // something that is not a value (below), StoreError when the backend
  // cannot be reached or read, CapacityError when the value's copy cannot be
  // allocated.
  virtual std::optional<std::vector<std::byte>> get(const std::string& key) = 0;
  // As get, but a value of more than `max_bytes` bytes is not handed out:
  // StoreValueError naming its size and the limit. The directory store
  // checks the file's size before it allocates or reads a byte; the default
  // (memory store, Redis, stores of callers) reads the value with get and
  // checks after.
  virtual std::optional<std::vector<std::byte>> get_bounded(const std::string& key, std::size_t max_bytes);
  // Stores `value` under `key` (replacing an older value: values under one
  // key are expected to be equal, as content-addressed entries are). Returns
  // false when the backend refuses it for room (larger than the store's
  // cap, a full disk, a full Redis under `maxmemory` without eviction) or
  // is read-only; the store is unchanged then. Throws InvalidArgument for a malformed key or a value
  // over 2^32 bytes, StoreError when the backend cannot be reached or
  // written (nothing is stored then, except for Redis in the case its header
  // describes), CapacityError when the memory store cannot allocate the
  // copy.
  virtual bool put(const std::string& key, std::span<const std::byte> value) = 0;
  // True when `key` holds a value now, i.e. when get would return one (false
  // for a name get refuses with StoreValueError); not a use (recency is
  // unchanged). Throws as get, StoreValueError excepted.
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
// A value larger than the cap is refused (put returns false). Values are
// copied in and out under one mutex.
std::unique_ptr<BlobStore> make_memory_store(std::size_t capacity_bytes);

struct DirectoryStoreOptions {
  std::size_t capacity_bytes = 0;  // 0: no cap
  // Read a directory that exists (a pre-built cache, a directory this user
  // may not write): it is neither created nor probed for writing, get and
  // contains work as usual but get leaves the files' times alone, put
  // stores nothing and returns false.
  bool read_only = false;
};

// A store in directory `path` (created when missing, parents included), one
// file per key, written to a temporary name (".tmp.<pid>.<tid>.<n>") and
// renamed into place, so that several processes may share it; no fsync (a
// machine crash may lose recent values: docs/stores.md). With
// capacity_bytes > 0, a put that brings the directory's values past the cap
// then removes the least recently used other files (by modification time,
// which put and get set) until they fit; this walks the directory, O(files)
// per put. A value larger than the cap, or a full file system (ENOSPC,
// EDQUOT), makes put return false.
// Files named like keys count whoever wrote them; temporary files, other
// names and subdirectories are ignored. get never blocks on and never reads
// what is not a regular file (a FIFO, a socket, a device, also behind a
// symbolic link) and never allocates for a file over 2^32 bytes: both are
// StoreValueError. Throws InvalidArgument for an empty path, StoreError
// naming the path and the system's reason when the directory cannot be
// created or is not writable (read_only: when it is missing or not a
// directory).
std::unique_ptr<BlobStore> make_directory_store(const std::string& path, const DirectoryStoreOptions& options);
// make_directory_store(path, {capacity_bytes, false}).
std::unique_ptr<BlobStore> make_directory_store(const std::string& path, std::size_t capacity_bytes = 0);

}  // namespace rwd
