// runtime/pack_file.cc: writing, mapping and checking pack files (pack_file.h).
#include "runtime/pack_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "rewind/error.h"
#include "runtime/safetensors.h"

namespace rwd::runtime {

namespace fs = std::filesystem;
using Element = kernels::PackedMatrix::Element;

namespace {

constexpr char kMagic[8] = {'R', 'W', 'D', 'P', 'A', 'C', 'K', '1'};
constexpr char kEndMagic[8] = {'R', 'W', 'D', 'P', 'A', 'C', 'K', 'E'};
constexpr std::size_t kTrailerBytes = 24;  // index offset, index size, end magic
// Extents beyond this are refused before any size is computed from them, so
// no product overflows (2^28 outputs or inputs is far past any model).
constexpr std::int64_t kMaxExtent = std::int64_t{1} << 28;

const char* element_name(Element e) {
  switch (e) {
    case Element::F32: return "f32";
    case Element::BF16: return "bf16";
    case Element::F16: return "f16";
    case Element::Q8: return "q8";
  }
  return "?";
}

std::uint64_t round_up(std::uint64_t n) { return (n + kPackAlignment - 1) / kPackAlignment * kPackAlignment; }

void put_u64(std::byte* dst, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) dst[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}

std::uint64_t get_u64(const std::byte* src) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<std::uint64_t>(src[i]);
  return v;
}

std::string errno_message(int err) { return std::strerror(err); }

bool is_source_name(const std::string& name) {
  return name == "config.json" || name == "generation_config.json" || name == "model.safetensors.index.json" ||
         name.ends_with(".safetensors");
}

}  // namespace

std::vector<PackSource> pack_sources(const std::string& dir) {
  std::vector<PackSource> sources;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) throw Error(dir + ": cannot list the model directory: " + ec.message());
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    if (!is_source_name(name)) continue;
    struct stat st {};
    if (::stat(e.path().c_str(), &st) != 0) throw Error(e.path().string() + ": cannot stat: " + errno_message(errno));
    if (!S_ISREG(st.st_mode)) continue;
    sources.push_back({name, static_cast<std::uint64_t>(st.st_size),
                       static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec});
  }
  std::sort(sources.begin(), sources.end(), [](const PackSource& a, const PackSource& b) { return a.name < b.name; });
  return sources;
}

std::string pack_file_name(std::string_view weights) { return "rewind." + std::string(weights) + ".pack"; }

std::uint64_t write_pack(const std::string& path, const std::vector<PackedMatrixRecord>& matrices,
                         const PackInfo& info) {
  static const std::array<std::byte, kPackAlignment> zeros{};
  std::vector<std::span<const std::byte>> parts;
  std::array<std::byte, sizeof kMagic> magic;
  std::memcpy(magic.data(), kMagic, sizeof kMagic);
  parts.push_back(magic);
  parts.push_back(std::span(zeros).first(kPackAlignment - sizeof kMagic));
  nlohmann::json index = {{"format", "rewind.pack"},
                          {"version", kPackFileVersion},
                          {"panel_width", kernels::PackedMatrix::kPanelWidth},
                          {"q8_block", kernels::PackedMatrix::kQ8Block},
                          {"weights", info.weights},
                          {"fingerprint", info.fingerprint},
                          {"parameter_count", info.parameter_count},
                          {"from_q8_checkpoint", info.from_q8_checkpoint}};
  nlohmann::json sources = nlohmann::json::array();
  for (const PackSource& s : info.sources) {
    sources.push_back({{"name", s.name}, {"bytes", s.bytes}, {"mtime_ns", s.mtime_ns}});
  }
  index["sources"] = std::move(sources);
  nlohmann::json list = nlohmann::json::array();
  std::set<std::string, std::less<>> keys;
  std::uint64_t offset = kPackAlignment;
  for (const PackedMatrixRecord& m : matrices) {
    if (m.key.empty() || !keys.insert(m.key).second) {
      throw InvalidArgument("write_pack: matrix key '" + m.key + "' is empty or repeated; keys are unique names");
    }
    if (m.out < 0 || m.in < 0 || m.panels.size() != kernels::PackedMatrix::storage_bytes(m.element, m.out, m.in)) {
      throw InvalidArgument("write_pack: matrix '" + m.key + "' has " + std::to_string(m.panels.size()) +
                            " bytes of panels, which is not a " + element_name(m.element) + " [" +
                            std::to_string(m.out) + ", " + std::to_string(m.in) + "] matrix");
    }
    list.push_back(
        {{"key", m.key}, {"element", element_name(m.element)}, {"out", m.out}, {"in", m.in}, {"offset", offset}});
    parts.push_back(m.panels);
    const std::uint64_t padded = round_up(m.panels.size());
    if (padded > m.panels.size()) parts.push_back(std::span(zeros).first(padded - m.panels.size()));
    offset += padded;
  }
  index["matrices"] = std::move(list);
  const std::string text = index.dump();
  parts.push_back(std::as_bytes(std::span(text)));
  std::array<std::byte, kTrailerBytes> trailer;
  put_u64(trailer.data(), offset);
  put_u64(trailer.data() + 8, text.size());
  std::memcpy(trailer.data() + 16, kEndMagic, sizeof kEndMagic);
  parts.push_back(trailer);
  write_file_atomically(path, parts);
  return offset + text.size() + kTrailerBytes;
}

