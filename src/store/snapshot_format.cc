// The snapshot wire format, version 1 (docs/snapshot-format.md is the
// normative description; the offsets below follow its tables).
//
// Layout: a fixed 52-byte header with its checksum, the fingerprint with its
// checksum, one record per layer (a fixed 28-byte head with its checksum,
// then per part a fixed 44-byte descriptor with its checksum, the part's
// bytes and their checksum), and a trailer (tokens, logits, parent) with its
// checksum. Every variable size is read from a field whose checksum was
// verified before the size is used, so a flipped bit never moves a frame:
// every single-bit error is reported as a checksum mismatch (or, in the
// magic and version, as those), and every truncation as one.
#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "cache/layer_kinds.h"
#include "rewind/checksum.h"
#include "rewind/error.h"
#include "rewind/snapshot.h"

namespace rwd {
namespace {

// Integers are written by shifts (any host); tensor elements are copied as
// bytes, which needs a swap per element on a big-endian host (write_elements
// / read_elements). Mixed-endian hosts have neither path.
static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
              "the snapshot format is little-endian; this host is neither little- nor big-endian");

constexpr std::array<unsigned char, 8> kMagic{'R', 'W', 'N', 'D', 'S', 'N', 'A', 'P'};
constexpr std::uint32_t kVersion = 1;

constexpr std::size_t kHeaderBytes = 52;      // magic .. logits count, CRC at 48
constexpr std::size_t kLayerHeadBytes = 28;   // kind .. first, CRC at 24
constexpr std::size_t kDescriptorBytes = 44;  // dtype, rank, 4 extents, CRC at 40
constexpr std::size_t kCrcBytes = 4;

constexpr std::int64_t kMaxLength = std::int64_t{1} << 40;
constexpr std::int64_t kMaxLogits = std::int64_t{1} << 40;
constexpr std::int64_t kMaxElements = std::int64_t{1} << 62;
constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{1} << 48;
constexpr std::size_t kMaxFingerprint = 1024;
constexpr std::size_t kMaxParent = 256;

std::string num(std::int64_t v) { return std::to_string(v); }
std::string unum(std::uint64_t v) { return std::to_string(v); }

std::string hex32(std::uint32_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x00000000";
  for (int i = 9; i >= 2; --i, v >>= 4) s[static_cast<std::size_t>(i)] = kDigits[v & 0xFu];
  return s;
}

std::uint32_t crc_of(const std::byte* p, std::size_t n) { return crc32c(std::span<const std::byte>(p, n)); }

// ---- codes -----------------------------------------------------------------

// Explicit tables rather than the enums' values: reordering an enum must not
// change the format.
constexpr std::array<LayerKind, 10> kKindCodes{LayerKind::FullAttention,
                                               LayerKind::SlidingAttention,
                                               LayerKind::ChunkedAttention,
                                               LayerKind::LinearAttention,
                                               LayerKind::Conv,
                                               LayerKind::Hybrid,
                                               LayerKind::HybridSliding,
                                               LayerKind::SparseAttention,
                                               LayerKind::Moe,
                                               LayerKind::Mlp};
constexpr std::array<DType, 3> kDTypeCodes{DType::F32, DType::F16, DType::BF16};

template <typename T, std::size_t N>
std::uint32_t code_of(const std::array<T, N>& codes, T value) {
  for (std::size_t i = 0; i < N; ++i)
    if (codes[i] == value) return static_cast<std::uint32_t>(i);
  return static_cast<std::uint32_t>(N);  // an enum value outside its enumerators: rejected by the caller
}

std::string layer_where(std::size_t index, LayerKind kind) {
  return "layer " + unum(index) + " (" + std::string(layer_kind_name(kind)) + ")";
}

// What is wrong with a layer of `kind` carrying these parts, or "" when they
// are the parts the kind has (the rules of Layer's constructor).
std::string parts_problem(LayerKind kind, bool attention_parts, std::uint64_t sides, std::uint64_t convs,
                          std::uint64_t recurrents) {
  const std::string name(layer_kind_name(kind));
  if (!detail::kind_has_attention(kind)) {
    if (attention_parts) return name + " has no attention, but keys / values were given";
    if (sides != 0) return name + " has no attention, but " + unum(sides) + " side tensors were given";
  } else if (!attention_parts) {
    return name + " needs keys and values";
  }
  if (kind == LayerKind::SparseAttention && sides == 0) return name + " needs at least one side tensor";
  if (!detail::kind_is_linear(kind)) {
    if (convs != 0) return name + " has no conv state, but " + unum(convs) + " were given";
    if (recurrents != 0) return name + " has no recurrent state, but " + unum(recurrents) + " were given";
    return "";
  }
  if (kind == LayerKind::Conv) {
    if (recurrents != 0) return name + " has no recurrent state, but " + unum(recurrents) + " were given";
    if (convs == 0) return name + " needs at least one conv state";
    return "";
  }
  if (convs == 0 && recurrents == 0) return name + " needs at least one conv or recurrent state";
  return "";
}

// ---- parts -----------------------------------------------------------------

enum class Role { Keys, Values, Side, Conv, Recurrent };

std::string part_name(Role role, std::size_t i) {
  switch (role) {
    case Role::Keys: return "keys";
    case Role::Values: return "values";
    case Role::Side: return "side " + unum(i);
    case Role::Conv: return "conv state " + unum(i);
    case Role::Recurrent: return "recurrent state " + unum(i);
  }
  return "?";
}

struct Shape {
  int rank = 0;
  std::array<std::int64_t, kMaxRank> extents{};
};

std::string shape_string(const Shape& s) {
  std::string out = "[";
  for (int d = 0; d < s.rank; ++d) out += (d ? ", " : "") + num(s.extents[static_cast<std::size_t>(d)]);
  return out + "]";
}

// What is wrong with `s` as a part of `role` when the layer's attention
// parts cover n tokens (values also need the keys' head count), or "".
// Also bounds the element count: every extent that is not n is >= 1 and the
// product of the nonzero extents is at most 2^62, so a Tensor of this shape
// can be built and its byte count computed without overflow.
std::string shape_problem(Role role, const Shape& s, std::int64_t n, std::int64_t heads) {
  const auto e = [&](int d) { return s.extents[static_cast<std::size_t>(d)]; };
  auto expect_rank = [&](int lo, int hi) -> std::string {
    if (s.rank >= lo && s.rank <= hi) return "";
    return "rank " + num(s.rank) + ", expected " + (lo == hi ? num(lo) : num(lo) + " to " + num(hi));
  };
  std::string problem;
  switch (role) {
    case Role::Keys:
    case Role::Values: problem = expect_rank(4, 4); break;
    case Role::Side:
    case Role::Conv: problem = expect_rank(3, 3); break;
    case Role::Recurrent: problem = expect_rank(2, 4); break;
  }
  if (!problem.empty()) return problem;
  const std::string shape = shape_string(s);
  const char* pattern = role == Role::Keys     ? "[1, H, n, key_dim]"
                        : role == Role::Values ? "[1, H, n, value_dim]"
                        : role == Role::Side   ? "[1, n, D]"
                        : role == Role::Conv   ? "[1, channels, K]"
                                               : "[1, shape...]";
  if (e(0) != 1) return "shape " + shape + " must be " + pattern + ": the batch extent must be 1";
  const int token_dim = role == Role::Keys || role == Role::Values ? 2 : role == Role::Side ? 1 : -1;
  for (int d = 1; d < s.rank; ++d) {
    if (d != token_dim && e(d) < 1) {
      return "shape " + shape + " must be " + pattern + " with every extent but n >= 1";
    }
  }
  if (token_dim >= 0 && e(token_dim) != n) {
    return "shape " + shape + " must be " + pattern + " with n = length - first = " + num(n);
  }
  if (role == Role::Values && e(1) != heads) {
    return "shape " + shape + " must have the keys' " + num(heads) + " heads";
  }
  std::int64_t product = 1;
  for (int d = 0; d < s.rank; ++d) {
    if (e(d) == 0) continue;
    if (e(d) > kMaxElements / product) return "shape " + shape + " has more than 2^62 elements";
    product *= e(d);
  }
  return "";
}

std::int64_t numel(const Shape& s) {
  std::int64_t n = 1;
  for (int d = 0; d < s.rank; ++d) n *= s.extents[static_cast<std::size_t>(d)];
  return n;
}

// ---- writing ----------------------------------------------------------------

class Writer {
 public:
  explicit Writer(std::size_t total) {
    try {
      out_.reserve(total);
    } catch (const std::bad_alloc&) {
      throw CapacityError("serialize_snapshot: cannot allocate the " + unum(total) + " bytes of the snapshot");
    } catch (const std::length_error&) {
      throw CapacityError("serialize_snapshot: cannot allocate the " + unum(total) + " bytes of the snapshot");
    }
  }
  std::size_t size() const { return out_.size(); }
  void u32(std::uint32_t v) {
    const std::array<std::byte, 4> b{std::byte(v), std::byte(v >> 8), std::byte(v >> 16), std::byte(v >> 24)};
    out_.insert(out_.end(), b.begin(), b.end());
  }
  void i64(std::int64_t value) {
    const auto v = static_cast<std::uint64_t>(value);
    u32(static_cast<std::uint32_t>(v));
    u32(static_cast<std::uint32_t>(v >> 32));
  }
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  // Copies n elements of `element` bytes each, little-endian.
  void elements(const void* p, std::size_t n, std::size_t element) {
    const std::size_t start = out_.size();
    bytes(p, n * element);
    if constexpr (std::endian::native == std::endian::big) {
      std::byte* q = out_.data() + start;
      for (std::size_t i = 0; i < n; ++i, q += element) std::reverse(q, q + element);
    }
    (void)start;
  }
  // Appends the CRC-32C of the bytes written since `from`.
  void crc_since(std::size_t from) { u32(crc_of(out_.data() + from, out_.size() - from)); }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

[[noreturn]] void invalid(const std::string& what) { throw InvalidArgument("serialize_snapshot: " + what); }

bool is_empty_tensor(const Tensor& t) { return t.view().rank == 0 && t.view().data == nullptr; }

Shape shape_of(const TensorView& v) {
  Shape s;
  s.rank = v.rank;
  for (int d = 0; d < v.rank; ++d) s.extents[static_cast<std::size_t>(d)] = v.shape[static_cast<std::size_t>(d)];
  return s;
}

// Checks one part of a snapshot for serialization; returns its data bytes.
std::size_t check_tensor(const std::string& where, Role role, std::size_t i, const Tensor& t, std::int64_t n,
                         std::int64_t heads) {
  const TensorView& v = t.view();
  const std::string what = where + " " + part_name(role, i);
  if (code_of(kDTypeCodes, v.dtype) >= kDTypeCodes.size()) {
    invalid(what + ": unknown dtype " + num(static_cast<int>(v.dtype)));
  }
  if (v.rank < 0 || v.rank > kMaxRank) invalid(what + ": rank " + num(v.rank) + " is outside [0, 4]");
  const Shape s = shape_of(v);
  if (const std::string p = shape_problem(role, s, n, heads); !p.empty()) invalid(what + ": " + p);
  if (!v.is_contiguous()) invalid(what + ": tensor " + v.describe() + " is not contiguous");
  const auto bytes = static_cast<std::uint64_t>(numel(s)) * dtype_size(v.dtype);
  if (bytes > kMaxTensorBytes) invalid(what + ": " + v.describe() + " needs more than 2^48 bytes");
  if (bytes > 0 && v.data == nullptr) invalid(what + ": tensor " + v.describe() + " has no data");
  return static_cast<std::size_t>(bytes);
}

void write_part(Writer& w, const Tensor& t, std::size_t bytes) {
  const TensorView& v = t.view();
  const std::size_t head = w.size();
  w.u32(code_of(kDTypeCodes, v.dtype));
  w.u32(static_cast<std::uint32_t>(v.rank));
  for (int d = 0; d < kMaxRank; ++d) w.i64(d < v.rank ? v.shape[static_cast<std::size_t>(d)] : 0);
  w.crc_since(head);
  const std::size_t data = w.size();
  if (bytes > 0) w.elements(v.data, bytes / dtype_size(v.dtype), dtype_size(v.dtype));
  w.crc_since(data);
}

bool is_parent_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '-';
}

// ---- reading ----------------------------------------------------------------

[[noreturn]] void malformed(const std::string& what) { throw FormatError("snapshot: " + what); }

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  std::size_t pos() const { return pos_; }
  std::size_t end() const { return in_.size(); }
  std::size_t remaining() const { return in_.size() - pos_; }
  const std::byte* here() const { return in_.data() + pos_; }

