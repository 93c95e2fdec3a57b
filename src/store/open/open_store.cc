#include "rewind/open_store.h"

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "rewind/error.h"

#if REWIND_HAVE_REDIS
#include "rewind/redis_store.h"
#endif

namespace rwd {
namespace {

const char* const kAccepted =
    "accepted: a directory path, ro:DIR (a directory read but never written) or redis://HOST:PORT[/PREFIX]";

struct Parsed {
  bool read_only = false;
  bool redis = false;
  std::string path;  // the directory (without "ro:")
};

Parsed parse(const std::string& spec, const StoreSpecOptions& options) {
  const std::string& opt = options.option;
  if (spec.empty()) throw InvalidArgument(opt + " is empty; " + kAccepted);
  Parsed p;
  p.read_only = spec.rfind("ro:", 0) == 0;
  p.path = p.read_only ? spec.substr(3) : spec;
  p.redis = !p.read_only && spec.rfind("redis://", 0) == 0;
  if (p.read_only && p.path.empty()) throw InvalidArgument(opt + " 'ro:' names no directory; " + kAccepted);
  if (!p.redis) {
    // "rediss://h", "REDIS://h", "file:///x", "redis:/x": a URL of a kind
    // this build does not speak must not become a local directory.
    const std::string& path = p.path;
    std::size_t n = 0;
    while (n < path.size() && (std::isalnum(static_cast<unsigned char>(path[n])) != 0 ||
                               (n > 0 && (path[n] == '+' || path[n] == '.' || path[n] == '-')))) {
      ++n;
    }
    if (n > 0 && std::isalpha(static_cast<unsigned char>(path[0])) != 0 && path.compare(n, 2, ":/") == 0) {
      throw InvalidArgument(opt + " '" + path + "' is a '" + path.substr(0, n + 1) +
                            "' URL, which rewind does not take; " + kAccepted + " (for a directory of that name, " +
                            "write ./" + path + ")");
    }
  }
  if ((p.redis || p.read_only) && options.capacity_bytes) {
    throw InvalidArgument(p.redis ? options.capacity_option +
                                        " caps a directory cache; a Redis server caps itself (maxmemory)"
                                  : options.capacity_option + " caps a cache that is written; ro:DIR is never written");
  }
  if (p.redis) {
#if REWIND_HAVE_REDIS
    try {
      parse_redis_url(spec);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(opt + ": " + e.what());
    }
#else
    throw InvalidArgument(opt + " " + spec +
                          ": this build has no Redis support (built with -DREWIND_BUILD_REDIS=OFF); " +
                          "give a directory or ro:DIR");
#endif
  }
  return p;
}

}  // namespace

bool store_spec_has_redis() {
#if REWIND_HAVE_REDIS
  return true;
#else
  return false;
#endif
}

void check_store_spec(const std::string& spec, const StoreSpecOptions& options) { parse(spec, options); }

std::shared_ptr<BlobStore> open_store_spec(const std::string& spec, const StoreSpecOptions& options) {
  const Parsed p = parse(spec, options);
  const std::size_t bytes = options.capacity_bytes.value_or(0);
  std::shared_ptr<BlobStore> store;
  try {
    if (p.redis) {
#if REWIND_HAVE_REDIS
      store = make_redis_store(parse_redis_url(spec));
#endif
    } else if (p.read_only) {
      store = make_directory_store(p.path, DirectoryStoreOptions{bytes, true});
    } else {
      try {
        store = make_directory_store(p.path, bytes);
      } catch (const StoreError& e) {
        // A directory this user may read but not write (a pre-built
        // cache, another user's) still serves its entries.
        std::error_code ec;
        if (!std::filesystem::is_directory(p.path, ec)) throw;
        store = make_directory_store(p.path, DirectoryStoreOptions{bytes, true});
        std::fprintf(stderr, "rewind: warning: prefix cache: %s; reading its entries without storing new ones\n",
                     e.what());
      }
    }
  } catch (const StoreError& e) {
    std::fprintf(stderr, "rewind: warning: prefix cache: %s; continuing without it (prefixes are recomputed)\n",
                 e.what());
    return nullptr;
  }
  return store;
}

}  // namespace rwd
