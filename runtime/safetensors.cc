#include "runtime/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "rewind/error.h"

namespace rwd::runtime {
namespace {

using nlohmann::json;

// A header this large is not a tensor index but a corrupt or hostile length
// field; refusing it early keeps us from parsing (and allocating for) it.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw FormatError(path + ": " + problem);
}

std::string errno_text(int err) { return std::strerror(err); }

// Thrown from inside the JSON parser callback; turned into a FormatError
// once the parser has unwound.
struct DuplicateKey {
  std::string key;
  bool top_level;
};

// The dtype spelled `s` into *entry (F32, F16, BF16, or I8: entry->i8).
bool parse_dtype_name(std::string_view s, TensorEntry* entry) {
  if (s == "I8") {
    entry->i8 = true;
    return true;
  }
  for (DType d : {DType::F32, DType::F16, DType::BF16}) {
    if (s == safetensors_dtype_name(d)) {
      entry->dtype = d;
      return true;
    }
  }
  return false;
}

std::size_t element_bytes(DType dtype, bool i8) { return i8 ? 1 : dtype_size(dtype); }
std::string element_name(DType dtype, bool i8) { return i8 ? "I8" : std::string(safetensors_dtype_name(dtype)); }

// JSON integers >= 0 that fit in `limit`. The parser stores non-negative
// literals as unsigned and negative ones as signed; a value built in memory
// may be signed either way, so both are accepted.
bool as_u64(const json& v, std::uint64_t limit, std::uint64_t* out) {
  if (v.is_number_unsigned()) {
    std::uint64_t u = v.get<std::uint64_t>();
    if (u > limit) return false;
    *out = u;
    return true;
  }
  if (v.is_number_integer()) {
    std::int64_t i = v.get<std::int64_t>();
    if (i < 0 || static_cast<std::uint64_t>(i) > limit) return false;
    *out = static_cast<std::uint64_t>(i);
    return true;
  }
  return false;
}

std::string in_quotes(std::string_view name) { return std::string("'").append(name).append("'"); }

std::string shape_string_u64(const std::vector<std::uint64_t>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// numel(dims) * elem_size, or false when that does not fit in 64 bits. A
// zero extent makes the size zero whatever the other extents are.
bool checked_byte_size(const std::vector<std::uint64_t>& dims, std::uint64_t elem_size, std::uint64_t* out) {
  if (std::find(dims.begin(), dims.end(), std::uint64_t{0}) != dims.end()) {
    *out = 0;
    return true;
  }
  std::uint64_t n = elem_size;
  for (std::uint64_t d : dims) {
    if (__builtin_mul_overflow(n, d, &n)) return false;
  }
  // Extents are later used as int64 and byte counts as size_t.
  if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return false;
  *out = n;
  return true;
}

json parse_header(const std::string& path, std::string_view text) {
  // nlohmann keeps the last of two equal keys silently; a safetensors header
  // with a repeated tensor name is ambiguous, so keys are tracked per object.
  std::vector<std::set<std::string>> open_objects;
  auto callback = [&open_objects](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty()) {
          auto key = parsed.get<std::string>();
          if (!open_objects.back().insert(key).second) {
            throw DuplicateKey{std::move(key), open_objects.size() == 1};
          }
        }
        break;
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const DuplicateKey& dup) {
    if (dup.top_level) fail(path, "duplicate tensor name " + in_quotes(dup.key) + " in the header");
    fail(path, "duplicate key " + in_quotes(dup.key) + " in the header");
  } catch (const json::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
}

void read_metadata(const std::string& path, const json& value, std::map<std::string, std::string>* out) {
  if (!value.is_object()) fail(path, "__metadata__ must be an object of string values");
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!it.value().is_string()) {
      fail(path, "__metadata__ value of " + in_quotes(it.key()) + " is not a string");
    }
    (*out)[it.key()] = it.value().get<std::string>();
  }
}

