// The directory store: one file per key.
//
// Publication: a value is written to a temporary file in the same directory
// (".tmp.<pid>.<tid>.<counter>": a leading dot no key may have, so readers
// and the cap never take one for a value) and rename()d onto the key's
// name. rename within one file system replaces the name atomically, and a
// file is never written again once it carries a key's name, so a reader
// opens either the old file or the new one, both whole; an open file stays
// readable when another process replaces or evicts its name.
//
// No fsync: a crash of the machine (not of a process) may lose recent
// values or leave empty or short files under their names. The store holds
// recomputable data (snapshots, prefix-cache entries), whose loader checks
// sizes and checksums (rewind/snapshot.h), and the cost of two fsyncs per
// put would dominate small values.
//
// Recency: a put sets the file's modification time, a get refreshes it, both
// from CLOCK_REALTIME in nanoseconds (the kernel's own "now" for UTIME_NOW
// has a granularity of a few milliseconds, which would make quick
// successions tie); the cap evicts the oldest files first, ties by name.

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <new>
#include <utility>

#include "rewind/store.h"
#include "store/store_util.h"

namespace rwd {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

std::atomic<std::uint64_t> g_temp_counter{0};

// Closes a descriptor on every path out of a scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and returns close()'s errno (0 when it succeeded): a write
  // error can surface only there (NFS, quotas).
  int close_now() {
    const int fd = std::exchange(fd_, -1);
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

timespec now_realtime() {
  timespec t{};
  ::clock_gettime(CLOCK_REALTIME, &t);
  return t;
}

class DirectoryStore final : public BlobStore {
 public:
  DirectoryStore(std::string path, std::size_t capacity_bytes) : path_(std::move(path)), capacity_(capacity_bytes) {
    if (path_.empty()) throw InvalidArgument("directory store: the path is empty");
    std::error_code ec;
    std::filesystem::create_directories(path_, ec);
    if (ec) fail_dir("cannot be created", ec.value());
    struct stat st {};
    if (::stat(path_.c_str(), &st) != 0) fail_dir("cannot be examined", errno);
    if (!S_ISDIR(st.st_mode)) fail_dir("is not a directory", ENOTDIR);
    // Permission bits do not tell (root, ACLs, read-only mounts): a probe
    // file does.
    const std::string probe = temp_name();
    const int fd = ::open((path_ + "/" + probe).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) fail_dir("is not writable", errno);
    ::close(fd);
    ::unlink((path_ + "/" + probe).c_str());
  }

  std::optional<std::vector<std::byte>> get(const std::string& key) override {
    check_store_key(key);
    const std::string file = path_ + "/" + key;
    Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      if (errno == ENOENT) return std::nullopt;  // never stored, or evicted (maybe just now by another process)
      fail_key("get", key, "cannot open " + file, errno);
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail_key("get", key, "cannot examine " + file, errno);
    if (!S_ISREG(st.st_mode)) fail_key("get", key, file + " is not a regular file", EISDIR);
    std::vector<std::byte> value;
    try {
      value.resize(static_cast<std::size_t>(st.st_size));
    } catch (const std::bad_alloc&) {
      throw CapacityError(describe() + ": get of key '" + key + "': cannot allocate " +
                          std::to_string(st.st_size) + " bytes for its value");
    }
    // The file under a key's name is never written again, so its size is
    // final; a shorter read means something else truncated it in place.
    std::size_t done = 0;
    while (done < value.size()) {
      const std::size_t chunk = std::min<std::size_t>(value.size() - done, std::size_t{1} << 30);
      const ssize_t n = ::read(fd.get(), value.data() + done, chunk);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_key("get", key, "cannot read " + file, errno);
      }
      if (n == 0) {
        throw StoreError(describe() + ": get of key '" + key + "': " + file + " ended after " + std::to_string(done) +
                         " of its " + std::to_string(value.size()) + " bytes");
      }
      done += static_cast<std::size_t>(n);
    }
    // Recency for the cap. Best effort: a file another user wrote may not be
    // ours to touch, and an evicted one does not need it.
    const timespec times[2] = {now_realtime(), now_realtime()};
    ::futimens(fd.get(), times);
    return value;
  }

  bool put(const std::string& key, std::span<const std::byte> value) override {
    check_store_key(key);
    detail::check_store_value_size(describe(), key, value.size());
    if (capacity_ > 0 && value.size() > capacity_) return false;
    const std::string temp = path_ + "/" + temp_name();
    Fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      if (is_full(errno)) return false;
      fail_key("put", key, "cannot create " + temp, errno);
    }
    // From here on every failure removes the temporary file first.
    const auto abandon = [&](const std::string& what, int err) -> bool {
      fd.close_now();
      ::unlink(temp.c_str());
      if (is_full(err)) return false;
      fail_key("put", key, what, err);
      return false;  // not reached
    };
    std::size_t done = 0;
    while (done < value.size()) {
      // Linux writes at most 0x7ffff000 bytes per call.
      const std::size_t chunk = std::min<std::size_t>(value.size() - done, std::size_t{1} << 30);
      const ssize_t n = ::write(fd.get(), value.data() + done, chunk);
      if (n < 0) {
        if (errno == EINTR) continue;
        return abandon("cannot write " + temp, errno);
      }
      done += static_cast<std::size_t>(n);
    }
    const timespec times[2] = {now_realtime(), now_realtime()};
    if (::futimens(fd.get(), times) != 0) return abandon("cannot set the time of " + temp, errno);
    if (const int err = fd.close_now(); err != 0) {
      ::unlink(temp.c_str());
      if (is_full(err)) return false;
      fail_key("put", key, "cannot write " + temp, err);
    }
    const std::string file = path_ + "/" + key;
    if (::rename(temp.c_str(), file.c_str()) != 0) {
      const int err = errno;
      ::unlink(temp.c_str());
      fail_key("put", key, "cannot rename " + temp + " to " + file, err);
    }
    if (capacity_ > 0) {
      try {
        evict_beyond_cap(key);
      } catch (const std::exception&) {
        // The value is published; see evict_beyond_cap.
      }
    }
    return true;
  }