  // Throws unless `n` more bytes are there. `what` is a callable building
  // the field's name, so the happy path builds no strings.
  template <typename What>
  void need(std::uint64_t n, What&& what) const {
    if (n > remaining()) {
      malformed("truncated at byte " + unum(in_.size()) + " while reading " + what() + " (bytes [" + unum(pos_) + ", " +
                unum(pos_ + n) + ") needed)");
    }
  }
  std::uint32_t u32() {
    const std::byte* p = here();
    pos_ += 4;
    return std::to_integer<std::uint32_t>(p[0]) | std::to_integer<std::uint32_t>(p[1]) << 8 |
           std::to_integer<std::uint32_t>(p[2]) << 16 | std::to_integer<std::uint32_t>(p[3]) << 24;
  }
  std::int64_t i64() {
    const std::uint64_t lo = u32();
    const std::uint64_t hi = u32();
    return static_cast<std::int64_t>(lo | hi << 32);
  }
  const std::byte* skip(std::size_t n) {
    const std::byte* p = here();
    pos_ += n;
    return p;
  }
  // Reads the stored CRC after the bytes [from, pos()) and compares.
  template <typename What>
  void check_crc(std::size_t from, What&& what) {
    const std::uint32_t computed = crc_of(in_.data() + from, pos_ - from);
    const std::uint32_t stored = u32();
    if (stored != computed) {
      malformed(what() + ": checksum mismatch (stored " + hex32(stored) + ", computed " + hex32(computed) +
                " over bytes [" + unum(from) + ", " + unum(pos_ - kCrcBytes) + "))");
    }
  }