namespace {

// The fields of a pack's index, checked; throws FormatError naming `path`.
struct IndexReader {
  const std::string& path;

  [[noreturn]] void fail(const std::string& what) const { throw FormatError(path + ": " + what); }

  const nlohmann::json& field(const nlohmann::json& object, const char* name, const std::string& where) const {
    const auto it = object.find(name);
    if (it == object.end()) fail(where + " has no '" + name + "'");
    return *it;
  }
  std::string text(const nlohmann::json& object, const char* name, const std::string& where) const {
    const nlohmann::json& v = field(object, name, where);
    if (!v.is_string()) fail(where + "'s '" + name + "' is not a string");
    return v.get<std::string>();
  }
  std::int64_t integer(const nlohmann::json& object, const char* name, const std::string& where, std::int64_t lo,
                       std::int64_t hi) const {
    const nlohmann::json& v = field(object, name, where);
    if (!v.is_number_integer()) fail(where + "'s '" + name + "' is not an integer");
    const bool in_range = v.is_number_unsigned() ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(hi)
                                                 : v.get<std::int64_t>() >= lo && v.get<std::int64_t>() <= hi;
    if (!in_range) {
      fail(where + "'s '" + name + "' is " + v.dump() + ", outside [" + std::to_string(lo) + ", " + std::to_string(hi) +
           "]");
    }
    return v.get<std::int64_t>();
  }
};

Element element_from(const IndexReader& r, const std::string& name, const std::string& where) {
  for (const Element e : {Element::F32, Element::BF16, Element::F16, Element::Q8}) {
    if (name == element_name(e)) return e;
  }
  r.fail(where + "'s element '" + name + "' is not one of f32, bf16, f16, q8");
}

// Pack file `path` mapped read-only and prefaulted; its size in *size.
std::shared_ptr<const std::byte> map_pack(const std::string& path, std::uint64_t* size_out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + errno_message(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(path + ": cannot stat: " + errno_message(err));
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < kPackAlignment + kTrailerBytes) {
    ::close(fd);
    throw FormatError(path + ": " + std::to_string(size) + " bytes, too short for a pack file (at least " +
                      std::to_string(kPackAlignment + kTrailerBytes) + ")");
  }
  int flags = MAP_PRIVATE;
#if defined(MAP_POPULATE)
  flags |= MAP_POPULATE;  // one pass over the page tables now, no fault per page in the first forward
#endif
  void* map = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, flags, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) throw Error(path + ": cannot mmap: " + errno_message(map_errno));
  *size_out = size;
  return std::shared_ptr<const std::byte>(static_cast<const std::byte*>(map), [size](const std::byte* m) {
    ::munmap(const_cast<std::byte*>(m), static_cast<std::size_t>(size));
  });
}

// The index's format, version and layout, checked, and its PackInfo.
PackInfo read_info(const IndexReader& r, const nlohmann::json& index) {
  if (!index.is_object() || r.text(index, "format", "the index") != "rewind.pack") r.fail("the index is not a pack's");
  const std::int64_t version = r.integer(index, "version", "the index", 0, kMaxExtent);
  if (version != kPackFileVersion) {
    r.fail("pack version " + std::to_string(version) + "; this build reads version " +
           std::to_string(kPackFileVersion) + " only (rewrite it with rewind pack)");
  }
  if (r.integer(index, "panel_width", "the index", 0, kMaxExtent) != kernels::PackedMatrix::kPanelWidth ||
      r.integer(index, "q8_block", "the index", 0, kMaxExtent) != kernels::PackedMatrix::kQ8Block) {
    r.fail("panels of another layout (panel_width / q8_block differ from this build's " +
           std::to_string(kernels::PackedMatrix::kPanelWidth) + " / " +
           std::to_string(kernels::PackedMatrix::kQ8Block) + "; rewrite it with rewind pack)");
  }
  PackInfo info;
  info.weights = r.text(index, "weights", "the index");
  info.fingerprint = r.text(index, "fingerprint", "the index");
  info.parameter_count = r.integer(index, "parameter_count", "the index", 0, INT64_MAX);
  const nlohmann::json& from_q8 = r.field(index, "from_q8_checkpoint", "the index");
  if (!from_q8.is_boolean()) r.fail("the index's 'from_q8_checkpoint' is not a boolean");
  info.from_q8_checkpoint = from_q8.get<bool>();
  const nlohmann::json& sources = r.field(index, "sources", "the index");
  if (!sources.is_array()) r.fail("the index's 'sources' is not an array");
  for (const nlohmann::json& s : sources) {
    if (!s.is_object()) r.fail("a source is not an object");
    info.sources.push_back({r.text(s, "name", "a source"),
                            static_cast<std::uint64_t>(r.integer(s, "bytes", "a source", 0, INT64_MAX)),
                            r.integer(s, "mtime_ns", "a source", INT64_MIN, INT64_MAX)});
  }
  return info;
}

}  // namespace