  bool contains(const std::string& key) override {
    check_store_key(key);
    const std::string file = path_ + "/" + key;
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) {
      if (errno == ENOENT) return false;
      fail_key("contains", key, "cannot examine " + file, errno);
    }
    return S_ISREG(st.st_mode);
  }

  std::size_t bytes_used() override {
    std::size_t total = 0;
    for (const File& f : list_files()) total += f.bytes;
    return total;
  }

  std::string describe() const override {
    return "directory " + path_ + (capacity_ == 0 ? "" : " (cap " + detail::format_bytes(capacity_) + ")");
  }

 private:
  struct File {
    std::string name;
    std::size_t bytes = 0;
    timespec mtime{};
  };

  // Unique across the processes and threads sharing the directory.
  static std::string temp_name() {
    return ".tmp." + std::to_string(::getpid()) + "." + std::to_string(::gettid()) + "." +
           std::to_string(g_temp_counter.fetch_add(1));
  }

  static bool is_full(int err) { return err == ENOSPC || err == EDQUOT; }

  [[noreturn]] void fail_dir(const std::string& what, int err) const {
    throw StoreError("directory store: " + path_ + " " + what + ": " + errno_text(err));
  }
  [[noreturn]] void fail_key(const std::string& op, const std::string& key, const std::string& what, int err) const {
    throw StoreError(describe() + ": " + op + " of key '" + key + "': " + what + ": " + errno_text(err));
  }

  // The values in the directory: regular files with a key's name. Files
  // that vanish during the scan (evicted by another process) are skipped.
  std::vector<File> list_files() const {
    DIR* dir = ::opendir(path_.c_str());
    if (dir == nullptr) fail_dir("cannot be listed", errno);
    std::vector<File> files;
    try {
      while (true) {
        errno = 0;
        const dirent* entry = ::readdir(dir);
        if (entry == nullptr) {
          if (errno != 0) fail_dir("cannot be listed", errno);
          break;
        }
        // ".", "..", temporary files and names no key has are not values.
        if (!detail::valid_store_key(entry->d_name)) continue;
        struct stat st {};
        if (::fstatat(::dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
          if (errno == ENOENT) continue;
          fail_dir(std::string("cannot examine its file ") + entry->d_name, errno);
        }
        if (!S_ISREG(st.st_mode)) continue;
        files.push_back(File{entry->d_name, static_cast<std::size_t>(st.st_size), st.st_mtim});
      }
    } catch (...) {
      ::closedir(dir);
      throw;
    }
    ::closedir(dir);
    return files;
  }

  // Removes the least recently used files other than `kept` (the value just
  // published, which fits the cap alone) until the directory's values fit.
  // Best effort (put ignores its errors): the put it follows has succeeded, and
  // processes sharing the directory evict concurrently anyway, so the cap
  // holds once the writes settle, not at every instant.
  void evict_beyond_cap(const std::string& kept) {
    std::vector<File> files = list_files();
    std::size_t total = 0;
    for (const File& f : files) total += f.bytes;
    if (total <= capacity_) return;
    std::sort(files.begin(), files.end(), [](const File& a, const File& b) {
      if (a.mtime.tv_sec != b.mtime.tv_sec) return a.mtime.tv_sec < b.mtime.tv_sec;
      if (a.mtime.tv_nsec != b.mtime.tv_nsec) return a.mtime.tv_nsec < b.mtime.tv_nsec;
      return a.name < b.name;
    });
    for (const File& f : files) {
      if (total <= capacity_) break;
      if (f.name == kept) continue;
      // ENOENT: another process evicted it first; its bytes are gone either way.
      if (::unlink((path_ + "/" + f.name).c_str()) != 0 && errno != ENOENT) continue;
      total -= f.bytes;
    }
  }

  const std::string path_;
  const std::size_t capacity_;
};

}  // namespace

std::unique_ptr<BlobStore> make_directory_store(const std::string& path, std::size_t capacity_bytes) {
  return std::make_unique<DirectoryStore>(path, capacity_bytes);
}

}  // namespace rwd