 private:
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

struct Header {
  std::uint32_t version = 0;
  std::int64_t length = 0;
  std::uint32_t num_layers = 0;
  std::uint32_t parent_bytes = 0;
  std::int64_t num_tokens = 0;
  std::int64_t num_logits = 0;
  std::string fingerprint;
};

Header read_header(Reader& r) {
  r.need(kHeaderBytes, [] { return std::string("the header"); });
  if (std::memcmp(r.here(), kMagic.data(), kMagic.size()) != 0) {
    malformed("not a rewind snapshot: the first 8 bytes are not the magic \"RWNDSNAP\"");
  }
  r.skip(kMagic.size());
  Header h;
  h.version = r.u32();
  if (h.version != kVersion) {
    malformed("unsupported version " + unum(h.version) + " (this build reads version " + unum(kVersion) + ")");
  }
  const std::uint32_t fingerprint_bytes = r.u32();
  h.length = r.i64();
  h.num_layers = r.u32();
  h.parent_bytes = r.u32();
  h.num_tokens = r.i64();
  h.num_logits = r.i64();
  r.check_crc(0, [] { return std::string("header"); });
  if (fingerprint_bytes > kMaxFingerprint) {
    malformed("header: fingerprint of " + unum(fingerprint_bytes) + " bytes, at most " + unum(kMaxFingerprint) +
              " allowed");
  }
  if (h.length < 0 || h.length > kMaxLength) malformed("header: length " + num(h.length) + " is outside [0, 2^40]");
  if (h.parent_bytes > kMaxParent) {
    malformed("header: parent key of " + unum(h.parent_bytes) + " bytes, at most " + unum(kMaxParent) + " allowed");
  }
  if (h.num_tokens < 0 || h.num_tokens > h.length) {
    malformed("header: token count " + num(h.num_tokens) + " is outside [0, length = " + num(h.length) + "]");
  }
  if (h.num_logits < 0 || h.num_logits > kMaxLogits) {
    malformed("header: logits count " + num(h.num_logits) + " is outside [0, 2^40]");
  }
  r.need(std::uint64_t{fingerprint_bytes} + kCrcBytes, [] { return std::string("the fingerprint"); });
  const std::size_t start = r.pos();
  const auto* p = reinterpret_cast<const char*>(r.skip(fingerprint_bytes));
  r.check_crc(start, [] { return std::string("fingerprint"); });
  h.fingerprint.assign(p, fingerprint_bytes);
  return h;
}

// Reads one part (descriptor, data, checksums) into a new Tensor. Everything
// is validated, and the data checksum verified, before the allocation, whose
// size the remaining input bounds.
Tensor read_part(Reader& r, const std::string& where, Role role, std::size_t i, std::int64_t n, std::int64_t heads) {
  const auto what = [&] { return where + " " + part_name(role, i); };
  r.need(kDescriptorBytes, [&] { return what() + " descriptor"; });
  const std::size_t head = r.pos();
  const std::uint32_t dtype_code = r.u32();
  const std::uint32_t rank = r.u32();
  Shape s;
  for (auto& e : s.extents) e = r.i64();
  r.check_crc(head, [&] { return what() + " descriptor"; });
  if (dtype_code >= kDTypeCodes.size()) {
    malformed(what() + ": unknown dtype code " + unum(dtype_code) + " (known: 0 f32, 1 f16, 2 bf16)");
  }
  const DType dtype = kDTypeCodes[dtype_code];
  if (rank > kMaxRank) malformed(what() + ": rank " + unum(rank) + " is outside [0, 4]");
  s.rank = static_cast<int>(rank);
  for (int d = s.rank; d < kMaxRank; ++d) {
    if (s.extents[static_cast<std::size_t>(d)] != 0) {
      malformed(what() + ": unused extent " + num(d) + " of a rank-" + unum(rank) + " tensor is " +
                num(s.extents[static_cast<std::size_t>(d)]) + ", must be 0");
    }
  }
  if (const std::string p = shape_problem(role, s, n, heads); !p.empty()) malformed(what() + ": " + p);
  const auto count = static_cast<std::uint64_t>(numel(s));
  const std::size_t element = dtype_size(dtype);
  // count <= 2^62 and element <= 4: compare by division, as count * element
  // may not fit in 64 bits.
  if (count > r.remaining() / element || r.remaining() - count * element < kCrcBytes) {
    malformed("truncated at byte " + unum(r.end()) + " while reading " + what() + " data: " + unum(count) + " " +
              std::string(dtype_name(dtype)) + " elements and a checksum from byte " + unum(r.pos()) + ", " +
              unum(r.remaining()) + " bytes left");
  }
  const std::size_t bytes = static_cast<std::size_t>(count) * element;
  const std::size_t start = r.pos();
  const std::byte* data = r.skip(bytes);
  r.check_crc(start, what);
  Tensor t(dtype, s.extents.data(), s.rank);
  if (bytes > 0) {
    std::memcpy(t.data<std::byte>(), data, bytes);
    if constexpr (std::endian::native == std::endian::big) {
      auto* q = t.data<std::byte>();
      for (std::size_t k = 0; k < bytes; k += element) std::reverse(q + k, q + k + element);
    }
  }
  return t;
}

LayerSnapshot read_layer(Reader& r, std::size_t index, std::int64_t length) {
  r.need(kLayerHeadBytes, [&] { return "layer " + unum(index) + " head"; });
  const std::size_t head = r.pos();
  const std::uint32_t kind_code = r.u32();
  const std::uint32_t sides = r.u32();
  const std::uint32_t convs = r.u32();
  const std::uint32_t recurrents = r.u32();
  const std::int64_t first = r.i64();
  r.check_crc(head, [&] { return "layer " + unum(index) + " head"; });
  if (kind_code >= kKindCodes.size()) {
    malformed("layer " + unum(index) + ": unknown kind code " + unum(kind_code) + " (known: 0 to " +
              unum(kKindCodes.size() - 1) + ")");
  }
  LayerSnapshot layer;
  layer.kind = kKindCodes[kind_code];
  const std::string where = layer_where(index, layer.kind);
  const bool attention = detail::kind_has_attention(layer.kind);
  if (const std::string p = parts_problem(layer.kind, attention, sides, convs, recurrents); !p.empty()) {
    malformed(where + ": " + p);
  }
  if (first < 0 || first > length) {
    malformed(where + ": first " + num(first) + " is outside [0, length = " + num(length) + "]");
  }
  layer.first = first;
  const std::int64_t n = length - first;
  // Each part takes at least a descriptor and a data checksum, so the input
  // bounds what these reserve.
  const auto bounded = [&](std::uint32_t count) {
    return std::min<std::size_t>(count, r.remaining() / (kDescriptorBytes + kCrcBytes));
  };
  if (attention) {
    layer.keys = read_part(r, where, Role::Keys, 0, n, 0);
    layer.values = read_part(r, where, Role::Values, 0, n, layer.keys.view().shape[1]);
  }
  layer.sides.reserve(bounded(sides));
  for (std::uint32_t i = 0; i < sides; ++i) layer.sides.push_back(read_part(r, where, Role::Side, i, n, 0));
  layer.conv_states.reserve(bounded(convs));
  for (std::uint32_t i = 0; i < convs; ++i) layer.conv_states.push_back(read_part(r, where, Role::Conv, i, n, 0));
  layer.recurrent_states.reserve(bounded(recurrents));
  for (std::uint32_t i = 0; i < recurrents; ++i) {
    layer.recurrent_states.push_back(read_part(r, where, Role::Recurrent, i, n, 0));
  }
  return layer;
}

}  // namespace

