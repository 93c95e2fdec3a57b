// rewind/open_store.h: a BlobStore named by a command-line spec (library
// rewind::store_open, target rewind_store_open; in-tree only, like
// rewind/redis_store.h, since it links the Redis store when that is built).
//
// The spec is what `rewind generate --prefix-cache` and `rewind serve
// --prefix-cache` take: a directory path, ro:DIR (a directory read but never
// written) or redis://HOST:PORT[/PREFIX] (rewind/redis_store.h). Any other
// URL ("rediss://h", "REDIS://h", "file:///x", "redis:/x") is refused
// rather than taken for a directory of that name ("./redis:/x" is one).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "rewind/store.h"

namespace rwd {

struct StoreSpecOptions {
  // The option the spec came from, named in every message.
  std::string option = "--prefix-cache";
  // A directory store's cap in bytes (0: none) when the user gave one; a
  // Redis or ro:DIR spec refuses it (neither is capped by rewind).
  std::optional<std::size_t> capacity_bytes;
  // The option the cap came from, named in messages.
  std::string capacity_option = "--prefix-cache-bytes";
};

// True when this build opens redis:// specs (it was linked with the Redis
// store).
bool store_spec_has_redis();

// Checks `spec` without touching any store. Throws InvalidArgument naming
// options.option, the spec and the accepted forms for an empty spec, "ro:"
// without a directory, a URL of another kind, a malformed redis:// URL, a
// redis:// spec in a build without Redis, or a capacity the spec's store
// does not take.
void check_store_spec(const std::string& spec, const StoreSpecOptions& options = {});

// check_store_spec, then opens the store. A store that cannot be reached now
// (a Redis server that does not answer, a directory that cannot be created)
// is a warning on stderr ("rewind: warning: prefix cache: ...") and null:
// callers go on without it and recompute. A directory this user may read
// but not write is opened read-only, with a warning.
std::shared_ptr<BlobStore> open_store_spec(const std::string& spec, const StoreSpecOptions& options = {});

}  // namespace rwd
