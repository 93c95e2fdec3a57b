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
  DirectoryStore(std::string path, const DirectoryStoreOptions& options)
      : path_(std::move(path)), capacity_(options.capacity_bytes), read_only_(options.read_only) {
    if (path_.empty()) throw InvalidArgument("directory store: the path is empty");
    if (!read_only_) {
      std::error_code ec;
      std::filesystem::create_directories(path_, ec);
      if (ec) fail_dir("cannot be created", ec.value());
    }
    struct stat st {};
    if (::stat(path_.c_str(), &st) != 0) fail_dir("cannot be examined", errno);
    if (!S_ISDIR(st.st_mode)) fail_dir("is not a directory", ENOTDIR);
    if (read_only_) return;
    // Permission bits do not tell (root, ACLs, read-only mounts): a probe
    // file does.
    const std::string probe = temp_name();
    const int fd = ::open((path_ + "/" + probe).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) fail_dir("is not writable", errno);
    ::close(fd);
    ::unlink((path_ + "/" + probe).c_str());
  }

  std::optional<std::vector<std::byte>> get(const std::string& key) override {
    return load(key, detail::kMaxStoreValueBytes);
  }

  std::optional<std::vector<std::byte>> get_bounded(const std::string& key, std::size_t max_bytes) override {
    return load(key, std::min<std::uint64_t>(max_bytes, detail::kMaxStoreValueBytes));
  }

  bool put(const std::string& key, std::span<const std::byte> value) override {
    check_store_key(key);
    detail::check_store_value_size(describe(), key, value.size());
    if (read_only_) return false;
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
      if (errno == ENOENT || unusable(errno)) return false;  // what get refuses is no value
      fail_key("contains", key, "cannot examine " + file, errno);
    }
    // A file this process may not read is refused by get (EACCES): not a value here either.
    return S_ISREG(st.st_mode) && static_cast<std::uint64_t>(st.st_size) <= detail::kMaxStoreValueBytes &&
           ::faccessat(AT_FDCWD, file.c_str(), R_OK, AT_EACCESS) == 0;
  }

  std::size_t bytes_used() override {
    std::size_t total = 0;
    for (const File& f : list_files()) total += f.bytes;
    return total;
  }

  std::string describe() const override {
    return "directory " + path_ + (capacity_ == 0 ? "" : " (cap " + detail::format_bytes(capacity_) + ")") +
           (read_only_ ? " (read-only)" : "");
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
  // Errors about one name, not the store: a file we may not read, a link
  // loop, a socket or a device without a driver opened in a race with the
  // stat. The store keeps working for other keys.
  static bool unusable(int err) {
    return err == EACCES || err == EPERM || err == ELOOP || err == ENXIO || err == ENODEV || err == EISDIR ||
           err == ENAMETOOLONG;
  }

  // "a FIFO", "a character device", ...: what `st` describes, for messages.
  static std::string kind_of(const struct stat& st) {
    if (S_ISDIR(st.st_mode)) return "a directory";
    if (S_ISCHR(st.st_mode)) return "a character device";
    if (S_ISBLK(st.st_mode)) return "a block device";
    if (S_ISFIFO(st.st_mode)) return "a FIFO";
    if (S_ISSOCK(st.st_mode)) return "a socket";
    if (S_ISLNK(st.st_mode)) return "a symbolic link";
    return "a file of an unknown type";
  }

  [[noreturn]] void refuse(const std::string& key, const std::string& what) const {
    throw StoreValueError(describe() + ": get of key '" + key + "': " + what + "; only regular files are values");
  }

  // get and get_bounded: the value under `key` if it is a regular file of
  // at most `limit` bytes. What is not a regular file is never opened for
  // reading (a FIFO's open would wait for a writer, a device may be endless)
  // and a size is checked before anything is allocated.
  std::optional<std::vector<std::byte>> load(const std::string& key, std::uint64_t limit) {
    check_store_key(key);
    const std::string file = path_ + "/" + key;
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) {
      if (errno == ENOENT) return std::nullopt;  // never stored, or evicted (maybe just now by another process)
      if (unusable(errno)) refuse(key, "cannot examine " + file + ": " + errno_text(errno));
      fail_key("get", key, "cannot examine " + file, errno);
    }
    const auto not_regular = [&](const struct stat& s) {
      struct stat link {};
      const bool via_link = ::lstat(file.c_str(), &link) == 0 && S_ISLNK(link.st_mode);
      refuse(key, file + " is not a regular file (" + (via_link ? "a symbolic link to " : "") + kind_of(s) + ")");
    };
    if (!S_ISREG(st.st_mode)) not_regular(st);
    // O_NONBLOCK: the name may have been replaced by a FIFO since the stat;
    // it does not change reads of a regular file.
    Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    if (fd.get() < 0) {
      if (errno == ENOENT) return std::nullopt;
      if (unusable(errno)) refuse(key, "cannot open " + file + ": " + errno_text(errno));
      fail_key("get", key, "cannot open " + file, errno);
    }
    if (::fstat(fd.get(), &st) != 0) fail_key("get", key, "cannot examine " + file, errno);
    if (!S_ISREG(st.st_mode)) not_regular(st);
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size > limit) {
      refuse(key,
             file + " holds " + std::to_string(size) + " bytes, over the limit of " + std::to_string(limit) +
                 (limit == detail::kMaxStoreValueBytes ? " bytes (2^32) of any value" : " bytes the caller accepts"));
    }
    std::vector<std::byte> value;
    try {
      value.resize(static_cast<std::size_t>(size));
    } catch (const std::bad_alloc&) {
      throw CapacityError(describe() + ": get of key '" + key + "': cannot allocate " + std::to_string(size) +
                          " bytes for its value");
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
        refuse(key, file + " ended after " + std::to_string(done) + " of its " + std::to_string(value.size()) +
                        " bytes (truncated in place)");
      }
      done += static_cast<std::size_t>(n);
    }
    // Recency for the cap. Best effort: a file another user wrote may not be
    // ours to touch, and an evicted one does not need it. A read-only store
    // leaves a pre-built cache as it is.
    if (!read_only_) {
      const timespec times[2] = {now_realtime(), now_realtime()};
      ::futimens(fd.get(), times);
    }
    return value;
  }

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
        // What get refuses (not a regular file, over 2^32 bytes) is no value:
        // neither counted nor evicted.
        if (!S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) > detail::kMaxStoreValueBytes) continue;
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
  const bool read_only_;
};

}  // namespace

std::unique_ptr<BlobStore> make_directory_store(const std::string& path, const DirectoryStoreOptions& options) {
  return std::make_unique<DirectoryStore>(path, options);
}

std::unique_ptr<BlobStore> make_directory_store(const std::string& path, std::size_t capacity_bytes) {
  return make_directory_store(path, DirectoryStoreOptions{capacity_bytes, false});
}

}  // namespace rwd