struct RawEntry {
  TensorEntry entry;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

RawEntry read_entry(const std::string& path, const std::string& name, const json& value, std::uint64_t data_size) {
  const std::string where = "tensor " + in_quotes(name) + ": ";
  if (!is_valid_utf8(name)) fail(path, "tensor name is not valid UTF-8");
  if (!value.is_object()) fail(path, where + "entry is not a JSON object");
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) fail(path, where + "missing " + in_quotes(key));
  }

  RawEntry raw;
  raw.entry.name = name;

  const json& dtype = value["dtype"];
  if (!dtype.is_string()) fail(path, where + "dtype is not a string");
  if (!parse_dtype_name(dtype.get_ref<const std::string&>(), &raw.entry)) {
    fail(path, where + "unsupported dtype " + in_quotes(dtype.get_ref<const std::string&>()) +
                   " (supported: F32, F16, BF16, I8)");
  }

  const json& shape = value["shape"];
  if (!shape.is_array()) fail(path, where + "shape is not a list of non-negative integers");
  std::vector<std::uint64_t> dims;
  dims.reserve(shape.size());  // bounded by the header, which is bounded by the file
  for (const json& d : shape) {
    std::uint64_t u = 0;
    if (!as_u64(d, std::numeric_limits<std::uint64_t>::max(), &u)) {
      fail(path, where + "shape is not a list of non-negative integers");
    }
    dims.push_back(u);
  }
  std::uint64_t nbytes = 0;
  if (!checked_byte_size(dims, element_bytes(raw.entry.dtype, raw.entry.i8), &nbytes)) {
    fail(path, where + "byte size of shape " + shape_string_u64(dims) + " " +
                   element_name(raw.entry.dtype, raw.entry.i8) + " overflows 64 bits");
  }
  // No extent exceeds the (non-zero) product, or the product is 0 and a
  // huge extent beside a zero would still not fit int64: check each.
  for (std::uint64_t d : dims) {
    if (d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(path, where + "shape extent " + std::to_string(d) + " overflows 64 bits");
    }
    raw.entry.shape.push_back(static_cast<std::int64_t>(d));
  }

  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 ||
      !as_u64(offsets[0], std::numeric_limits<std::uint64_t>::max(), &raw.begin) ||
      !as_u64(offsets[1], std::numeric_limits<std::uint64_t>::max(), &raw.end)) {
    fail(path, where + "data_offsets is not two non-negative integers [begin, end]");
  }
  const std::string range = "[" + std::to_string(raw.begin) + ", " + std::to_string(raw.end) + "]";
  if (raw.begin > raw.end) fail(path, where + "data_offsets " + range + " has begin > end");
  if (raw.end - raw.begin != nbytes) {
    fail(path, where + "data_offsets " + range + " span " + std::to_string(raw.end - raw.begin) + " bytes, but shape " +
                   shape_string_u64(dims) + " " + element_name(raw.entry.dtype, raw.entry.i8) + " needs " +
                   std::to_string(nbytes));
  }
  if (raw.end > data_size) {
    fail(path, where + "data_offsets " + range + " extend past the end of the data section (" +
                   std::to_string(data_size) + " bytes)");
  }
  raw.entry.nbytes = static_cast<std::size_t>(nbytes);
  return raw;
}

// Writes all of `data` to `fd`, retrying short writes and EINTR.
bool write_all(int fd, const void* data, std::size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

// Distinguishes temporary files of concurrent writers in one process.
std::atomic<std::uint64_t> g_temp_counter{0};

}  // namespace

std::int64_t TensorEntry::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;  // cannot overflow: checked at open
  return n;
}

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
  }
  return "?";
}

std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

bool is_valid_utf8(std::string_view text, std::size_t* bad_offset) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    std::size_t len = 0;
    std::uint32_t cp = 0;
    std::uint32_t min_cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1Fu;
      min_cp = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0Fu;
      min_cp = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07u;
      min_cp = 0x10000;
    } else {
      if (bad_offset) *bad_offset = i;
      return false;
    }
    bool ok = i + len <= n;
    for (std::size_t k = 1; ok && k < len; ++k) {
      const unsigned char cc = s[i + k];
      if ((cc & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (cc & 0x3Fu);
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF are
    // not UTF-8 even though the bit pattern decodes.
    if (!ok || cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      if (bad_offset) *bad_offset = i;
      return false;
    }
    i += len;
  }
  return true;
}

// ---- SafetensorsFile -------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw Error(path + ": cannot stat: " + errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail(path, "file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length field");
  }
  void* map = ::mmap(nullptr, static_cast<std::size_t>(file_size), PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) throw Error(path + ": cannot mmap: " + errno_text(map_errno));
  file.map_ = map;
  file.map_size_ = static_cast<std::size_t>(file_size);
  // From here on `file` owns the mapping; a throw unmaps it.

  const auto* base = static_cast<const std::byte*>(map);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | std::to_integer<std::uint64_t>(base[i]);
  }
  if (header_len > kMaxHeaderBytes) {
    fail(path, "header length " + std::to_string(header_len) + " exceeds the " + std::to_string(kMaxHeaderBytes) +
                   "-byte limit");
  }
  if (header_len > file_size - 8) {
    fail(path, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(file_size) + " bytes)");
  }
  std::string_view header(reinterpret_cast<const char*>(base + 8), static_cast<std::size_t>(header_len));
  std::size_t bad = 0;
  if (!is_valid_utf8(header, &bad)) {
    fail(path, "header is not valid UTF-8 (byte " + std::to_string(8 + bad) + " of the file)");
  }
  const json doc = parse_header(path, header);
  if (!doc.is_object()) fail(path, "header is not a JSON object");

  const std::byte* data = base + 8 + header_len;
  const std::uint64_t data_size = file_size - 8 - header_len;

  std::vector<RawEntry> raw;
  raw.reserve(doc.size());
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() == "__metadata__") {
      read_metadata(path, it.value(), &file.metadata_);
      continue;
    }
    raw.push_back(read_entry(path, it.key(), it.value(), data_size));
  }

  std::sort(raw.begin(), raw.end(), [](const RawEntry& a, const RawEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Empty tensors occupy no bytes and cannot overlap anything.
  const RawEntry* last = nullptr;
  for (const RawEntry& r : raw) {
    if (r.begin == r.end) continue;
    if (last != nullptr && r.begin < last->end) {
      fail(path, "tensors " + in_quotes(last->entry.name) + " [" + std::to_string(last->begin) + ", " +
                     std::to_string(last->end) + "] and " + in_quotes(r.entry.name) + " [" + std::to_string(r.begin) +
                     ", " + std::to_string(r.end) + "] overlap");
    }
    if (last == nullptr || r.end > last->end) last = &r;
  }

  file.entries_.reserve(raw.size());
  for (RawEntry& r : raw) {
    r.entry.data = data + r.begin;
    file.index_.emplace(r.entry.name, file.entries_.size());
    file.entries_.push_back(std::move(r.entry));
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)), map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)), entries_(std::move(other.entries_)),
      index_(std::move(other.index_)), metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    entries_ = std::move(other.entries_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { release(); }

void SafetensorsFile::release() noexcept {
  if (map_ != nullptr) ::munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
  entries_.clear();
  index_.clear();
}

void SafetensorsFile::drop_pages(const TensorEntry& entry) const {
  const auto* base = static_cast<const std::byte*>(map_);
  if (map_ == nullptr || entry.nbytes == 0 || entry.data < base || entry.data + entry.nbytes > base + map_size_) return;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  // Only whole pages inside the tensor: its neighbours may still be read.
  const auto begin = static_cast<std::size_t>(entry.data - base);
  const std::size_t first = (begin + page - 1) / page * page;
  const std::size_t last = (begin + entry.nbytes) / page * page;
  if (last > first) {
    // Advice only: a failure leaves the pages resident, nothing else.
    (void)::madvise(const_cast<std::byte*>(base) + first, last - first, MADV_DONTNEED);
  }
}

const TensorEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const TensorEntry& SafetensorsFile::get(std::string_view name) const {
  const TensorEntry* e = find(name);
  if (e == nullptr) fail(path_, "missing tensor " + in_quotes(name));
  return *e;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const TensorEntry& e : entries_) out.push_back(e.name);
  return out;
}