// ---- serialize ---------------------------------------------------------------

namespace {

// serialize_snapshot's checks of everything but the layers; the number of
// logits (0 for none).
std::int64_t check_snapshot_fields(const Snapshot& snapshot, std::string_view model_fingerprint) {
  if (model_fingerprint.size() > kMaxFingerprint) {
    invalid("model fingerprint of " + unum(model_fingerprint.size()) + " bytes, at most " + unum(kMaxFingerprint) +
            " allowed");
  }
  const std::int64_t L = snapshot.length;
  if (L < 0 || L > kMaxLength) invalid("length " + num(L) + " is outside [0, 2^40]");
  if (snapshot.layers.size() > std::numeric_limits<std::uint32_t>::max()) {
    invalid(unum(snapshot.layers.size()) + " layers, at most 2^32 - 1 allowed");
  }
  if (snapshot.tokens.size() > static_cast<std::uint64_t>(L)) {
    invalid(unum(snapshot.tokens.size()) + " tokens, more than the length " + num(L));
  }
  if (snapshot.parent.size() > kMaxParent) {
    invalid("parent key of " + unum(snapshot.parent.size()) + " characters, at most " + unum(kMaxParent) + " allowed");
  }
  for (std::size_t i = 0; i < snapshot.parent.size(); ++i) {
    if (!is_parent_char(snapshot.parent[i])) {
      invalid("parent key \"" + snapshot.parent + "\" has character " +
              num(static_cast<unsigned char>(snapshot.parent[i])) + " at index " + unum(i) +
              "; allowed are [A-Za-z0-9._:-]");
    }
  }
  if (is_empty_tensor(snapshot.logits)) return 0;
  const TensorView& v = snapshot.logits.view();
  if (v.rank != 1 || v.dtype != DType::F32 || v.shape[0] < 1 || v.shape[0] > kMaxLogits || v.data == nullptr) {
    invalid("logits " + v.describe() + " must be [V] f32 with 1 <= V <= 2^40, or an empty Tensor for none");
  }
  return v.shape[0];
}

// One tensor to write, checked, with its byte count.
struct SizedPart {
  const Tensor* tensor;
  std::size_t bytes;
};

// Checks every layer of `snapshot`, appending its tensors in file order to
// `parts`; the bytes the layers take in the file.
std::uint64_t check_layers(const Snapshot& snapshot, std::vector<SizedPart>& parts) {
  const std::int64_t L = snapshot.length;
  std::uint64_t total = 0;
  for (std::size_t li = 0; li < snapshot.layers.size(); ++li) {
    const LayerSnapshot& layer = snapshot.layers[li];
    if (code_of(kKindCodes, layer.kind) >= kKindCodes.size()) {
      invalid("layer " + unum(li) + ": unknown kind " + num(static_cast<int>(layer.kind)));
    }
    const std::string where = layer_where(li, layer.kind);
    const bool attention_parts = !is_empty_tensor(layer.keys) || !is_empty_tensor(layer.values);
    if (const std::string p = parts_problem(layer.kind, attention_parts, layer.sides.size(), layer.conv_states.size(),
                                            layer.recurrent_states.size());
        !p.empty()) {
      invalid(where + ": " + p);
    }
    for (std::size_t c : {layer.sides.size(), layer.conv_states.size(), layer.recurrent_states.size()}) {
      if (c > std::numeric_limits<std::uint32_t>::max()) invalid(where + ": more than 2^32 - 1 parts of one kind");
    }
    if (layer.first < 0 || layer.first > L) {
      invalid(where + ": first " + num(layer.first) + " is outside [0, length = " + num(L) + "]");
    }
    const std::int64_t n = L - layer.first;
    total += kLayerHeadBytes;
    auto add = [&](Role role, std::size_t i, const Tensor& t, std::int64_t heads) {
      const std::size_t bytes = check_tensor(where, role, i, t, n, heads);
      parts.push_back({&t, bytes});
      total += kDescriptorBytes + bytes + kCrcBytes;
    };
    if (attention_parts) {
      add(Role::Keys, 0, layer.keys, 0);
      add(Role::Values, 0, layer.values, layer.keys.view().shape[1]);
    }
    for (std::size_t i = 0; i < layer.sides.size(); ++i) add(Role::Side, i, layer.sides[i], 0);
    for (std::size_t i = 0; i < layer.conv_states.size(); ++i) add(Role::Conv, i, layer.conv_states[i], 0);
    for (std::size_t i = 0; i < layer.recurrent_states.size(); ++i) {
      add(Role::Recurrent, i, layer.recurrent_states[i], 0);
    }
  }
  return total;
}

// Every layer's head and parts (`parts` from check_layers).
void write_layers(Writer& w, const Snapshot& snapshot, const std::vector<SizedPart>& parts) {
  std::size_t next_part = 0;
  for (const LayerSnapshot& layer : snapshot.layers) {
    const std::size_t head = w.size();
    w.u32(code_of(kKindCodes, layer.kind));
    w.u32(static_cast<std::uint32_t>(layer.sides.size()));
    w.u32(static_cast<std::uint32_t>(layer.conv_states.size()));
    w.u32(static_cast<std::uint32_t>(layer.recurrent_states.size()));
    w.i64(layer.first);
    w.crc_since(head);
    const std::size_t count = (detail::kind_has_attention(layer.kind) ? 2 : 0) + layer.sides.size() +
                              layer.conv_states.size() + layer.recurrent_states.size();
    for (std::size_t k = 0; k < count; ++k, ++next_part)
      write_part(w, *parts[next_part].tensor, parts[next_part].bytes);
  }
}

}  // namespace

