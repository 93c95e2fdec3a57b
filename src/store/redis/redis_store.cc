// The Redis store: one hiredis connection behind a mutex.

#include "rewind/redis_store.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "store/store_util.h"

namespace rwd {
namespace {

constexpr double kMaxTimeoutS = 86400.0;

bool key_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '-';
}

timeval to_timeval(double seconds) {
  timeval tv{};
  const double whole = std::floor(seconds);
  tv.tv_sec = static_cast<time_t>(whole);
  tv.tv_usec = static_cast<suseconds_t>((seconds - whole) * 1e6);
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;  // 0 would mean "no timeout" to the kernel
  return tv;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

Reply take(void* reply) { return Reply(static_cast<redisReply*>(reply)); }

// Blocks SIGPIPE in this thread for its lifetime and discards a SIGPIPE
// raised meanwhile (by hiredis's write() to a closed socket) unless one was
// already pending before: the process's disposition stays untouched.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    was_pending_ = pending();
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;
  ~SigpipeGuard() {
    const int saved_errno = errno;
    if (!was_pending_ && pending()) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    errno = saved_errno;
  }

 private:
  static bool pending() {
    sigset_t set;
    sigemptyset(&set);
    sigpending(&set);
    return sigismember(&set, SIGPIPE) == 1;
  }

  sigset_t pipe_;
  sigset_t old_;
  bool was_pending_ = false;
};

void check_options(const RedisOptions& o) {
  const std::string where = "redis store options";
  if (o.host.empty() || o.host.find('\0') != std::string::npos) {
    throw InvalidArgument(where + ": host '" + detail::printable(o.host) + "' must be a non-empty name or address");
  }
  if (o.port < 1 || o.port > 65535) {
    throw InvalidArgument(where + ": port " + std::to_string(o.port) + " is outside 1 to 65535");
  }
  if (o.key_prefix.size() > 200) {
    throw InvalidArgument(where + ": key_prefix has " + std::to_string(o.key_prefix.size()) +
                          " characters; at most 200 are allowed");
  }
  for (const char c : o.key_prefix) {
    if (!key_char(c)) {
      throw InvalidArgument(where + ": key_prefix '" + detail::printable(o.key_prefix) +
                            "' has a character outside [A-Za-z0-9._:-]");
    }
  }
  const auto check_timeout = [&](const char* name, double s) {
    if (!(s > 0.0 && s <= kMaxTimeoutS)) {
      throw InvalidArgument(where + ": " + name + " " + std::to_string(s) + " is outside (0, 86400] seconds");
    }
  };
  check_timeout("connect_timeout_s", o.connect_timeout_s);
  check_timeout("command_timeout_s", o.command_timeout_s);
}

// A glob pattern matching exactly the keys that start with `prefix`.
std::string scan_pattern(const std::string& prefix) {
  std::string pattern;
  for (const char c : prefix) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') pattern += '\\';
    pattern += c;
  }
  return pattern + "*";
}

class RedisStore final : public BlobStore {
 public:
  explicit RedisStore(RedisOptions options)
      : options_(std::move(options)), server_("redis://" + options_.host + ":" + std::to_string(options_.port)) {
    std::lock_guard<std::mutex> lock(mutex_);
    connect("connect", "");
  }
  RedisStore(const RedisStore&) = delete;
  RedisStore& operator=(const RedisStore&) = delete;
  ~RedisStore() override { drop(); }

  std::optional<std::vector<std::byte>> get(const std::string& key) override {
    check_store_key(key);
    const std::string full = options_.key_prefix + key;
    Reply reply;
    with_connection("get", key, [&](redisContext* c) {
      reply = take(redisCommand(c, "GET %b", full.data(), full.size()));
      return reply != nullptr;
    });
    if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
    if (is_wrongtype(*reply)) {
      throw StoreValueError(describe() + ": get of key '" + key + "': the key " + full +
                            " holds a value of another Redis type than string, not one of ours");
    }
    if (reply->type != REDIS_REPLY_STRING) fail_reply("get", key, *reply);
    try {
      const auto* bytes = reinterpret_cast<const std::byte*>(reply->str);
      return std::vector<std::byte>(bytes, bytes + reply->len);
    } catch (const std::bad_alloc&) {
      throw CapacityError(describe() + ": get of key '" + key + "': cannot allocate " + std::to_string(reply->len) +
                          " bytes for its value");
    }
  }

