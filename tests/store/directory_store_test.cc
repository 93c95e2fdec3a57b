// The directory store.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "rewind/store.h"
#include "store/store_test_util.h"

namespace rwd {
namespace {

using store_test::bytes_of;
using store_test::filled;
using store_test::names_in;
using store_test::TempDir;

void write_file(const std::string& path, std::size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out << std::string(bytes, 'x');
}

TEST(DirectoryStore, RoundTripsAndPersistsAcrossStoreObjects) {
  TempDir dir;
  const std::string text("a\0b\xff\x00z", 6);
  {
    auto store = make_directory_store(dir.path());
    EXPECT_FALSE(store->get("k").has_value());
    EXPECT_FALSE(store->contains("k"));
    EXPECT_TRUE(store->put("k", bytes_of(text)));
    EXPECT_TRUE(store->put("empty", {}));
    EXPECT_TRUE(store->put("big", store_test::seeded_value(7, 5'000'003)));
    EXPECT_EQ(store->describe(), "directory " + dir.path());
  }
  auto again = make_directory_store(dir.path(), 64u << 20);
  EXPECT_EQ(again->describe(), "directory " + dir.path() + " (cap 64 MiB)");
  EXPECT_EQ(again->get("k"), bytes_of(text));
  EXPECT_EQ(again->get("empty"), std::vector<std::byte>{});
  const auto big = again->get("big");
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(store_test::check_seeded_value(*big), "");
  EXPECT_EQ(big->size(), 5'000'003u);
  EXPECT_TRUE(again->contains("empty"));
  EXPECT_EQ(again->bytes_used(), 5'000'009u);
  // One file per key, named by it, and no temporary file left behind.
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"big", "empty", "k"}));
}

TEST(DirectoryStore, CreatesMissingParents) {
  TempDir dir;
  auto store = make_directory_store(dir / "x/y/z");
  EXPECT_TRUE(store->put("k", filled(3, 1)));
  EXPECT_EQ(names_in(dir / "x/y/z"), std::vector<std::string>{"k"});
}

// The memory store's worked example (memory_store_test.cc), on files, with
// a second store object doing the reads: recency lives in the directory.
TEST(DirectoryStore, EvictsLeastRecentlyUsedFilesPastTheCap) {
  TempDir dir;
  auto store = make_directory_store(dir.path(), 100);
  auto reader = make_directory_store(dir.path(), 100);
  ASSERT_TRUE(store->put("a", filled(40, 'a')));
  ASSERT_TRUE(store->put("b", filled(30, 'b')));
  ASSERT_TRUE(store->put("c", filled(20, 'c')));
  EXPECT_EQ(store->bytes_used(), 90u);
  ASSERT_TRUE(reader->get("a").has_value());  // order b c a
  ASSERT_TRUE(store->put("d", filled(25, 'd')));
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"a", "c", "d"}));
  EXPECT_EQ(store->bytes_used(), 85u);
  EXPECT_TRUE(reader->contains("c"));  // a look, not a use
  ASSERT_TRUE(store->put("e", filled(50, 'e')));
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"d", "e"}));
  EXPECT_EQ(reader->bytes_used(), 75u);
  EXPECT_EQ(reader->get("d"), filled(25, 'd'));
  EXPECT_EQ(reader->get("e"), filled(50, 'e'));
}

TEST(DirectoryStore, RefusesAValueLargerThanTheCapAndChangesNothing) {
  TempDir dir;
  auto store = make_directory_store(dir.path(), 100);
  ASSERT_TRUE(store->put("a", filled(60, 'a')));
  EXPECT_FALSE(store->put("big", filled(101, 'x')));
  EXPECT_FALSE(store->put("a", filled(101, 'x')));
  EXPECT_EQ(store->get("a"), filled(60, 'a'));
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"a"});
  EXPECT_TRUE(store->put("full", filled(100, 'f')));
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"full"});
}

// Files named like keys count wherever they came from; temporary files
// (a writer in progress or one that was killed), other names and
// subdirectories neither count nor get evicted.
TEST(DirectoryStore, CountsKeyFilesAndIgnoresTemporaryOnes) {
  TempDir dir;
  write_file(dir / ".tmp.999.999.0", 5000);
  write_file(dir / "outside", 30);
  write_file(dir / "not a key", 70);
  ::mkdir((dir / "subdir").c_str(), 0755);
  auto store = make_directory_store(dir.path(), 100);
  EXPECT_EQ(store->bytes_used(), 30u);
  EXPECT_EQ(store->get("outside"), filled(30, 'x'));
  EXPECT_FALSE(store->contains("subdir"));
  ASSERT_TRUE(store->put("a", filled(80, 'a')));  // 110 > 100: "outside" is older
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{".tmp.999.999.0", "a", "not a key", "subdir"}));
  EXPECT_EQ(store->bytes_used(), 80u);
}

