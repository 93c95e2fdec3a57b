// The Redis store, against a private redis-server (redis_server.h).

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "rewind/redis_store.h"
#include "store/redis_server.h"
#include "store/store_test_util.h"

namespace rwd {
namespace {

using store_test::bytes_of;
using store_test::filled;
using test::RedisServer;

RedisOptions options_for(const RedisServer& server, const std::string& prefix = "rewind:") {
  RedisOptions o;
  o.port = server.port();
  o.key_prefix = prefix;
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs `fn`, which must throw StoreError naming `server`; returns the seconds
// it took.
template <typename Fn>
double expect_store_error(const RedisServer& server, Fn&& fn, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  try {
    fn();
    ADD_FAILURE() << what << " succeeded";
  } catch (const StoreError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("redis://127.0.0.1:" + std::to_string(server.port())), std::string::npos)
        << what << ": " << message;
  }
  return seconds_since(start);
}

TEST(RedisStore, RoundTripsBinaryValues) {
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  EXPECT_EQ(store->describe(), server.url() + "/rewind:");
  const std::string text("\0a\0b\xff\r\n$3\r\n", 11);  // NULs and protocol look-alikes
  store_test::expect_round_trip(*store, text);
  EXPECT_TRUE(store->contains("empty"));
  EXPECT_EQ(store->get("empty"), std::vector<std::byte>{});
  const auto big = store_test::seeded_value(42, 6'000'001);
  EXPECT_TRUE(store->put("big", big));
  const auto back = store->get("big");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->size(), 6'000'001u);
  EXPECT_EQ(store_test::check_seeded_value(*back), "");
  EXPECT_EQ(store->bytes_used(), 11u + 0u + 6'000'001u);
  // Replacing.
  EXPECT_TRUE(store->put("k", filled(3, 9)));
  EXPECT_EQ(store->get("k"), filled(3, 9));
  EXPECT_EQ(store->bytes_used(), 3u + 6'000'001u);
  // Keys are checked before anything is sent.
  EXPECT_THROW(store->put("a b", filled(1, 1)), InvalidArgument);
  EXPECT_THROW(store->get(".."), InvalidArgument);
  EXPECT_THROW(store->contains(""), InvalidArgument);
}

TEST(RedisStore, BytesUsedWalksManyKeys) {
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  std::size_t expected = 0;
  for (int i = 0; i < 2500; ++i) {  // several SCAN batches of 1000
    ASSERT_TRUE(store->put("k" + std::to_string(i), filled(static_cast<std::size_t>(i % 7), 1)));
    expected += static_cast<std::size_t>(i % 7);
  }
  EXPECT_EQ(store->bytes_used(), expected);
}

TEST(RedisStore, OverTwoToThe32BytesIsInvalidArgument) {
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  store_test::OversizeSpan big;
  EXPECT_THROW(store->put("big", big.span()), InvalidArgument);
  EXPECT_FALSE(store->contains("big"));
}

TEST(RedisStore, KeyPrefixesIsolateStores) {
  RedisServer server;
  auto a = make_redis_store(options_for(server, "a:"));
  auto b = make_redis_store(options_for(server, "b:"));
  auto bare = make_redis_store(options_for(server, ""));
  ASSERT_TRUE(a->put("k", filled(10, 'a')));
  ASSERT_TRUE(b->put("k", filled(20, 'b')));
  EXPECT_EQ(a->get("k"), filled(10, 'a'));
  EXPECT_EQ(b->get("k"), filled(20, 'b'));
  ASSERT_TRUE(a->put("only-a", filled(5, 'a')));
  EXPECT_FALSE(b->contains("only-a"));
  EXPECT_EQ(a->bytes_used(), 15u);
  EXPECT_EQ(b->bytes_used(), 20u);
  // The prefix is part of the Redis key, verbatim.
  EXPECT_EQ(bare->get("a:k"), filled(10, 'a'));
  EXPECT_EQ(bare->get("b:k"), filled(20, 'b'));
  EXPECT_FALSE(bare->contains("k"));
  EXPECT_EQ(bare->bytes_used(), 35u);
}

TEST(RedisUrl, ParsesTheAcceptedForms) {
  RedisOptions o = parse_redis_url("redis://127.0.0.1:6379");
  EXPECT_EQ(o.host, "127.0.0.1");
  EXPECT_EQ(o.port, 6379);
  EXPECT_EQ(o.key_prefix, "rewind:");
  EXPECT_EQ(o.connect_timeout_s, 1.0);
  EXPECT_EQ(o.command_timeout_s, 2.0);
  o = parse_redis_url("redis://cache-1.example.org:7000/app.v2:");
  EXPECT_EQ(o.host, "cache-1.example.org");
  EXPECT_EQ(o.port, 7000);
  EXPECT_EQ(o.key_prefix, "app.v2:");
  o = parse_redis_url("redis://localhost:1/");
  EXPECT_EQ(o.port, 1);
  EXPECT_EQ(o.key_prefix, "");
  EXPECT_EQ(parse_redis_url("redis://h:65535").port, 65535);
}

TEST(RedisUrl, RefusesOtherForms) {
  const std::string bad[] = {"",
                             "127.0.0.1:6379",
                             "http://127.0.0.1:6379",
                             "rediss://127.0.0.1:6379",
                             "redis://127.0.0.1",
                             "redis://:6379",
                             "redis://127.0.0.1:",
                             "redis://127.0.0.1:0",
                             "redis://127.0.0.1:65536",
                             "redis://127.0.0.1:99999999999",
                             "redis://127.0.0.1:63a9",
                             "redis://127.0.0.1:-1",
                             "redis://[::1]:6379",
                             "redis://user@host:6379",
                             "redis://127.0.0.1:6379/a b",
                             "redis://127.0.0.1:6379/a/b",
                             "redis://127.0.0.1:6379/" + std::string(201, 'p')};
  for (const std::string& url : bad) {
    try {
      parse_redis_url(url);
      ADD_FAILURE() << url << " was accepted";
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("redis url '" + url.substr(0, 40)), std::string::npos) << message;
      EXPECT_NE(message.find("accepted: redis://HOST:PORT or redis://HOST:PORT/PREFIX"), std::string::npos) << message;
    }
  }
}

