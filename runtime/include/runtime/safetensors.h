// runtime/safetensors.h: a validating, memory-mapped safetensors reader and
// an atomic writer.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of
// UTF-8 JSON describing every tensor (dtype, shape, byte range), then the
// data section. SafetensorsFile maps the file read-only and checks the whole
// header before anything is exposed: every entry's dtype, shape, byte size
// (overflow-safe), byte range (inside the data section, consistent with the
// shape, not overlapping any other tensor), unique UTF-8 names. A file that
// opens is therefore safe to read through every TensorEntry it returns; a
// file that does not throws rwd::FormatError with a one-line message that
// names the file and the problem. docs/model-format.md lists every check.
//
// Tensor bytes are not copied: TensorEntry::data points into the mapping and
// stays valid as long as the SafetensorsFile that returned it (moving the
// file keeps the pointers valid). The data may be unaligned when the file
// was written by another tool (rewind's writer aligns every tensor to its
// element size), so read elements with memcpy or rwd::load_as_f32.
//
// Thread safety: a SafetensorsFile is immutable after open(); concurrent
// readers are fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rewind/dtype.h"

namespace rwd::runtime {

// One tensor of a mapped file.
struct TensorEntry {
  std::string name;
  DType dtype = DType::F32;         // meaningless when i8
  std::vector<std::int64_t> shape;  // may be empty (a scalar)
  const std::byte* data = nullptr;  // nbytes bytes inside the mapping
  std::size_t nbytes = 0;           // numel() * element size (1 for i8), checked at open
  bool i8 = false;                  // int8 elements (the values of a Q8 checkpoint, docs/quantization.md)

  std::int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps `path` and validates its header. Throws FormatError naming `path`
  // for every malformed file, rwd::Error when the file cannot be opened
  // or mapped.
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // The path given to open(), used in every message about this file.
  const std::string& path() const { return path_; }

  // The entry called `name`, or nullptr when the file has none.
  const TensorEntry* find(std::string_view name) const;
  // The entry called `name`. Throws FormatError "<path>: missing tensor
  // 'name'" when absent: callers ask for tensors their format requires.
  const TensorEntry& get(std::string_view name) const;

  // Tells the system that the mapped pages lying wholly inside `entry`'s
  // bytes are no longer needed (madvise MADV_DONTNEED): they leave this
  // process's resident memory, and a later read of them maps the file again
  // (the data is unchanged). A loader that copied the tensor calls it so the
  // checkpoint is not held twice. Does nothing for an entry of another file.
  void drop_pages(const TensorEntry& entry) const;

  // Tensor names in data order (ascending byte offset).
  std::vector<std::string> names() const;
  // All entries in data order.
  const std::vector<TensorEntry>& entries() const { return entries_; }
  std::size_t size() const { return entries_.size(); }
  // The optional "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void release() noexcept;

  std::string path_;
  void* map_ = nullptr;  // the whole file, PROT_READ
  std::size_t map_size_ = 0;
  std::vector<TensorEntry> entries_;                       // sorted by offset
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> entries_ index
  std::map<std::string, std::string> metadata_;
};

// One tensor for write_safetensors. `bytes` is the raw little-endian element
// data, row-major, exactly numel(shape) * dtype_size(dtype) bytes.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;  // ignored when i8
  std::vector<std::int64_t> shape;
  std::span<const std::byte> bytes;
  bool i8 = false;  // int8 elements ("I8")
};

// Writes `tensors` and `metadata` as a safetensors file at `path`, readable
// by SafetensorsFile::open and by other safetensors implementations (the data
// section has no holes). The header is padded with spaces to a multiple of 8
// bytes and tensors are laid out widest dtype first, so every tensor starts
// at a multiple of its element size. The file appears atomically: it is
// written to a temporary file next to `path`, synced, then renamed.
// Throws InvalidArgument (nothing written) for an empty, duplicate, reserved
// ("__metadata__") or non-UTF-8 name, a negative extent, or a byte count that
// does not match the shape; rwd::Error when the file cannot be written.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes the concatenation of `parts` to `path` atomically: a temporary file
// next to it, synced, then renamed over it (readers never see a partial
// file). Throws rwd::Error naming `path` and the system error otherwise.
void write_file_atomically(const std::string& path, std::span<const std::span<const std::byte>> parts);

// "F32", "F16", "BF16": the dtype spellings of the safetensors header (an
// int8 entry, TensorEntry::i8, is "I8").
std::string_view safetensors_dtype_name(DType dtype);

// "[2, 3, 4]", for messages.
std::string shape_string(std::span<const std::int64_t> shape);

// True when `text` is well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF). On failure `*bad_offset` (if given)
// is the offset of the first byte of the offending sequence.
bool is_valid_utf8(std::string_view text, std::size_t* bad_offset = nullptr);

}  // namespace rwd::runtime