TEST(DirectoryStore, ToleratesFilesVanishing) {
  TempDir dir;
  auto store = make_directory_store(dir.path());
  ASSERT_TRUE(store->put("k", filled(10, 1)));
  ASSERT_EQ(::unlink((dir / "k").c_str()), 0);  // another process evicted it
  EXPECT_FALSE(store->get("k").has_value());
  EXPECT_FALSE(store->contains("k"));
  EXPECT_EQ(store->bytes_used(), 0u);
  EXPECT_TRUE(store->put("k", filled(10, 2)));
  EXPECT_EQ(store->get("k"), filled(10, 2));
}

// A put that cannot publish (the key's name is taken by a non-empty
// directory) throws StoreError naming the key and the path, and removes its
// temporary file.
TEST(DirectoryStore, FailedPutLeavesNoTemporaryFile) {
  TempDir dir;
  auto store = make_directory_store(dir.path());
  ASSERT_EQ(::mkdir((dir / "k").c_str(), 0755), 0);
  write_file(dir / "k/inside", 1);
  try {
    store->put("k", filled(10, 1));
    FAIL() << "put over a directory succeeded";
  } catch (const StoreError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("put of key 'k'"), std::string::npos) << message;
    EXPECT_NE(message.find("cannot rename"), std::string::npos) << message;
    EXPECT_NE(message.find(dir / "k"), std::string::npos) << message;
  }
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"k"});
  EXPECT_THROW(store->get("k"), StoreError);  // a directory is not a value
  EXPECT_FALSE(store->contains("k"));
}

void expect_store_error(const std::string& path, const std::string& errno_text) {
  try {
    make_directory_store(path);
    ADD_FAILURE() << "a store on " << path << " was created";
  } catch (const StoreError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("directory store: " + path), std::string::npos) << message;
    EXPECT_NE(message.find(errno_text), std::string::npos) << message;
  }
}

TEST(DirectoryStore, UnusableDirectoryIsStoreError) {
  TempDir dir;
  write_file(dir / "file", 1);
  expect_store_error(dir / "file", "Not a directory");      // the path is a file
  expect_store_error(dir / "file/sub", "Not a directory");  // a parent is a file
  // /proc refuses new directories to everyone, root included.
  expect_store_error("/proc/rewind-store-test", "No such file or directory");
  if (::geteuid() != 0) {  // root writes through permission bits
    ASSERT_EQ(::mkdir((dir / "ro").c_str(), 0555), 0);
    expect_store_error(dir / "ro", "Permission denied");
  }
  EXPECT_THROW(make_directory_store(""), InvalidArgument);
}

// Four processes put and get the same eight keys, values of 16 bytes to
// 256 KiB that carry their seed and size: every value read must be whole.
// With a cap, they also evict each other's files while others read them.
void concurrent_processes(std::size_t cap) {
  TempDir dir;
  make_directory_store(dir.path(), cap);  // created once before the race
  const auto failures = store_test::run_processes(4, [&](int p) -> std::string {
    auto store = make_directory_store(dir.path(), cap);
    return store_test::race_on_eight_keys(*store, p, 1000);
  });
  EXPECT_TRUE(failures.empty()) << ::testing::PrintToString(failures);
  auto store = make_directory_store(dir.path(), cap);
  std::size_t held = 0;
  for (const std::string& name : names_in(dir.path())) {
    EXPECT_NE(name[0], '.') << "temporary file left behind: " << name;
    auto v = store->get(name);
    ASSERT_TRUE(v.has_value()) << name;
    EXPECT_EQ(store_test::check_seeded_value(*v), "") << name;
    held += v->size();
  }
  if (cap > 0) {
    EXPECT_LE(held, cap);
  }
}

TEST(DirectoryStore, FourProcessesSeeOnlyWholeValues) { concurrent_processes(0); }

TEST(DirectoryStore, FourProcessesSeeOnlyWholeValuesWhileEvicting) { concurrent_processes(600 * 1024); }