  bool put(const std::string& key, std::span<const std::byte> value) override {
    check_store_key(key);
    detail::check_store_value_size(describe(), key, value.size());
    const std::string full = options_.key_prefix + key;
    Reply reply;
    with_connection("put", key, [&](redisContext* c) {
      // A zero-length %b still needs a valid pointer.
      static const char kEmpty = 0;
      const char* data = value.empty() ? &kEmpty : reinterpret_cast<const char*>(value.data());
      reply = take(redisCommand(c, "SET %b %b", full.data(), full.size(), data, value.size()));
      return reply != nullptr;
    });
    if (reply->type == REDIS_REPLY_STATUS) return true;
    // Redis refuses writes before executing them when used memory passes
    // maxmemory and nothing can be evicted: nothing was stored.
    if (reply->type == REDIS_REPLY_ERROR && reply->len >= 4 && std::strncmp(reply->str, "OOM ", 4) == 0) return false;
    fail_reply("put", key, *reply);
  }

  bool contains(const std::string& key) override {
    check_store_key(key);
    const std::string full = options_.key_prefix + key;
    Reply reply;
    with_connection("contains", key, [&](redisContext* c) {
      // TYPE, not EXISTS: a key of another type is no value of ours (get
      // refuses it), so contains must say false for it too.
      reply = take(redisCommand(c, "TYPE %b", full.data(), full.size()));
      return reply != nullptr;
    });
    if (reply->type != REDIS_REPLY_STATUS) fail_reply("contains", key, *reply);
    return std::string(reply->str, reply->len) == "string";
  }

  std::size_t bytes_used() override {
    const std::string pattern = scan_pattern(options_.key_prefix);
    std::size_t total = 0;
    with_connection("bytes_used", "", [&](redisContext* c) {
      total = 0;
      std::string cursor = "0";
      do {
        Reply scan = take(redisCommand(c, "SCAN %b MATCH %b COUNT 1000", cursor.data(), cursor.size(), pattern.data(),
                                       pattern.size()));
        if (scan == nullptr) return false;
        if (scan->type != REDIS_REPLY_ARRAY || scan->elements != 2 || scan->element[0]->type != REDIS_REPLY_STRING ||
            scan->element[1]->type != REDIS_REPLY_ARRAY) {
          fail_reply("bytes_used", "", *scan);
        }
        cursor.assign(scan->element[0]->str, scan->element[0]->len);
        const redisReply& keys = *scan->element[1];
        // Pipelined: one round trip per SCAN batch, not per key.
        for (std::size_t i = 0; i < keys.elements; ++i) {
          if (redisAppendCommand(c, "STRLEN %b", keys.element[i]->str, keys.element[i]->len) != REDIS_OK) return false;
        }
        for (std::size_t i = 0; i < keys.elements; ++i) {
          void* raw = nullptr;
          if (redisGetReply(c, &raw) != REDIS_OK) return false;
          Reply len = take(raw);
          // A key of another type under the prefix is not a value of ours
          // (WRONGTYPE); one deleted since the SCAN counts 0.
          if (len->type == REDIS_REPLY_INTEGER && len->integer > 0) total += static_cast<std::size_t>(len->integer);
        }
      } while (cursor != "0");
      return true;
    });
    return total;
  }

  std::string describe() const override { return server_ + "/" + options_.key_prefix; }

 private:
  static bool is_wrongtype(const redisReply& r) {
    return r.type == REDIS_REPLY_ERROR && r.len >= 9 && std::strncmp(r.str, "WRONGTYPE", 9) == 0;
  }

  // "timed out after 2 s waiting for 127.0.0.1:6379" where hiredis says only
  // "Resource temporarily unavailable" (its socket timeout is EAGAIN).
  std::string timeout_text(const char* doing, double seconds) const {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", seconds);
    return std::string("timed out after ") + buf + " s " + doing + " " + options_.host + ":" +
           std::to_string(options_.port);
  }

  // REQUIRES: mutex_ held, ctx_ null. Throws StoreError naming the server.
  void connect(const std::string& op, const std::string& key) {
    redisContext* c = redisConnectWithTimeout(options_.host.c_str(), options_.port,
                                              to_timeval(options_.connect_timeout_s));
    if (c == nullptr) fail(op, key, "cannot connect: hiredis cannot allocate a context");
    if (c->err != 0) {
      const bool timed_out = c->err == REDIS_ERR_IO && (errno == ETIMEDOUT || errno == EAGAIN);
      const std::string reason = timed_out ? timeout_text("connecting to", options_.connect_timeout_s) : c->errstr;
      redisFree(c);
      fail(op, key, "cannot connect: " + reason);
    }
    if (redisSetTimeout(c, to_timeval(options_.command_timeout_s)) != REDIS_OK) {
      const std::string reason = c->errstr;
      redisFree(c);
      fail(op, key, "cannot set the command timeout: " + reason);
    }
    ctx_ = c;
  }