TEST(RedisStore, OptionsOutsideTheirRangesAreInvalidArgument) {
  const auto with = [](auto change) {
    RedisOptions o;
    change(o);
    return o;
  };
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.port = 0; })), InvalidArgument);
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.port = 65536; })), InvalidArgument);
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.host = ""; })), InvalidArgument);
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.key_prefix = "a b"; })), InvalidArgument);
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.key_prefix = std::string(201, 'p'); })), InvalidArgument);
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.connect_timeout_s = 0; })), InvalidArgument);
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.command_timeout_s = -1; })), InvalidArgument);
  EXPECT_THROW(make_redis_store(with([](RedisOptions& o) { o.command_timeout_s = std::nan(""); })), InvalidArgument);
  EXPECT_THROW(
      make_redis_store(with([](RedisOptions& o) { o.command_timeout_s = std::numeric_limits<double>::infinity(); })),
      InvalidArgument);
}

TEST(RedisStore, UnreachableServerIsStoreErrorNamingIt) {
  RedisServer server;
  server.stop();
  const auto start = std::chrono::steady_clock::now();
  try {
    make_redis_store(options_for(server));
    FAIL() << "connected to a stopped server";
  } catch (const StoreError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(server.url()), std::string::npos) << message;
    EXPECT_NE(message.find("cannot connect: Connection refused"), std::string::npos) << message;
  }
  EXPECT_LT(seconds_since(start), 1.0);
}

// The server goes away between calls: every call throws StoreError at once
// (a refused connection needs no timeout); once it is back, the store works
// again without being recreated.
TEST(RedisStore, StoppedServerIsStoreErrorFastAndARestartedOneWorksAgain) {
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  ASSERT_TRUE(store->put("k", filled(100, 1)));
  server.stop();
  EXPECT_LT(expect_store_error(
                server, [&] { store->get("k"); }, "get"),
            1.0);
  EXPECT_LT(expect_store_error(
                server, [&] { store->put("k", filled(100, 2)); }, "put"),
            1.0);
  EXPECT_LT(expect_store_error(
                server, [&] { store->contains("k"); }, "contains"),
            1.0);
  EXPECT_LT(expect_store_error(
                server, [&] { store->bytes_used(); }, "bytes_used"),
            1.0);
  server.restart();
  EXPECT_FALSE(store->get("k").has_value());  // --save "": the restarted server is empty
  EXPECT_TRUE(store->put("k", filled(100, 3)));
  EXPECT_EQ(store->get("k"), filled(100, 3));
}

// A restart between two calls leaves the store a closed connection; the next
// call replaces it and succeeds.
TEST(RedisStore, RestartBetweenCallsIsInvisible) {
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  ASSERT_TRUE(store->put("k", filled(10, 1)));
  server.restart();
  EXPECT_TRUE(store->put("k", filled(10, 2)));
  EXPECT_EQ(store->get("k"), filled(10, 2));
  server.restart();
  EXPECT_FALSE(store->get("k").has_value());
}