// Everything a directory may hold under a key's name besides a value: get
// refuses it at once with StoreValueError naming what it found (never
// blocking on a FIFO, never allocating 100 GiB, never reading a device),
// contains says false, and the store goes on working for other keys.
TEST(DirectoryStore, NonValuesUnderKeyNamesAreRefusedWithoutBlockingOrAllocating) {
  TempDir dir;
  auto store = make_directory_store(dir.path());
  ASSERT_TRUE(store->put("good", filled(10, 3)));
  const std::pair<store_test::Junk, std::string> cases[] = {
      {store_test::Junk::kHugeSparse, "holds 107374182400 bytes, over the limit of 4294967296 bytes (2^32)"},
      {store_test::Junk::kFifo, "is not a regular file (a FIFO)"},
      {store_test::Junk::kSocket, "is not a regular file (a socket)"},
      {store_test::Junk::kLinkToZero, "is not a regular file (a symbolic link to a character device)"},
      {store_test::Junk::kLinkToNull, "is not a regular file (a symbolic link to a character device)"},
      {store_test::Junk::kDirectory, "is not a regular file (a directory)"},
  };
  for (const auto& [junk, expected] : cases) {
    SCOPED_TRACE(store_test::junk_name(junk));
    store_test::make_junk(dir / "k", junk);
    try {
      store->get("k");
      ADD_FAILURE() << "get returned a value";
    } catch (const StoreValueError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("directory " + dir.path() + ": get of key 'k': " + (dir / "k") + " " + expected),
                std::string::npos)
          << message;
    }
    EXPECT_THROW(store->get_bounded("k", 1 << 20), StoreValueError);
    EXPECT_FALSE(store->contains("k"));
    EXPECT_EQ(store->get("good"), filled(10, 3));
    EXPECT_EQ(store->bytes_used(), 10u);  // none of them counts
  }
  // A put replaces any of them but a non-empty directory.
  store_test::make_junk(dir / "k", store_test::Junk::kFifo);
  EXPECT_TRUE(store->put("k", filled(4, 4)));
  EXPECT_EQ(store->get("k"), filled(4, 4));
}

// get_bounded refuses a regular file over the caller's limit from its size,
// before reading it; at the limit it reads.
TEST(DirectoryStore, GetBoundedRefusesLargerFilesBeforeReading) {
  TempDir dir;
  auto store = make_directory_store(dir.path());
  ASSERT_TRUE(store->put("k", filled(1000, 7)));
  EXPECT_EQ(store->get_bounded("k", 1000), filled(1000, 7));
  try {
    store->get_bounded("k", 999);
    ADD_FAILURE() << "a value over the limit was returned";
  } catch (const StoreValueError& e) {
    EXPECT_NE(std::string(e.what()).find("holds 1000 bytes, over the limit of 999 bytes the caller accepts"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(store->get_bounded("missing", 1).has_value());
  // The default get_bounded (stores that do not override it) checks after.
  auto memory = make_memory_store(0);
  ASSERT_TRUE(memory->put("k", filled(1000, 7)));
  EXPECT_EQ(memory->get_bounded("k", 1000), filled(1000, 7));
  EXPECT_THROW(memory->get_bounded("k", 999), StoreValueError);
}

// A read-only store reads a directory others wrote, creates nothing, leaves
// the files' times alone and refuses puts (false, nothing written).
TEST(DirectoryStore, ReadOnlyReadsAPrebuiltDirectoryAndWritesNothing) {
  TempDir dir;
  {
    auto writer = make_directory_store(dir.path());
    ASSERT_TRUE(writer->put("a", filled(5, 1)));
  }
  struct stat before {};
  ASSERT_EQ(::stat((dir / "a").c_str(), &before), 0);
  DirectoryStoreOptions o;
  o.read_only = true;
  auto store = make_directory_store(dir.path(), o);
  EXPECT_EQ(store->describe(), "directory " + dir.path() + " (read-only)");
  EXPECT_EQ(store->get("a"), filled(5, 1));
  EXPECT_TRUE(store->contains("a"));
  EXPECT_FALSE(store->put("b", filled(5, 2)));
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"a"});
  struct stat after {};
  ASSERT_EQ(::stat((dir / "a").c_str(), &after), 0);
  EXPECT_EQ(after.st_mtim.tv_sec, before.st_mtim.tv_sec);
  EXPECT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
  // Not created when missing: a read-only cache that is not there is an error.
  try {
    make_directory_store(dir / "missing", o);
    ADD_FAILURE() << "a read-only store on a missing directory was made";
  } catch (const StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "missing"));
}

}  // namespace
}  // namespace rwd