  void drop() {
    if (ctx_ != nullptr) redisFree(std::exchange(ctx_, nullptr));
  }

  // Runs `talk(ctx)` (false: hiredis reported a connection error) under the
  // lock with SIGPIPE held off. A connection error drops the connection
  // (its protocol state is unknown) and throws StoreError, except that a
  // connection this call did not open, found closed by the server, is
  // replaced once and `talk` repeated: the server may have restarted or
  // closed an idle client since the last call. A timeout is not repeated,
  // which bounds a call by connect + 2 command timeouts.
  template <typename Talk>
  void with_connection(const std::string& op, const std::string& key, Talk&& talk) {
    std::lock_guard<std::mutex> lock(mutex_);
    SigpipeGuard no_sigpipe;
    bool fresh = false;
    if (ctx_ == nullptr) {
      connect(op, key);
      fresh = true;
    }
    while (true) {
      errno = 0;
      if (talk(ctx_)) return;
      const int saved_errno = errno;
      const int err = ctx_->err;
      const bool timed_out = err == REDIS_ERR_IO && (saved_errno == EAGAIN || saved_errno == EWOULDBLOCK);
      const std::string reason = timed_out        ? timeout_text("waiting for", options_.command_timeout_s)
                                 : ctx_->err != 0 ? std::string(ctx_->errstr)
                                                  : "no reply";
      drop();
      const bool closed_by_server = err == REDIS_ERR_EOF ||
                                    (err == REDIS_ERR_IO && (saved_errno == EPIPE || saved_errno == ECONNRESET));
      if (fresh || !closed_by_server) fail(op, key, timed_out ? reason : "connection failed: " + reason);
      connect(op, key);
      fresh = true;
    }
  }

  [[noreturn]] void fail(const std::string& op, const std::string& key, const std::string& what) const {
    const std::string subject = key.empty() ? op : op + " of key '" + key + "'";
    throw StoreError(describe() + ": " + subject + ": " + what);
  }
  [[noreturn]] void fail_reply(const std::string& op, const std::string& key, const redisReply& reply) const {
    std::string text = "unexpected reply of type " + std::to_string(reply.type);
    if (reply.type == REDIS_REPLY_ERROR || reply.type == REDIS_REPLY_STATUS) {
      text = "server replied '" + detail::printable(std::string(reply.str, reply.len)) + "'";
    }
    fail(op, key, text);
  }

  const RedisOptions options_;
  const std::string server_;  // "redis://host:port", for messages
  std::mutex mutex_;
  redisContext* ctx_ = nullptr;  // null after a connection error until the next call
};

}  // namespace

RedisOptions parse_redis_url(const std::string& url) {
  const auto fail = [&](const std::string& why) -> RedisOptions {
    throw InvalidArgument("redis url '" + detail::printable(url) + "' " + why +
                          "; accepted: redis://HOST:PORT or redis://HOST:PORT/PREFIX (HOST a name or IPv4 "
                          "address, PORT 1 to 65535, PREFIX up to 200 characters from [A-Za-z0-9._:-])");
  };
  const std::string scheme = "redis://";
  if (url.compare(0, scheme.size(), scheme) != 0) return fail("does not start with redis://");
  const std::string rest = url.substr(scheme.size());
  const std::size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  const std::size_t colon = authority.rfind(':');
  if (colon == std::string::npos) return fail("has no :PORT");
  RedisOptions options;
  options.host = authority.substr(0, colon);
  if (options.host.empty()) return fail("has no HOST");
  for (const char c : options.host) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-';
    if (!ok) return fail("has a HOST with a character outside [A-Za-z0-9.-]");
  }
  const std::string port = authority.substr(colon + 1);
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos) {
    return fail("has a PORT that is not a number from 1 to 65535");
  }
  options.port = std::stoi(port);
  if (options.port < 1 || options.port > 65535) return fail("has a PORT that is not a number from 1 to 65535");
  if (slash != std::string::npos) {
    options.key_prefix = rest.substr(slash + 1);
    if (options.key_prefix.size() > 200) return fail("has a PREFIX longer than 200 characters");
    for (const char c : options.key_prefix) {
      if (!key_char(c)) return fail("has a PREFIX with a character outside [A-Za-z0-9._:-]");
    }
  }
  return options;
}

std::unique_ptr<BlobStore> make_redis_store(const RedisOptions& options) {
  check_options(options);
  return std::make_unique<RedisStore>(options);
}

}  // namespace rwd