std::vector<std::byte> serialize_snapshot(const Snapshot& snapshot, std::string_view model_fingerprint) {
  const std::int64_t num_logits = check_snapshot_fields(snapshot, model_fingerprint);
  const std::int64_t L = snapshot.length;
  // Validate everything and size the output first: one allocation, and
  // nothing written for a snapshot that is refused.
  std::vector<SizedPart> parts;
  std::uint64_t total = kHeaderBytes + model_fingerprint.size() + kCrcBytes;
  total += check_layers(snapshot, parts);
  total += 4 * snapshot.tokens.size() + 4 * static_cast<std::uint64_t>(num_logits) + snapshot.parent.size() + kCrcBytes;
  if (total > std::numeric_limits<std::size_t>::max()) {
    throw CapacityError("serialize_snapshot: the snapshot needs " + unum(total) + " bytes");
  }

  Writer w(static_cast<std::size_t>(total));
  w.bytes(kMagic.data(), kMagic.size());
  w.u32(kVersion);
  w.u32(static_cast<std::uint32_t>(model_fingerprint.size()));
  w.i64(L);
  w.u32(static_cast<std::uint32_t>(snapshot.layers.size()));
  w.u32(static_cast<std::uint32_t>(snapshot.parent.size()));
  w.i64(static_cast<std::int64_t>(snapshot.tokens.size()));
  w.i64(num_logits);
  w.crc_since(0);
  const std::size_t fingerprint = w.size();
  w.bytes(model_fingerprint.data(), model_fingerprint.size());
  w.crc_since(fingerprint);

  write_layers(w, snapshot, parts);

  const std::size_t trailer = w.size();
  w.elements(snapshot.tokens.data(), snapshot.tokens.size(), sizeof(std::int32_t));
  if (num_logits > 0) w.elements(snapshot.logits.view().data, static_cast<std::size_t>(num_logits), sizeof(float));
  w.bytes(snapshot.parent.data(), snapshot.parent.size());
  w.crc_since(trailer);
  return w.take();
}

