// Key rules (rewind/store.h), the same for every backend.

#include <gtest/gtest.h>

#include <string>

#include "rewind/store.h"
#include "store/store_test_util.h"

namespace rwd {
namespace {

using store_test::TempDir;

TEST(StoreKey, AcceptsKeysOfTheRule) {
  EXPECT_NO_THROW(check_store_key("a"));
  EXPECT_NO_THROW(check_store_key("0"));
  EXPECT_NO_THROW(check_store_key("snapshot:v1:0123456789abcdef"));
  EXPECT_NO_THROW(check_store_key("ABC_xyz.-:09"));
  EXPECT_NO_THROW(check_store_key("a..b"));  // dots inside a key name no other directory
  EXPECT_NO_THROW(check_store_key("a."));
  EXPECT_NO_THROW(check_store_key("-"));
  EXPECT_NO_THROW(check_store_key(std::string(200, 'k')));
}

TEST(StoreKey, RefusesKeysOutsideTheRule) {
  const std::string bad[] = {
      "",                     // empty
      std::string(201, 'k'),  // one character too long
      "a/b",                  // would name a subdirectory
      "/abs",
      "a b",
      "a\nb",
      std::string("a\0b", 3),
      "caf\xc3\xa9",  // UTF-8: outside the ASCII set
      "a*b",
      "a\\b",
      ".",       // the directory itself
      "..",      // its parent
      ".hidden"  // the temporary files' namespace
  };
  for (const std::string& key : bad) {
    try {
      check_store_key(key);
      ADD_FAILURE() << "key '" << key << "' was accepted";
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("1 to 200 characters from [A-Za-z0-9._:-]"), std::string::npos) << message;
      EXPECT_NE(message.find("store key '"), std::string::npos) << message;
    }
  }
}

TEST(StoreKey, MessageNamesTheKeyAndWhatIsWrong) {
  try {
    check_store_key("bad key");
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "store key 'bad key' has a character outside the set at offset 3; a key is 1 to 200 characters from "
              "[A-Za-z0-9._:-], not starting with '.'");
  }
  try {
    check_store_key(std::string(201, 'x'));
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("has 201 characters"), std::string::npos) << e.what();
  }
  try {
    check_store_key("a\x01");
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'a\\x01'"), std::string::npos) << e.what();  // escaped, not raw
  }
}

// Every backend checks keys before touching anything.
TEST(StoreKey, BackendsRefuseBadKeysAndStayUnchanged) {
  TempDir dir;
  const auto value = store_test::bytes_of("v");
  for (auto& store : {make_memory_store(0), make_directory_store(dir.path())}) {
    for (const std::string key : {"", "..", "a/b"}) {
      EXPECT_THROW(store->put(key, value), InvalidArgument) << store->describe() << " key " << key;
      EXPECT_THROW(store->get(key), InvalidArgument) << store->describe();
      EXPECT_THROW(store->contains(key), InvalidArgument) << store->describe();
    }
    EXPECT_EQ(store->bytes_used(), 0u) << store->describe();
  }
  EXPECT_TRUE(store_test::names_in(dir.path()).empty());
}

// 2^32 bytes is the limit (rewind/store.h); the span below is mapped but
// never touched, so a store reading it before checking would be slow, not
// wrong: the check must come first and leave the store unchanged.
TEST(StoreValue, OverTwoToThe32BytesIsInvalidArgument) {
  store_test::OversizeSpan big;
  TempDir dir;
  for (auto& store : {make_memory_store(0), make_directory_store(dir.path())}) {
    try {
      store->put("big", big.span());
      ADD_FAILURE() << store->describe() << " accepted 2^32 + 1 bytes";
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("4294967297 bytes"), std::string::npos) << message;
      EXPECT_NE(message.find("at most 2^32 = 4294967296 bytes"), std::string::npos) << message;
      EXPECT_NE(message.find("'big'"), std::string::npos) << message;
    }
    EXPECT_FALSE(store->contains("big"));
    EXPECT_EQ(store->bytes_used(), 0u);
  }
  EXPECT_TRUE(store_test::names_in(dir.path()).empty());
}

}  // namespace
}  // namespace rwd