// A server that accepts but never answers (stopped with SIGSTOP): the call
// gives up after command_timeout_s, not later, and the store recovers once
// the server answers again.
TEST(RedisStore, HungServerTimesOut) {
  RedisServer server;
  RedisOptions o = options_for(server);
  o.command_timeout_s = 0.3;
  auto store = make_redis_store(o);
  ASSERT_TRUE(store->put("k", filled(10, 1)));
  server.pause();
  const double get_s = expect_store_error(
      server, [&] { store->get("k"); }, "get of a hung server");
  EXPECT_GE(get_s, 0.25);
  EXPECT_LT(get_s, 2.0);
  const double put_s = expect_store_error(
      server, [&] { store->put("k", filled(10, 2)); }, "put of a hung server");
  EXPECT_LT(put_s, 2.0);
  server.resume();
  // The timed-out SET had been sent: the server may apply it when it wakes
  // (rewind/redis_store.h). Either value, whole, is right.
  const auto v = store->get("k");
  ASSERT_TRUE(v.has_value());
  EXPECT_TRUE(*v == filled(10, 1) || *v == filled(10, 2));
}

// Writing a large value to a server that has gone makes write() fail with
// EPIPE, which would also raise SIGPIPE and, at its default disposition,
// kill the process. The store must throw StoreError instead and leave no
// SIGPIPE pending nor the disposition changed.
TEST(RedisStore, LostServerRaisesNoSigpipe) {
  struct sigaction before {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &before), 0);
  ASSERT_EQ(before.sa_handler, SIG_DFL) << "the test needs SIGPIPE at its default (terminate)";
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  ASSERT_TRUE(store->put("k", filled(10, 1)));
  const auto big = filled(16u << 20, 7);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(store->put("small", filled(10, 1)));  // a live connection
    server.restart();
    // The write to the old connection fails (EPIPE); the put is repeated on
    // a new one.
    EXPECT_TRUE(store->put("big", big));
    server.stop();
    // EPIPE again, and the new connection is refused.
    expect_store_error(
        server, [&] { store->put("big", big); }, "put to a stopped server");
    server.restart();
  }
  sigset_t pending;
  sigemptyset(&pending);
  ASSERT_EQ(::sigpending(&pending), 0);
  EXPECT_EQ(sigismember(&pending, SIGPIPE), 0);
  struct sigaction after {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &after), 0);
  EXPECT_EQ(after.sa_handler, SIG_DFL);
  EXPECT_FALSE(store->get("big").has_value());  // the restarted server is empty
  EXPECT_TRUE(store->put("big", big));
  EXPECT_EQ(store->get("big"), big);
}

// maxmemory 4 MB with noeviction: Redis refuses writes once its memory
// (about 1 MB when empty) passes 4 MB, so 256 KiB values fill it after
// roughly 12; the refused put stores nothing and the earlier values stay.
TEST(RedisStore, FullServerWithoutEvictionRefusesPuts) {
  RedisServer server({"--maxmemory", "4mb", "--maxmemory-policy", "noeviction"});
  auto store = make_redis_store(options_for(server));
  int stored = 0;
  bool refused = false;
  for (int i = 0; i < 64 && !refused; ++i) {
    const auto value = store_test::seeded_value(static_cast<std::uint64_t>(i), 256 * 1024);
    if (store->put("v" + std::to_string(i), value)) {
      ++stored;
    } else {
      refused = true;
      EXPECT_FALSE(store->contains("v" + std::to_string(i)));
    }
  }
  ASSERT_TRUE(refused) << "64 values of 256 KiB fit under maxmemory 4mb";
  EXPECT_GE(stored, 2);
  EXPECT_LE(stored, 16);
  for (int i = 0; i < stored; ++i) {
    const auto v = store->get("v" + std::to_string(i));
    ASSERT_TRUE(v.has_value()) << i;
    EXPECT_EQ(v->size(), 256u * 1024u);
    EXPECT_EQ(store_test::check_seeded_value(*v), "") << i;
  }
  EXPECT_EQ(store->bytes_used(), static_cast<std::size_t>(stored) * 256 * 1024);
  // Refusals repeat: nothing half-written took room.
  EXPECT_FALSE(store->put("again", filled(256 * 1024, 1)));
  EXPECT_FALSE(store->contains("again"));
}

