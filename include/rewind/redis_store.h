// rewind/redis_store.h: a BlobStore on a Redis server (library
// rewind::redis, target rewind_redis; it links hiredis).
//
// Each value is one Redis string under `key_prefix + key`, written by one
// SET, which Redis applies atomically: a reader (GET) sees the old value or
// the new one whole, never a torn one, whatever number of processes write
// the same keys. Values and keys travel as binary-safe bulk strings, so
// values may hold any bytes (NUL included). Redis itself limits a value to
// its `proto-max-bulk-len` (512 MiB by default); a larger put fails with
// StoreError.
//
// Room: under `maxmemory` with `maxmemory-policy noeviction` a full server
// answers a SET with "OOM command not allowed ..."; put then returns false
// and stores nothing. As a cache, run the server with `allkeys-lru`
// (docs/stores.md), which evicts instead.
//
// A key of another type under the prefix (a list, a hash) is no value of
// ours: get throws StoreValueError naming it, contains (TYPE, not EXISTS)
// says false, bytes_used skips it, put replaces it.
//
// Failures: when the server cannot be reached (stopped, network down) or
// does not answer within the timeouts, the call throws StoreError naming
// the store (describe()) and what failed ("timed out after 2 s waiting for
// 127.0.0.1:6379", "cannot connect: timed out after 1 s connecting to
// ...", "cannot connect: Connection refused"). A call never waits longer than about connect_timeout_s +
// 2 * command_timeout_s (command_timeout_s bounds each wait for the socket
// to accept or deliver data, so a large value that keeps moving may take
// longer, one that stalls may not). A broken connection is dropped and the
// next call connects again, so the store works again once the server is
// back. A call that finds its connection closed by the server (a restart,
// Redis's idle `timeout`) connects once more and repeats the command, which
// is idempotent (GET, EXISTS, SET of the same value). As with any network
// store, a put that throws after its SET was sent (a timeout) may still be
// applied by the server later; the value is then whole, and equal to what
// the key holds anyway when values are content-addressed.
//
// SIGPIPE: hiredis 0.14 writes to its socket with write(), which raises
// SIGPIPE when the server has gone. Each call blocks SIGPIPE in the calling
// thread while it talks to the server and discards a SIGPIPE it raised
// itself before unblocking, so neither the process's signal disposition nor
// a SIGPIPE meant for someone else is touched.
//
// Thread safety: one connection per store, behind a mutex; calls from
// several threads are serialized. Use one store per thread (or process) for
// parallel requests.
#pragma once

#include <memory>
#include <string>

#include "rewind/store.h"

namespace rwd {

struct RedisOptions {
  std::string host = "127.0.0.1";  // a host name or an IPv4/IPv6 address
  int port = 6379;                 // 1 to 65535
  // Prepended to every key: stores on one server whose prefixes do not begin
  // one another ("a:" and "b:", not "a" and "a:") never see each other's
  // values. 0 to 200 characters from [A-Za-z0-9._:-].
  std::string key_prefix = "rewind:";
  double connect_timeout_s = 1.0;  // (0, 86400]: bound on establishing a connection
  double command_timeout_s = 2.0;  // (0, 86400]: bound on each wait to send or receive
};

// Parses "redis://HOST:PORT" or "redis://HOST:PORT/PREFIX" (PREFIX taken
// verbatim as RedisOptions::key_prefix, e.g. "redis://127.0.0.1:6379/app:";
// an empty one after the slash is an empty prefix; without the slash the
// default "rewind:"); the timeouts keep their defaults. HOST is a name or
// an IPv4 address (no brackets, no IPv6, no user or password), PORT 1 to
// 65535. describe() of a Redis store gives back such a url. Throws
// InvalidArgument naming the url and the accepted form otherwise.
RedisOptions parse_redis_url(const std::string& url);

// A store on the server `options` names, connected now (no AUTH, no TLS,
// database 0). Throws InvalidArgument for options outside the ranges above,
// StoreError naming host:port and hiredis's reason when the server cannot
// be reached within connect_timeout_s. bytes_used() walks the keys under the prefix (SCAN,
// then STRLEN of each): O(keys), for statistics, not for every request.
std::unique_ptr<BlobStore> make_redis_store(const RedisOptions& options);

}  // namespace rwd