// ---- writer ------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  auto invalid = [&path](const std::string& problem) {
    throw InvalidArgument("write_safetensors " + path + ": " + problem);
  };
  std::set<std::string_view> seen;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty()) invalid("empty tensor name");
    if (t.name == "__metadata__") invalid("tensor name '__metadata__' is reserved");
    if (!is_valid_utf8(t.name)) invalid("tensor name is not valid UTF-8");
    if (!seen.insert(t.name).second) invalid("duplicate tensor name " + in_quotes(t.name));
    std::vector<std::uint64_t> dims;
    for (std::int64_t d : t.shape) {
      if (d < 0) invalid("tensor " + in_quotes(t.name) + " has negative extent in " + shape_string(t.shape));
      dims.push_back(static_cast<std::uint64_t>(d));
    }
    std::uint64_t nbytes = 0;
    if (!checked_byte_size(dims, element_bytes(t.dtype, t.i8), &nbytes) || nbytes != t.bytes.size()) {
      invalid("tensor " + in_quotes(t.name) + " has " + std::to_string(t.bytes.size()) + " bytes, shape " +
              shape_string(t.shape) + " " + element_name(t.dtype, t.i8) + " needs " +
              (nbytes ? std::to_string(nbytes) : std::string("an overflowing count")));
    }
  }
  for (const auto& [key, value] : metadata) {
    if (!is_valid_utf8(key) || !is_valid_utf8(value)) invalid("metadata is not valid UTF-8");
  }

  // Widest elements first: every tensor then starts at a multiple of its
  // element size (the data section itself starts 8-aligned).
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&tensors](std::size_t a, std::size_t b) {
    return element_bytes(tensors[a].dtype, tensors[a].i8) > element_bytes(tensors[b].dtype, tensors[b].i8);
  });

  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (std::size_t i : order) {
    const TensorToWrite& t = tensors[i];
    const std::uint64_t end = offset + t.bytes.size();
    header[t.name] = {{"dtype", element_name(t.dtype, t.i8)}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  unsigned char len_bytes[8];
  std::uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));

  std::vector<std::span<const std::byte>> parts;
  parts.push_back(std::as_bytes(std::span<const unsigned char>(len_bytes)));
  parts.push_back(std::as_bytes(std::span<const char>(text.data(), text.size())));
  for (std::size_t i : order) parts.push_back(tensors[i].bytes);
  write_file_atomically(path, parts);
}

void write_file_atomically(const std::string& path, std::span<const std::span<const std::byte>> parts) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" +
                          std::to_string(g_temp_counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(path + ": cannot create " + tmp + ": " + errno_text(errno));
  bool ok = true;
  for (const auto& part : parts) {
    if (!ok) break;
    ok = write_all(fd, part.data(), part.size());
  }
  int err = ok ? 0 : errno;
  if (ok && ::fsync(fd) != 0) {
    ok = false;
    err = errno;
  }
  if (::close(fd) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    throw Error(path + ": cannot write: " + errno_text(err));
  }
}

}  // namespace rwd::runtime
