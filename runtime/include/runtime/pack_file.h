// runtime/pack_file.h: a model's packed matrices as one file, mapped in place.
//
// Loading a checkpoint packs every matmul weight into kernels::PackedMatrix
// panels, a copy in fresh memory: most of a large model's load time is the
// kernel zeroing those pages and the packing itself. A pack file (written
// by `rewind pack`, write_pack_file in runtime/model.h) holds those panels
// as Model made them, each at a 4096-byte boundary, so Model::load maps
// the file and uses the panels where they lie: nothing is copied, zeroed or
// hashed, and the pages are the page cache's, shared by every process that
// maps the same file.
//
// A pack stands for exactly the files it was made from: it records the
// size and modification time of the model directory's config.json,
// generation_config.json and safetensors files (pack_sources), and
// Model::load uses it only while they are unchanged (pack_mismatch).
// Its contents are trusted as the checkpoint's are: nothing rereads the
// panels to check them, as nothing rereads the safetensors bytes.
//
// Layout (docs/model-format.md): "RWDPACK1", zeros to byte 4096, the
// matrices' panels (each at a multiple of 4096, in the order Model packs
// them), a JSON index, then the index's offset and size (little-endian
// uint64 each) and "RWDPACKE".
//
// Thread safety: a PackFile is immutable after open(); concurrent readers
// are fine.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/kernels.h"

namespace rwd::runtime {

// Version 2: Q8 panels with the values in groups of four inputs (kernels.h);
// a version 1 pack is stale and rewritten by `rewind pack`.
inline constexpr int kPackFileVersion = 2;
inline constexpr std::size_t kPackAlignment = 4096;

// A file a pack depends on, as it was when the pack was written.
struct PackSource {
  std::string name;  // in the model directory
  std::uint64_t bytes = 0;
  std::int64_t mtime_ns = 0;  // modification time, ns since the epoch
  bool operator==(const PackSource&) const = default;
};

// config.json, generation_config.json, model.safetensors.index.json and
// every *.safetensors of model directory `dir` that exist, by name, with
// their size and modification time. Throws rwd::Error when `dir` cannot be
// listed or a file cannot be stat'ed.
std::vector<PackSource> pack_sources(const std::string& dir);

// The file name of the pack of `weights` (weight_format_name: "as-stored"
// or "q8") in a model directory: "rewind.<weights>.pack".
std::string pack_file_name(std::string_view weights);

// One matrix of a pack: what Model::load asks for under `key` (the
// checkpoint tensor it came from, with "#part" for the rows of a fused one).
struct PackedMatrixRecord {
  std::string key;
  kernels::PackedMatrix::Element element = kernels::PackedMatrix::Element::F32;
  std::int64_t out = 0, in = 0;
  std::span<const std::byte> panels;  // storage() of the matrix
};

// What a pack holds besides its matrices.
struct PackInfo {
  std::string weights;      // "as-stored" or "q8"
  std::string fingerprint;  // Model::fingerprint() of the model packed
  std::int64_t parameter_count = 0;
  bool from_q8_checkpoint = false;  // the directory holds a Q8 checkpoint
  std::vector<PackSource> sources;
};

// Writes `matrices` (each at a multiple of kPackAlignment) and `info` as the
// pack file `path`, atomically (a temporary file beside it, synced, then
// renamed over it). Returns the file's size. Throws InvalidArgument (nothing
// written) for a record whose panels are not those of its element, out and
// in or whose key is empty or repeated; rwd::Error when it cannot be written.
std::uint64_t write_pack(const std::string& path, const std::vector<PackedMatrixRecord>& matrices,
                         const PackInfo& info);

class PackFile {
 public:
  // Maps pack file `path` read-only (prefaulted: the first forward takes no
  // page faults) and checks its whole index before anything is exposed:
  // both magics, the index's place, JSON and fields, the version (only
  // kPackFileVersion is read), the panel width and Q8 block this build
  // uses, and every matrix's key (non-empty, unique), element, extents and
  // byte range (aligned, inside the panel section, in order, not
  // overlapping). Throws FormatError naming the file and the problem, or
  // rwd::Error when it cannot be read.
  static PackFile open(const std::string& path);

  const std::string& path() const { return path_; }
  const PackInfo& info() const { return info_; }
  std::size_t size() const { return matrices_.size(); }
  std::uint64_t file_bytes() const { return file_bytes_; }
  // Where matrix `index` lies and what it is, as the index says.
  struct Entry {
    std::string key;
    kernels::PackedMatrix::Element element;
    std::int64_t out, in;
    std::uint64_t offset;  // of its panels, from the start of the file
  };
  // REQUIRES: index < size().
  const Entry& matrix(std::size_t index) const {
    assert(index < matrices_.size());
    return matrices_[index];
  }
  // Matrix `index` as a view of the mapping (kernels::PackedMatrix::view_of;
  // it keeps the mapping alive). Throws FormatError naming the file when
  // there is no such index or the matrix there is not `key` of out x in:
  // a pack made by another build packs in another order. REQUIRES: nothing.
  kernels::PackedMatrix take(std::size_t index, std::string_view key, std::int64_t out, std::int64_t in) const;

 private:
  std::string path_;
  PackInfo info_;
  std::vector<Entry> matrices_;
  std::uint64_t file_bytes_ = 0;
  std::shared_ptr<const std::byte> mapping_;  // unmapped with the last view
};

// Why `pack` cannot stand for the weights `weights` of model directory
// `dir` (another format, or a source file added, removed or changed since
// it was written), as a phrase for a message; empty when it can.
std::string pack_mismatch(const PackFile& pack, const std::string& dir, std::string_view weights);

}  // namespace rwd::runtime