PackFile PackFile::open(const std::string& path) {
  PackFile p;
  p.path_ = path;
  p.mapping_ = map_pack(path, &p.file_bytes_);
  const std::uint64_t size = p.file_bytes_;
  const std::byte* base = p.mapping_.get();
  const IndexReader r{path};
  if (std::memcmp(base, kMagic, sizeof kMagic) != 0) r.fail("not a pack file (no RWDPACK1 magic)");
  const std::byte* trailer = base + size - kTrailerBytes;
  if (std::memcmp(trailer + 16, kEndMagic, sizeof kEndMagic) != 0)
    r.fail("truncated or not a pack file (no end magic)");
  const std::uint64_t index_offset = get_u64(trailer), index_bytes = get_u64(trailer + 8);
  if (index_offset < kPackAlignment || index_offset > size - kTrailerBytes ||
      index_bytes != size - kTrailerBytes - index_offset) {
    r.fail("the index's place (offset " + std::to_string(index_offset) + ", " + std::to_string(index_bytes) +
           " bytes) does not fit the file's " + std::to_string(size) + " bytes");
  }
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(reinterpret_cast<const char*>(base + index_offset),
                                  reinterpret_cast<const char*>(base + index_offset + index_bytes));
  } catch (const nlohmann::json::exception& e) {
    r.fail(std::string("the index is not JSON: ") + e.what());
  }
  p.info_ = read_info(r, index);
  const nlohmann::json& list = r.field(index, "matrices", "the index");
  if (!list.is_array()) r.fail("the index's 'matrices' is not an array");
  std::set<std::string, std::less<>> keys;
  std::uint64_t next = kPackAlignment;  // where the next matrix may start
  for (const nlohmann::json& m : list) {
    if (!m.is_object()) r.fail("a matrix is not an object");
    const std::string key = r.text(m, "key", "a matrix");
    const std::string where = "matrix '" + key + "'";
    if (key.empty() || !keys.insert(key).second) r.fail(where + ": the key is empty or repeated");
    Entry e{key, element_from(r, r.text(m, "element", where), where), r.integer(m, "out", where, 0, kMaxExtent),
            r.integer(m, "in", where, 0, kMaxExtent),
            static_cast<std::uint64_t>(r.integer(m, "offset", where, 0, INT64_MAX))};
    const std::uint64_t bytes = kernels::PackedMatrix::storage_bytes(e.element, e.out, e.in);
    if (e.offset % kPackAlignment != 0 || e.offset < next || bytes > index_offset || e.offset > index_offset - bytes) {
      r.fail(where + ": bytes [" + std::to_string(e.offset) + ", +" + std::to_string(bytes) + ") are not aligned to " +
             std::to_string(kPackAlignment) + ", overlap the matrix before, or pass the panel section's end at " +
             std::to_string(index_offset));
    }
    next = e.offset + bytes;
    p.matrices_.push_back(std::move(e));
  }
  return p;
}

kernels::PackedMatrix PackFile::take(std::size_t index, std::string_view key, std::int64_t out, std::int64_t in) const {
  if (index >= matrices_.size()) {
    throw FormatError(path_ + ": holds " + std::to_string(matrices_.size()) + " matrices; the model needs '" +
                      std::string(key) + "' as matrix " + std::to_string(index) +
                      " (a pack of another model or build: rewrite it with rewind pack)");
  }
  const Entry& e = matrices_[index];
  if (e.key != key || e.out != out || e.in != in) {
    throw FormatError(path_ + ": matrix " + std::to_string(index) + " is '" + e.key + "' [" + std::to_string(e.out) +
                      ", " + std::to_string(e.in) + "]; the model needs '" + std::string(key) + "' [" +
                      std::to_string(out) + ", " + std::to_string(in) +
                      "] (a pack of another model or build: rewrite it with rewind pack)");
  }
  return kernels::PackedMatrix::view_of(mapping_, mapping_.get() + e.offset, e.element, e.out, e.in);
}

std::string pack_mismatch(const PackFile& pack, const std::string& dir, std::string_view weights) {
  if (pack.info().weights != weights) {
    return "it holds " + pack.info().weights + " weights, not " + std::string(weights);
  }
  const std::vector<PackSource> now = pack_sources(dir);
  const std::vector<PackSource>& then = pack.info().sources;
  for (const PackSource& s : then) {
    const auto it = std::find_if(now.begin(), now.end(), [&](const PackSource& n) { return n.name == s.name; });
    if (it == now.end()) return s.name + " was removed since it was written";
    if (*it != s) return s.name + " changed since it was written (size or modification time)";
  }
  for (const PackSource& n : now) {
    const auto it = std::find_if(then.begin(), then.end(), [&](const PackSource& s) { return s.name == n.name; });
    if (it == then.end()) return n.name + " was added since it was written";
  }
  return {};
}

}  // namespace rwd::runtime