// Four processes, each with its own connection, put and get the same eight
// keys; every value read is whole.
TEST(RedisStore, FourProcessesSeeOnlyWholeValues) {
  RedisServer server;
  const RedisOptions o = options_for(server);
  const auto failures = store_test::run_processes(4, [&](int p) -> std::string {
    auto store = make_redis_store(o);
    return store_test::race_on_eight_keys(*store, p, 2000);
  });
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
  auto store = make_redis_store(o);
  for (int k = 0; k < 8; ++k) {
    const auto v = store->get("key" + std::to_string(k));
    ASSERT_TRUE(v.has_value()) << k;
    EXPECT_EQ(store_test::check_seeded_value(*v), "") << k;
  }
}

// One store shared by threads: the mutex serializes them on its connection.
TEST(RedisStore, ThreadsShareOneStore) {
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::uint64_t state = 3000 + static_cast<std::uint64_t>(t);
      for (int i = 0; i < 200; ++i) {
        state = store_test::splitmix64(state);
        const std::string key = "key" + std::to_string(state % 8);
        if (i % 2 == t % 2) {
          if (!store->put(key, store_test::seeded_value(state, 16 + state % 65536))) ++bad;
        } else if (auto v = store->get(key)) {
          if (!store_test::check_seeded_value(*v).empty()) ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(RedisServerHelper, MissingRedisServerFailsWithAClearMessage) {
  store_test::TempDir empty;
  const char* old = std::getenv("PATH");
  const std::string saved = old != nullptr ? old : "";
  ::setenv("PATH", empty.path().c_str(), 1);
  try {
    RedisServer server;
    ::setenv("PATH", saved.c_str(), 1);
    FAIL() << "started a redis-server that is not on PATH";
  } catch (const std::runtime_error& e) {
    ::setenv("PATH", saved.c_str(), 1);
    const std::string message = e.what();
    EXPECT_NE(message.find("redis-server is not on PATH"), std::string::npos) << message;
    EXPECT_NE(message.find("Debian package redis-server"), std::string::npos) << message;
  }
}

TEST(RedisServerHelper, StopsRestartsAndCleansUp) {
  std::string dir;
  int port = 0;
  {
    RedisServer server;
    dir = server.dir();
    port = server.port();
    auto store = make_redis_store(options_for(server));
    ASSERT_TRUE(store->put("k", filled(1, 1)));
    server.restart();
    EXPECT_EQ(server.port(), port);
    EXPECT_TRUE(server.running());
    server.stop();
    EXPECT_FALSE(server.running());
    server.stop();  // idempotent
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
  RedisOptions o;
  o.port = port;
  EXPECT_THROW(make_redis_store(o), StoreError);
}

// A key of another Redis type under the prefix (someone's list): get refuses
// it with StoreValueError naming the key, contains agrees (false), and a put
// replaces it with a value.
TEST(RedisStore, KeyOfAnotherTypeIsRefusedByGetAndNotContained) {
  RedisServer server;
  auto store = make_redis_store(options_for(server));
  {
    redisContext* c = redisConnect("127.0.0.1", server.port());
    ASSERT_TRUE(c != nullptr && c->err == 0);
    auto* r = static_cast<redisReply*>(redisCommand(c, "RPUSH rewind:k a b"));
    ASSERT_TRUE(r != nullptr);
    EXPECT_EQ(r->type, REDIS_REPLY_INTEGER);
    freeReplyObject(r);
    redisFree(c);
  }
  try {
    store->get("k");
    ADD_FAILURE() << "get of a list returned";
  } catch (const StoreValueError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(server.url() + "/rewind:: get of key 'k': the key rewind:k holds a value of another Redis "
                                          "type than string"),
              std::string::npos)
        << message;
  }
  EXPECT_THROW(store->get_bounded("k", 100), StoreValueError);
  EXPECT_FALSE(store->contains("k"));
  EXPECT_EQ(store->bytes_used(), 0u);
  EXPECT_TRUE(store->put("k", filled(3, 1)));
  EXPECT_TRUE(store->contains("k"));
  EXPECT_EQ(store->get("k"), filled(3, 1));
}

// A stalled server's timeout says what timed out, after how long, where.
TEST(RedisStore, TimeoutMessageSaysWhatTimedOut) {
  RedisServer server;
  RedisOptions o = options_for(server);
  o.command_timeout_s = 0.2;
  auto store = make_redis_store(o);
  server.pause();
  try {
    store->get("k");
    ADD_FAILURE() << "get of a paused server returned";
  } catch (const StoreError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(server.url() + "/rewind:: get of key 'k': timed out after 0.2 s waiting for 127.0.0.1:" +
                           std::to_string(server.port())),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find("Resource temporarily unavailable"), std::string::npos) << message;
  }
  server.resume();
}

}  // namespace
}  // namespace rwd