// ---- deserialize ---------------------------------------------------------------

SnapshotHeader read_snapshot_header(std::span<const std::byte> bytes) {
  Reader r(bytes);
  Header h = read_header(r);
  SnapshotHeader out;
  out.version = h.version;
  out.model_fingerprint = std::move(h.fingerprint);
  out.length = h.length;
  out.num_layers = h.num_layers;
  return out;
}

Snapshot deserialize_snapshot(std::span<const std::byte> bytes, std::string* model_fingerprint) {
  Reader r(bytes);
  Header h = read_header(r);
  Snapshot s;
  s.length = h.length;
  // Every layer takes at least its head: the input bounds the reservation.
  s.layers.reserve(std::min<std::size_t>(h.num_layers, r.remaining() / (kLayerHeadBytes)));
  for (std::size_t i = 0; i < h.num_layers; ++i) s.layers.push_back(read_layer(r, i, h.length));

  const auto tokens = static_cast<std::uint64_t>(h.num_tokens);
  const auto logits = static_cast<std::uint64_t>(h.num_logits);
  // tokens <= 2^40, logits <= 2^40, parent <= 256: the sum cannot overflow.
  r.need(4 * tokens + 4 * logits + h.parent_bytes + kCrcBytes, [&] {
    return "the trailer (" + unum(tokens) + " tokens, " + unum(logits) + " logits, " + unum(h.parent_bytes) +
           "-byte parent key)";
  });
  const std::size_t trailer = r.pos();
  const std::byte* token_bytes = r.skip(static_cast<std::size_t>(4 * tokens));
  const std::byte* logit_bytes = r.skip(static_cast<std::size_t>(4 * logits));
  const auto* parent = reinterpret_cast<const char*>(r.skip(h.parent_bytes));
  r.check_crc(trailer, [] { return std::string("trailer (tokens, logits, parent)"); });
  for (std::uint32_t i = 0; i < h.parent_bytes; ++i) {
    if (!is_parent_char(parent[i])) {
      malformed("trailer: parent key has character " + num(static_cast<unsigned char>(parent[i])) + " at index " +
                unum(i) + "; allowed are [A-Za-z0-9._:-]");
    }
  }
  if (r.remaining() != 0) {
    malformed(unum(r.remaining()) + " trailing bytes after the snapshot's end at byte " + unum(r.pos()));
  }

  s.tokens.resize(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < s.tokens.size(); ++i) {
    const std::byte* p = token_bytes + 4 * i;
    const std::uint32_t v = std::to_integer<std::uint32_t>(p[0]) | std::to_integer<std::uint32_t>(p[1]) << 8 |
                            std::to_integer<std::uint32_t>(p[2]) << 16 | std::to_integer<std::uint32_t>(p[3]) << 24;
    s.tokens[i] = static_cast<std::int32_t>(v);
  }
  if (logits > 0) {
    s.logits = Tensor(DType::F32, {h.num_logits});
    std::memcpy(s.logits.data<std::byte>(), logit_bytes, static_cast<std::size_t>(4 * logits));
    if constexpr (std::endian::native == std::endian::big) {
      auto* q = s.logits.data<std::byte>();
      for (std::size_t k = 0; k < 4 * logits; k += 4) std::reverse(q + k, q + k + 4);
    }
  }
  s.parent.assign(parent, h.parent_bytes);
  if (model_fingerprint) *model_fingerprint = std::move(h.fingerprint);
  return s;
}

}  // namespace rwd
