// The serialized snapshot format (rewind/snapshot.h, docs/snapshot-format.md):
// CRC-32C check values, round trips of every layer kind and dtype, the byte
// layout of a tiny snapshot checked by hand against the document, every
// truncation and every single-bit flip of a valid blob, hostile fields
// (with valid checksums, so the field checks themselves are exercised),
// refused serializations, read_snapshot_header, and the fuzz seed corpus.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "conformance/harness.h"
#include "rewind/checksum.h"
#include "rewind/error.h"
#include "rewind/snapshot.h"
#include "store/crc32c.h"

namespace {

using rwd::DType;
using rwd::FormatError;
using rwd::InvalidArgument;
using rwd::LayerKind;
using rwd::LayerSnapshot;
using rwd::Snapshot;
using rwd::Tensor;
using Bytes = std::vector<std::byte>;

// ---- helpers -----------------------------------------------------------------

// CRC-32C one bit at a time, straight from the definition: an independent
// reference for both library implementations.
std::uint32_t crc_reference(const std::byte* p, std::size_t n, std::uint32_t crc = 0) {
  std::uint32_t c = ~crc;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= std::to_integer<std::uint32_t>(p[i]);
    for (int b = 0; b < 8; ++b) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
  }
  return ~c;
}

Bytes bytes_of(std::string_view s) {
  Bytes b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

// Deterministic bytes (NaN and denormal patterns included: the format moves
// bits, not numbers).
void fill(Tensor& t, std::uint32_t seed) {
  auto* p = t.data<std::uint8_t>();
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (std::size_t i = 0; i < t.bytes(); ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<std::uint8_t>(x);
  }
}

Tensor make(DType dtype, std::initializer_list<std::int64_t> shape, std::uint32_t seed) {
  Tensor t(dtype, shape);
  fill(t, seed);
  return t;
}

Tensor make_shape(DType dtype, const std::vector<std::int64_t>& shape, std::uint32_t seed) {
  Tensor t(dtype, shape.data(), static_cast<int>(shape.size()));
  fill(t, seed);
  return t;
}

bool is_empty(const Tensor& t) { return t.view().rank == 0 && t.view().data == nullptr; }

void expect_same_tensor(const Tensor& a, const Tensor& b, const std::string& what) {
  if (is_empty(a) || is_empty(b)) {
    EXPECT_TRUE(is_empty(a) && is_empty(b)) << what;
    return;
  }
  EXPECT_EQ(a.view().rank, b.view().rank) << what;
  EXPECT_TRUE(rwd::bitwise_equal(a, b)) << what << ": " << a.view().describe() << " vs " << b.view().describe();
}

void expect_same(const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.length, b.length);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    const LayerSnapshot& x = a.layers[i];
    const LayerSnapshot& y = b.layers[i];
    const std::string where = "layer " + std::to_string(i);
    EXPECT_EQ(x.kind, y.kind) << where;
    EXPECT_EQ(x.first, y.first) << where;
    expect_same_tensor(x.keys, y.keys, where + " keys");
    expect_same_tensor(x.values, y.values, where + " values");
    ASSERT_EQ(x.sides.size(), y.sides.size()) << where;
    for (std::size_t k = 0; k < x.sides.size(); ++k) expect_same_tensor(x.sides[k], y.sides[k], where + " side");
    ASSERT_EQ(x.conv_states.size(), y.conv_states.size()) << where;
    for (std::size_t k = 0; k < x.conv_states.size(); ++k)
      expect_same_tensor(x.conv_states[k], y.conv_states[k], where + " conv");
    ASSERT_EQ(x.recurrent_states.size(), y.recurrent_states.size()) << where;
    for (std::size_t k = 0; k < x.recurrent_states.size(); ++k)
      expect_same_tensor(x.recurrent_states[k], y.recurrent_states[k], where + " recurrent");
  }
  EXPECT_EQ(a.tokens, b.tokens);
  expect_same_tensor(a.logits, b.logits, "logits");
  EXPECT_EQ(a.parent, b.parent);
}

// Every kind, in LayerKind's order (the conformance harness's list).
const std::vector<LayerKind>& kAllKinds = rwt::kEveryLayerKind;

bool attention_kind(LayerKind k) {
  return k == LayerKind::FullAttention || k == LayerKind::SlidingAttention || k == LayerKind::ChunkedAttention ||
         k == LayerKind::Hybrid || k == LayerKind::HybridSliding || k == LayerKind::SparseAttention;
}

struct LayerShape {
  std::int64_t heads = 2, key_dim = 3, value_dim = 4;
  std::vector<std::int64_t> side_dims;             // attention kinds
  std::vector<std::array<std::int64_t, 2>> convs;  // {channels, K}
  std::vector<std::vector<std::int64_t>> recurrents;
  DType recurrent_dtype = DType::F32;
};

// A layer of `kind` at length L holding rows [first, L), with the parts of
// `shape` the kind has.
LayerSnapshot make_layer(LayerKind kind, DType dtype, std::int64_t L, std::int64_t first, const LayerShape& shape,
                         std::uint32_t seed) {
  LayerSnapshot l;
  l.kind = kind;
  l.first = first;
  const std::int64_t n = L - first;
  if (attention_kind(kind)) {
    l.keys = make(dtype, {1, shape.heads, n, shape.key_dim}, seed + 1);
    l.values = make(dtype, {1, shape.heads, n, shape.value_dim}, seed + 2);
    for (std::size_t i = 0; i < shape.side_dims.size(); ++i)
      l.sides.push_back(make(dtype, {1, n, shape.side_dims[i]}, seed + 10 + static_cast<std::uint32_t>(i)));
  }
  if (kind == LayerKind::LinearAttention || kind == LayerKind::Conv || kind == LayerKind::Hybrid ||
      kind == LayerKind::HybridSliding) {
    for (std::size_t i = 0; i < shape.convs.size(); ++i)
      l.conv_states.push_back(
          make(dtype, {1, shape.convs[i][0], shape.convs[i][1]}, seed + 20 + static_cast<std::uint32_t>(i)));
    if (kind != LayerKind::Conv) {
      for (std::size_t i = 0; i < shape.recurrents.size(); ++i) {
        std::vector<std::int64_t> s{1};
        s.insert(s.end(), shape.recurrents[i].begin(), shape.recurrents[i].end());
        l.recurrent_states.push_back(make_shape(shape.recurrent_dtype, s, seed + 30 + static_cast<std::uint32_t>(i)));
      }
    }
  }
  return l;
}

LayerShape full_shape() {
  LayerShape s;
  s.side_dims = {5, 1};
  s.convs = {{6, 4}, {2, 3}};
  s.recurrents = {{2, 3, 4}, {7}, {2, 5}};
  return s;
}

// A snapshot with one layer of every kind and every optional field.
Snapshot sample_snapshot(DType dtype = DType::F16, std::int64_t L = 6) {
  Snapshot s;
  s.length = L;
  for (std::size_t i = 0; i < kAllKinds.size(); ++i) {
    const std::int64_t first = static_cast<std::int64_t>(i) % (L + 1);
    s.layers.push_back(make_layer(kAllKinds[i], dtype, L, first, full_shape(), static_cast<std::uint32_t>(100 * i)));
  }
  for (std::int64_t t = 0; t < std::min<std::int64_t>(L, 4); ++t)
    s.tokens.push_back(static_cast<std::int32_t>(1000 * t - 7));
  s.logits = make(DType::F32, {9}, 77);
  s.parent = "prefix:Ab.9_-";
  return s;
}

// A small snapshot (every kind, but one part of each sort) for the
// exhaustive truncation and bit-flip tests.
Snapshot small_snapshot() {
  Snapshot s;
  s.length = 2;
  LayerShape shape;
  shape.heads = 1;
  shape.key_dim = 1;
  shape.value_dim = 1;
  shape.side_dims = {1};
  shape.convs = {{1, 2}};
  shape.recurrents = {{2}};
  for (LayerKind kind : {LayerKind::SlidingAttention, LayerKind::HybridSliding, LayerKind::SparseAttention,
                         LayerKind::Conv, LayerKind::Mlp}) {
    s.layers.push_back(make_layer(kind, DType::BF16, 2, 1, shape, static_cast<std::uint32_t>(s.layers.size())));
  }
  s.tokens = {42};
  s.logits = make(DType::F32, {2}, 5);
  s.parent = "p1";
  return s;
}

// ---- blob surgery: patch a field, then recompute the checksum covering it,
// so that the field checks (not the checksums) are what a test exercises.

void put_u32(Bytes& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + static_cast<std::size_t>(i)] = static_cast<std::byte>(v >> (8 * i));
}
void put_i64(Bytes& b, std::size_t at, std::int64_t value) {
  const auto v = static_cast<std::uint64_t>(value);
  put_u32(b, at, static_cast<std::uint32_t>(v));
  put_u32(b, at + 4, static_cast<std::uint32_t>(v >> 32));
}
std::uint32_t get_u32(const Bytes& b, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= std::to_integer<std::uint32_t>(b[at + static_cast<std::size_t>(i)]) << (8 * i);
  return v;
}
std::int64_t get_i64(const Bytes& b, std::size_t at) {
  return static_cast<std::int64_t>(get_u32(b, at) | static_cast<std::uint64_t>(get_u32(b, at + 4)) << 32);
}
// Rewrites the checksum of bytes [from, to) stored at `to`.
void reseal(Bytes& b, std::size_t from, std::size_t to) { put_u32(b, to, crc_reference(b.data() + from, to - from)); }

// Offsets from docs/snapshot-format.md.
constexpr std::size_t kHeader = 52;
constexpr std::size_t kLayerHead = 28;
constexpr std::size_t kDescriptor = 44;
void reseal_header(Bytes& b) { reseal(b, 0, 48); }

std::string format_error(const Bytes& b) {
  try {
    rwd::deserialize_snapshot(b);
  } catch (const FormatError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no FormatError";
  return "";
}

// Deserializing `b` throws FormatError whose message contains `expected`.
// (That nothing proportional to a hostile size is allocated is what the
// fuzzer checks, with -malloc_limit_mb.)
void expect_format_error(const Bytes& b, const std::string& expected) {
  std::string message;
  try {
    rwd::deserialize_snapshot(b);
    ADD_FAILURE() << "accepted; expected FormatError with \"" << expected << "\"";
    return;
  } catch (const FormatError& e) {
    message = e.what();
  }
  // Any other exception (bad_alloc, CapacityError, InvalidArgument) escapes
  // and fails the test.
  EXPECT_NE(message.find(expected), std::string::npos) << "message: " << message << "\nexpected: " << expected;
}

std::string invalid_argument(const Snapshot& s, std::string_view fingerprint = "fp") {
  try {
    rwd::serialize_snapshot(s, fingerprint);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InvalidArgument";
  return "";
}

// ---- CRC-32C -------------------------------------------------------------------

TEST(SnapshotFormatCrc32c, CheckValues) {
  // The standard check value, and RFC 3720 appendix B.4's vectors.
  EXPECT_EQ(rwd::crc32c(bytes_of("123456789")), 0xE3069283u);
  EXPECT_EQ(rwd::crc32c({}), 0x00000000u);
  Bytes zeros(32), ones(32, std::byte{0xFF}), up(32), down(32);
  for (std::size_t i = 0; i < 32; ++i) {
    up[i] = static_cast<std::byte>(i);
    down[i] = static_cast<std::byte>(31 - i);
  }
  EXPECT_EQ(rwd::crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(rwd::crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(rwd::crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(rwd::crc32c(down), 0x113FDB5Cu);
  // One byte, computed by hand with the bitwise definition.
  EXPECT_EQ(rwd::crc32c(bytes_of("a")), 0xC1D04330u);
  EXPECT_EQ(crc_reference(bytes_of("123456789").data(), 9), 0xE3069283u);  // the reference itself
}

TEST(SnapshotFormatCrc32c, ImplementationsAgreeWithTheBitwiseDefinition) {
  Bytes data(9 * 4096 + 1010);  // the longest case below at the largest offset
  std::uint32_t x = 1;
  for (auto& b : data) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 23);
  }
  const bool hardware = rwd::detail::crc32c_hardware_available();
  // Every length up to 64 at every alignment up to 8, then lengths around
  // the hardware path's 3 x 4096-byte stripes.
  std::vector<std::pair<std::size_t, std::size_t>> cases;
  for (std::size_t off = 0; off < 8; ++off)
    for (std::size_t n = 0; n <= 64; ++n) cases.emplace_back(off, n);
  for (std::size_t n : {3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 6 * 4096 + 7, 9 * 4096 + 999})
    for (std::size_t off : {0, 3}) cases.emplace_back(off, n);
  for (const auto& [off, n] : cases) {
    const std::uint32_t want = crc_reference(data.data() + off, n);
    EXPECT_EQ(rwd::detail::crc32c_portable(data.data() + off, n, 0), want) << off << " " << n;
    if (hardware) {
      EXPECT_EQ(rwd::detail::crc32c_hardware(data.data() + off, n, 0), want) << off << " " << n;
    }
    EXPECT_EQ(rwd::crc32c(std::span<const std::byte>(data.data() + off, n)), want);
  }
  if (!hardware) std::printf("note: no SSE4.2 on this CPU; only the table implementation was checked\n");
}

TEST(SnapshotFormatCrc32c, ContinuationEqualsOneCall) {
  const Bytes data = bytes_of("The quick brown fox jumps over the lazy dog, then the CRC continues.");
  const std::uint32_t whole = rwd::crc32c(data);
  for (std::size_t cut = 0; cut <= data.size(); ++cut) {
    const std::span<const std::byte> all(data);
    EXPECT_EQ(rwd::crc32c(all.subspan(cut), rwd::crc32c(all.first(cut))), whole) << cut;
    EXPECT_EQ(rwd::detail::crc32c_portable(data.data() + cut, data.size() - cut,
                                           rwd::detail::crc32c_portable(data.data(), cut, 0)),
              whole);
  }
}

// ---- round trips -----------------------------------------------------------------

TEST(SnapshotFormat, RoundTripEveryKindDtypeAndShape) {
  struct Case {
    std::int64_t L, first;
    LayerShape shape;
  };
  std::vector<Case> cases;
  cases.push_back({0, 0, full_shape()});  // nothing seen yet: n = 0 rows
  cases.push_back({5, 0, full_shape()});
  cases.push_back({9, 4, full_shape()});
  cases.push_back({7, 7, full_shape()});  // every row evicted (n = 0)
  LayerShape wide;
  wide.heads = 8;
  wide.key_dim = 64;
  wide.value_dim = 32;
  wide.side_dims = {128};
  wide.convs = {{48, 4}};
  wide.recurrents = {{4, 16, 16}};
  wide.recurrent_dtype = DType::BF16;
  cases.push_back({33, 1, wide});
  LayerShape sparse_minimum;  // one part of each sort the kind needs
  sparse_minimum.side_dims = {3};
  sparse_minimum.convs = {{3, 2}};
  sparse_minimum.recurrents = {};
  cases.push_back({3, 1, sparse_minimum});
  LayerShape tiny;
  tiny.heads = 1;
  tiny.key_dim = 1;
  tiny.value_dim = 1;
  tiny.side_dims = {1};
  tiny.convs = {{1, 1}};
  tiny.recurrents = {{3, 3}};
  tiny.recurrent_dtype = DType::F16;
  cases.push_back({2, 2, tiny});

  int round_trips = 0;
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    for (const Case& c : cases) {
      for (LayerKind kind : kAllKinds) {
        Snapshot s;
        s.length = c.L;
        s.layers.push_back(make_layer(kind, dtype, c.L, c.first, c.shape, 7));
        s.layers.push_back(make_layer(kind, dtype, c.L, c.L - c.first, c.shape, 8));
        const std::string fingerprint = "model " + std::string(rwd::layer_kind_name(kind));
        const Bytes blob = rwd::serialize_snapshot(s, fingerprint);
        std::string got_fingerprint;
        const Snapshot back = rwd::deserialize_snapshot(blob, &got_fingerprint);
        SCOPED_TRACE(std::string(rwd::layer_kind_name(kind)) + " " + std::string(rwd::dtype_name(dtype)) +
                     " L=" + std::to_string(c.L));
        expect_same(s, back);
        EXPECT_EQ(got_fingerprint, fingerprint);
        EXPECT_EQ(rwd::serialize_snapshot(back, fingerprint), blob);  // canonical
        ++round_trips;
      }
    }
  }
  EXPECT_EQ(round_trips, 3 * 7 * 10);
}

TEST(SnapshotFormat, RoundTripWithEveryOptionalField) {
  for (DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    const Snapshot s = sample_snapshot(dtype);
    const std::string fingerprint(1024, '\xAB');  // the longest allowed, any bytes
    const Bytes blob = rwd::serialize_snapshot(s, fingerprint);
    std::string got = "unchanged?";
    const Snapshot back = rwd::deserialize_snapshot(blob, &got);
    expect_same(s, back);
    EXPECT_EQ(got, fingerprint);
    EXPECT_EQ(rwd::serialize_snapshot(back, fingerprint), blob);
  }
  // The extremes of the optional fields: tokens of every int32, no logits,
  // the longest parent key, an empty fingerprint.
  Snapshot s;
  s.length = std::int64_t{1} << 40;
  s.tokens = {INT32_MIN, -1, 0, INT32_MAX};
  s.parent = std::string(256, 'k');
  s.layers.push_back(make_layer(LayerKind::Conv, DType::F32, s.length, s.length, full_shape(), 3));
  s.layers.push_back(make_layer(LayerKind::Mlp, DType::F32, s.length, 0, full_shape(), 3));
  const Bytes blob = rwd::serialize_snapshot(s, "");
  const Snapshot back = rwd::deserialize_snapshot(blob);
  expect_same(s, back);
  EXPECT_TRUE(is_empty(back.logits));
}

TEST(SnapshotFormat, NoLayersNoFields) {
  const Snapshot s;
  const Bytes blob = rwd::serialize_snapshot(s, "");
  EXPECT_EQ(blob.size(), 52u + 4u + 4u);  // header, empty fingerprint's checksum, empty trailer's checksum
  const Snapshot back = rwd::deserialize_snapshot(blob);
  expect_same(s, back);
}

// Speed is a benchmark's business (docs/performance.md section 10), not a
// test's: this one checks the size and the round trip of 32 MiB.
TEST(SnapshotFormat, LargeSnapshotRoundTrips) {
  // About 32 MiB of attention rows: 4 layers of [1, 8, 2048, 128] f16 x 2.
  Snapshot s;
  s.length = 2048;
  LayerShape shape;
  shape.heads = 8;
  shape.key_dim = 128;
  shape.value_dim = 128;
  for (int i = 0; i < 4; ++i)
    s.layers.push_back(make_layer(LayerKind::FullAttention, DType::F16, 2048, 0, shape, static_cast<std::uint32_t>(i)));
  Bytes blob = rwd::serialize_snapshot(s, "big");
  EXPECT_EQ(blob.size(), 52u + 3 + 4 + 4 * (28 + 2 * (44 + 2u * 8 * 2048 * 128 + 4)) + 4);
  expect_same(s, rwd::deserialize_snapshot(blob));
}

// ---- the byte layout, by hand ----------------------------------------------------------

TEST(SnapshotFormat, HandCheckedBytesOfATinySnapshot) {
  // length 3, one full_attention layer holding positions [1, 3) of one head
  // of width 1, f32 keys {1, 2}, values {-2, 0.5}; one token (7), no
  // logits, parent "p", fingerprint "fp".
  Snapshot s;
  s.length = 3;
  LayerSnapshot l;
  l.kind = LayerKind::FullAttention;
  l.first = 1;
  l.keys = Tensor(DType::F32, {1, 1, 2, 1});
  l.keys.data<float>()[0] = 1.0f;
  l.keys.data<float>()[1] = 2.0f;
  l.values = Tensor(DType::F32, {1, 1, 2, 1});
  l.values.data<float>()[0] = -2.0f;
  l.values.data<float>()[1] = 0.5f;
  s.layers.push_back(std::move(l));
  s.tokens = {7};
  s.parent = "p";
  const Bytes blob = rwd::serialize_snapshot(s, "fp");

  Bytes want;
  auto raw = [&](std::initializer_list<int> bytes) {
    for (int b : bytes) want.push_back(static_cast<std::byte>(b));
  };
  auto seal = [&](std::size_t from) {
    const std::uint32_t c = crc_reference(want.data() + from, want.size() - from);
    raw({static_cast<int>(c & 0xFF), static_cast<int>(c >> 8 & 0xFF), static_cast<int>(c >> 16 & 0xFF),
         static_cast<int>(c >> 24)});
  };
  raw({'R', 'W', 'N', 'D', 'S', 'N', 'A', 'P'});  //  0 magic
  raw({1, 0, 0, 0});                              //  8 version
  raw({2, 0, 0, 0});                              // 12 fingerprint bytes
  raw({3, 0, 0, 0, 0, 0, 0, 0});                  // 16 length
  raw({1, 0, 0, 0});                              // 24 layers
  raw({1, 0, 0, 0});                              // 28 parent bytes
  raw({1, 0, 0, 0, 0, 0, 0, 0});                  // 32 tokens
  raw({0, 0, 0, 0, 0, 0, 0, 0});                  // 40 logits
  seal(0);                                        // 48 header CRC
  raw({'f', 'p'});                                // 52 fingerprint
  seal(52);                                       // 54 its CRC
  const std::size_t layer = want.size();          // 58 layer head
  raw({0, 0, 0, 0});                              //    kind 0 full_attention
  raw({0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});      //    sides, convs, recurrents
  raw({1, 0, 0, 0, 0, 0, 0, 0});                  //    first
  seal(layer);
  for (int part = 0; part < 2; ++part) {
    const std::size_t d = want.size();  // 86 keys, 142 values
    raw({0, 0, 0, 0, 4, 0, 0, 0});      // f32, rank 4
    raw({1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0});
    seal(d);
    const std::size_t data = want.size();
    if (part == 0)
      raw({0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x40});  // 1.0f, 2.0f
    else
      raw({0x00, 0x00, 0x00, 0xC0, 0x00, 0x00, 0x00, 0x3F});  // -2.0f, 0.5f
    seal(data);
  }
  const std::size_t trailer = want.size();  // 198
  raw({7, 0, 0, 0, 'p'});
  seal(trailer);

  ASSERT_EQ(blob.size(), 207u);
  EXPECT_EQ(want.size(), 207u);
  EXPECT_EQ(blob, want);
  EXPECT_EQ(get_u32(blob, 8), 1u);
  EXPECT_EQ(get_i64(blob, 16), 3);
  EXPECT_EQ(layer, 58u);
  EXPECT_EQ(trailer, 198u);
  EXPECT_EQ(get_u32(blob, 48), crc_reference(blob.data(), 48));
}

// ---- corruption ----------------------------------------------------------------------

TEST(SnapshotFormat, EveryTruncationIsAFormatError) {
  for (const Bytes& blob :
       {rwd::serialize_snapshot(small_snapshot(), "fingerprint"), rwd::serialize_snapshot(Snapshot{}, "")}) {
    for (std::size_t n = 0; n < blob.size(); ++n) {
      const Bytes prefix(blob.begin(), blob.begin() + static_cast<std::ptrdiff_t>(n));
      const std::string message = format_error(prefix);
      EXPECT_NE(message.find("truncated at byte " + std::to_string(n) + " while reading"), std::string::npos)
          << n << ": " << message;
    }
  }
  const Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fingerprint");
  // The message names the field being read.
  // Header 52 + fingerprint 11 + 4: layer 0's head at 67, its keys
  // descriptor at 95, the keys data at 139.
  EXPECT_NE(format_error(Bytes(blob.begin(), blob.begin() + 60)).find("while reading the fingerprint"),
            std::string::npos);
  EXPECT_NE(format_error(Bytes(blob.begin(), blob.begin() + 70)).find("while reading layer 0 head"), std::string::npos);
  EXPECT_NE(format_error(Bytes(blob.begin(), blob.begin() + 120)).find("layer 0 (sliding_attention) keys descriptor"),
            std::string::npos);
  EXPECT_NE(format_error(Bytes(blob.begin(), blob.begin() + 140)).find("layer 0 (sliding_attention) keys data"),
            std::string::npos);
}

TEST(SnapshotFormat, EverySingleBitFlipIsDetected) {
  const Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fingerprint");
  ASSERT_GT(blob.size(), 600u);
  std::size_t flips = 0;
  for (std::size_t i = 0; i < blob.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes bad = blob;
      bad[i] ^= static_cast<std::byte>(1 << bit);
      const std::string message = format_error(bad);
      // Sizes are only used once their checksum held, so every flip past the
      // magic and version is reported as a checksum mismatch.
      const char* expected = i < 8 ? "magic" : i < 12 ? "unsupported version" : "checksum mismatch";
      EXPECT_NE(message.find(expected), std::string::npos) << "byte " << i << " bit " << bit << ": " << message;
      ++flips;
    }
  }
  EXPECT_EQ(flips, 8 * blob.size());
}

TEST(SnapshotFormat, ChecksumMismatchNamesLayerAndPart) {
  const Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fingerprint");
  // Layer 0 starts after the header and the 11-byte fingerprint; its keys
  // data after the head and the keys descriptor.
  const std::size_t layer0 = kHeader + 11 + 4;
  const std::size_t keys_data = layer0 + kLayerHead + kDescriptor;
  Bytes bad = blob;
  bad[keys_data] ^= std::byte{0x10};
  EXPECT_NE(format_error(bad).find("layer 0 (sliding_attention) keys: checksum mismatch"), std::string::npos);
  // Keys [1,1,1,1] bf16: 2 data bytes + CRC; the values descriptor follows.
  const std::size_t values_data = keys_data + 2 + 4 + kDescriptor;
  bad = blob;
  bad[values_data + 1] ^= std::byte{0x01};
  EXPECT_NE(format_error(bad).find("layer 0 (sliding_attention) values: checksum mismatch"), std::string::npos);
  bad = blob;
  bad[layer0 + kLayerHead + 5] ^= std::byte{0x01};
  EXPECT_NE(format_error(bad).find("layer 0 (sliding_attention) keys descriptor: checksum mismatch"),
            std::string::npos);
  bad = blob;
  bad[blob.size() - 5] ^= std::byte{0x01};  // the parent's last byte
  EXPECT_NE(format_error(bad).find("trailer (tokens, logits, parent): checksum mismatch"), std::string::npos);
  bad = blob;
  bad[kHeader + 3] ^= std::byte{0x01};
  EXPECT_NE(format_error(bad).find("fingerprint: checksum mismatch"), std::string::npos);
}

TEST(SnapshotFormat, TrailingBytesAreRefused) {
  const Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fp");
  Bytes longer = blob;
  longer.push_back(std::byte{0});
  expect_format_error(longer, "1 trailing bytes after the snapshot's end at byte " + std::to_string(blob.size()));
  Bytes twice = blob;
  twice.insert(twice.end(), blob.begin(), blob.end());
  expect_format_error(twice, std::to_string(blob.size()) + " trailing bytes");
}

// ---- hostile fields (valid checksums) ------------------------------------------

TEST(SnapshotFormat, HostileHeaderFields) {
  const Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fp");
  auto with = [&](std::function<void(Bytes&)> patch) {
    Bytes b = blob;
    patch(b);
    reseal_header(b);
    return b;
  };
  Bytes b = blob;
  b[0] = std::byte{'X'};
  expect_format_error(b, "not a rewind snapshot");
  b = blob;
  put_u32(b, 8, 2);
  expect_format_error(b, "unsupported version 2 (this build reads version 1)");
  b = blob;
  put_u32(b, 8, 0);
  expect_format_error(b, "unsupported version 0");
  expect_format_error(with([](Bytes& x) { put_u32(x, 12, 1025); }), "fingerprint of 1025 bytes, at most 1024");
  expect_format_error(with([](Bytes& x) { put_u32(x, 12, 0xFFFFFFFFu); }), "fingerprint of 4294967295 bytes");
  expect_format_error(with([](Bytes& x) { put_i64(x, 16, -1); }), "length -1 is outside [0, 2^40]");
  expect_format_error(with([](Bytes& x) { put_i64(x, 16, (std::int64_t{1} << 40) + 1); }),
                      "length 1099511627777 is outside [0, 2^40]");
  expect_format_error(with([](Bytes& x) { put_i64(x, 16, INT64_MIN); }), "is outside [0, 2^40]");
  expect_format_error(with([](Bytes& x) { put_u32(x, 28, 257); }), "parent key of 257 bytes, at most 256");
  expect_format_error(with([](Bytes& x) { put_i64(x, 32, 3); }), "token count 3 is outside [0, length = 2]");
  expect_format_error(with([](Bytes& x) { put_i64(x, 32, -1); }), "token count -1");
  expect_format_error(with([](Bytes& x) { put_i64(x, 40, -5); }), "logits count -5 is outside [0, 2^40]");
  expect_format_error(with([](Bytes& x) { put_i64(x, 40, (std::int64_t{1} << 40) + 1); }), "logits count");
  // Sizes the input cannot hold: refused by the bounds, nothing allocated.
  expect_format_error(with([](Bytes& x) { put_i64(x, 40, std::int64_t{1} << 40); }),
                      "while reading the trailer (1 tokens, 1099511627776 logits");
  expect_format_error(with([](Bytes& x) { put_u32(x, 24, 0xFFFFFFFFu); }), "while reading layer 5 head");
  // No layers: the first layer's bytes are read as the trailer.
  expect_format_error(with([](Bytes& x) { put_u32(x, 24, 0); }), "trailer (tokens, logits, parent): checksum mismatch");
  // A grown length makes every attention layer's row count wrong.
  expect_format_error(with([](Bytes& x) { put_i64(x, 16, 3); }), "n = length - first = 2");
}

// Offsets in the blob of small_snapshot() serialized with fingerprint "fp".
struct SmallLayout {
  std::size_t layer0 = kHeader + 2 + 4;
  std::size_t keys0 = layer0 + kLayerHead;  // layer 0's keys descriptor
};

TEST(SnapshotFormat, HostileLayerHeads) {
  const Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fp");
  const SmallLayout at;
  // Sets u32 fields of layer 0's head: {offset, value} pairs.
  auto with = [&](std::initializer_list<std::pair<std::size_t, std::uint32_t>> fields) {
    Bytes b = blob;
    for (const auto& [field, value] : fields) put_u32(b, at.layer0 + field, value);
    reseal(b, at.layer0, at.layer0 + 24);
    return b;
  };
  expect_format_error(with({{0, 10}}), "layer 0: unknown kind code 10 (known: 0 to 9)");
  expect_format_error(with({{0, 0xFFFFFFFFu}}), "unknown kind code 4294967295");
  // Layer 0 is sliding_attention with 1 side, 0 convs, 0 recurrents.
  expect_format_error(with({{0, 4}}), "layer 0 (conv): conv has no attention, but 1 side tensors were given");
  expect_format_error(with({{0, 3}}), "layer 0 (linear_attention): linear_attention has no attention, but 1 side");
  expect_format_error(with({{0, 4}, {4, 0}}), "layer 0 (conv): conv needs at least one conv state");
  expect_format_error(with({{0, 7}, {4, 0}}),
                      "layer 0 (deepseek_sparse_attention): deepseek_sparse_attention needs at least one side tensor");
  expect_format_error(with({{0, 5}, {4, 0}}), "layer 0 (hybrid): hybrid needs at least one conv or recurrent state");
  expect_format_error(with({{8, 1}}), "sliding_attention has no conv state, but 1 were given");
  expect_format_error(with({{12, 2}}), "sliding_attention has no recurrent state, but 2 were given");
  // A kind without parts: its parts are then read as the next layer's head.
  expect_format_error(with({{0, 8}, {4, 0}}), "layer 1 head: checksum mismatch");
  // A huge part count the kind allows: the reservation is bounded by the
  // input (no 2^32-element vector), and the next layer's head does not
  // pass as a side's descriptor.
  expect_format_error(with({{4, 0xFFFFFFFFu}}), "layer 0 (sliding_attention) side 1 descriptor: checksum mismatch");
  Bytes b = blob;
  put_i64(b, at.layer0 + 16, 3);
  reseal(b, at.layer0, at.layer0 + 24);
  expect_format_error(b, "layer 0 (sliding_attention): first 3 is outside [0, length = 2]");
  put_i64(b, at.layer0 + 16, -1);
  reseal(b, at.layer0, at.layer0 + 24);
  expect_format_error(b, "first -1 is outside");
  put_i64(b, at.layer0 + 16, 0);  // n = 2, but the keys hold 1 row
  reseal(b, at.layer0, at.layer0 + 24);
  expect_format_error(
      b, "layer 0 (sliding_attention) keys: shape [1, 1, 1, 1] must be [1, H, n, key_dim] with n = length - first = 2");
}

TEST(SnapshotFormat, HostilePartDescriptors) {
  const Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fp");
  const SmallLayout at;
  const std::size_t keys = at.keys0;
  const std::size_t values = keys + kDescriptor + 2 + 4;  // keys hold one bf16
  auto with = [&](std::size_t descriptor, std::function<void(Bytes&, std::size_t)> patch) {
    Bytes b = blob;
    patch(b, descriptor);
    reseal(b, descriptor, descriptor + 40);
    return b;
  };
  const std::string k = "layer 0 (sliding_attention) keys: ";
  const std::string v = "layer 0 (sliding_attention) values: ";
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_u32(b, d, 3); }),
                      k + "unknown dtype code 3 (known: 0 f32, 1 f16, 2 bf16)");
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_u32(b, d + 4, 5); }),
                      k + "rank 5 is outside [0, 4]");
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_u32(b, d + 4, 3); }),
                      k + "unused extent 3 of a rank-3 tensor is 1, must be 0");
  expect_format_error(with(keys,
                           [](Bytes& b, std::size_t d) {
                             put_u32(b, d + 4, 3);
                             put_i64(b, d + 32, 0);
                           }),
                      k + "rank 3, expected 4");
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_i64(b, d + 8, 2); }), "the batch extent must be 1");
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_i64(b, d + 16, -3); }),
                      k + "shape [1, -3, 1, 1] must be [1, H, n, key_dim] with every extent but n >= 1");
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_i64(b, d + 32, 0); }), "every extent but n >= 1");
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_i64(b, d + 24, 0); }),
                      "with n = length - first = 1");
  // Extents whose product passes 2^62 (2^31 x 2^31 x 2^31): refused before
  // any multiplication can overflow.
  expect_format_error(with(keys,
                           [](Bytes& b, std::size_t d) {
                             put_i64(b, d + 16, std::int64_t{1} << 31);
                             put_i64(b, d + 32, std::int64_t{1} << 31);
                           }),
                      "truncated at byte");
  expect_format_error(with(keys,
                           [](Bytes& b, std::size_t d) {
                             put_i64(b, d + 16, std::int64_t{1} << 40);
                             put_i64(b, d + 32, std::int64_t{1} << 40);
                           }),
                      k + "shape [1, 1099511627776, 1, 1099511627776] has more than 2^62 elements");
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_i64(b, d + 32, INT64_MAX); }),
                      "has more than 2^62 elements");
  // A tensor claiming 2^40 elements in a small input: a truncation, found
  // before anything is allocated.
  expect_format_error(with(keys, [](Bytes& b, std::size_t d) { put_i64(b, d + 32, std::int64_t{1} << 40); }),
                      k.substr(0, k.size() - 2) + " data: 1099511627776 bf16 elements and a checksum");
  // Values must match the keys' heads and rows.
  expect_format_error(with(values, [](Bytes& b, std::size_t d) { put_i64(b, d + 16, 2); }),
                      v + "shape [1, 2, 1, 1] must have the keys' 1 heads");
  expect_format_error(with(values, [](Bytes& b, std::size_t d) { put_i64(b, d + 24, 2); }),
                      v + "shape [1, 1, 2, 1] must be [1, H, n, value_dim] with n = length - first = 1");
}

TEST(SnapshotFormat, HostileTrailer) {
  Snapshot s = small_snapshot();
  const Bytes blob = rwd::serialize_snapshot(s, "fp");
  Bytes b = blob;
  const std::size_t parent = b.size() - 4 - 2;
  b[parent] = std::byte{'/'};
  reseal(b, parent - 4 - 8, b.size() - 4);  // trailer: 1 token, 2 logits, "p1"
  expect_format_error(b, "trailer: parent key has character 47 at index 0; allowed are [A-Za-z0-9._:-]");
}

// ---- refused serializations -------------------------------------------------------

void expect_serialize_refused(const Snapshot& s, const std::string& expected, std::string_view fingerprint = "fp") {
  const std::string message = invalid_argument(s, fingerprint);
  EXPECT_NE(message.find(expected), std::string::npos) << message << "\nexpected: " << expected;
  EXPECT_EQ(message.rfind("serialize_snapshot: ", 0), 0u) << message;
}

Snapshot consistent_f32_snapshot() { return sample_snapshot(DType::F32); }

constexpr std::size_t kSlidingLayer = 1;  // kAllKinds order; first = 1, n = 5

TEST(SnapshotFormat, SerializeRefusesInconsistentSnapshots) {
  expect_serialize_refused(consistent_f32_snapshot(), "model fingerprint of 1025 bytes, at most 1024 allowed",
                           std::string(1025, 'x'));
  Snapshot s = consistent_f32_snapshot();
  s.length = -1;
  expect_serialize_refused(s, "length -1 is outside [0, 2^40]");
  s = consistent_f32_snapshot();
  s.length = (std::int64_t{1} << 40) + 1;
  expect_serialize_refused(s, "length 1099511627777 is outside [0, 2^40]");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].first = 7;
  expect_serialize_refused(s, "layer 1 (sliding_attention): first 7 is outside [0, length = 6]");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].first = -1;
  expect_serialize_refused(s, "layer 1 (sliding_attention): first -1 is outside");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].keys = make(DType::F32, {1, 2, 4, 3}, 1);
  expect_serialize_refused(
      s, "layer 1 (sliding_attention) keys: shape [1, 2, 4, 3] must be [1, H, n, key_dim] with n = length - first = 5");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].values = make(DType::F32, {1, 3, 5, 4}, 1);
  expect_serialize_refused(s, "layer 1 (sliding_attention) values: shape [1, 3, 5, 4] must have the keys' 2 heads");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].keys = make(DType::F32, {2, 2, 5, 3}, 1);
  expect_serialize_refused(s, "keys: shape [2, 2, 5, 3] must be [1, H, n, key_dim]: the batch extent must be 1");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].sides[0] = make(DType::F32, {1, 4, 5}, 1);
  expect_serialize_refused(
      s, "layer 1 (sliding_attention) side 0: shape [1, 4, 5] must be [1, n, D] with n = length - first = 5");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].keys = Tensor();
  expect_serialize_refused(s, "layer 1 (sliding_attention) keys: rank 0, expected 4");
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].keys = Tensor();
  s.layers[kSlidingLayer].values = Tensor();
  expect_serialize_refused(s, "layer 1 (sliding_attention): sliding_attention needs keys and values");
  // A zero-row tensor whose other extents multiply past 2^62: a Tensor can
  // hold it (it has no bytes), the format cannot describe it canonically.
  s = consistent_f32_snapshot();
  s.layers[kSlidingLayer].first = 6;
  s.layers[kSlidingLayer].keys = Tensor(DType::F32, {1, std::int64_t{1} << 40, 0, std::int64_t{1} << 40});
  s.layers[kSlidingLayer].values = Tensor(DType::F32, {1, std::int64_t{1} << 40, 0, 1});
  s.layers[kSlidingLayer].sides.clear();
  expect_serialize_refused(s, "keys: shape [1, 1099511627776, 0, 1099511627776] has more than 2^62 elements");
}

TEST(SnapshotFormat, SerializeRefusesPartsALayerKindCannotHold) {
  Snapshot s = consistent_f32_snapshot();
  s.layers[4].conv_states[1] = make(DType::F32, {1, 2}, 1);
  expect_serialize_refused(s, "layer 4 (conv) conv state 1: rank 2, expected 3");
  s = consistent_f32_snapshot();
  s.layers[3].recurrent_states[1] = make(DType::F32, {7}, 1);
  expect_serialize_refused(s, "layer 3 (linear_attention) recurrent state 1: rank 1, expected 2 to 4");
  s = consistent_f32_snapshot();
  s.layers[3].recurrent_states[1] = make(DType::F32, {1, 0}, 1);
  expect_serialize_refused(s, "recurrent state 1: shape [1, 0] must be [1, shape...] with every extent but n >= 1");
  s = consistent_f32_snapshot();
  s.layers[4].recurrent_states.push_back(make(DType::F32, {1, 2}, 1));
  expect_serialize_refused(s, "layer 4 (conv): conv has no recurrent state, but 1 were given");
  s = consistent_f32_snapshot();
  s.layers[4].conv_states.clear();
  expect_serialize_refused(s, "layer 4 (conv): conv needs at least one conv state");
  s = consistent_f32_snapshot();
  s.layers[7].sides.clear();
  expect_serialize_refused(
      s, "layer 7 (deepseek_sparse_attention): deepseek_sparse_attention needs at least one side tensor");
  s = consistent_f32_snapshot();
  s.layers[3].conv_states.clear();
  s.layers[3].recurrent_states.clear();
  expect_serialize_refused(s,
                           "layer 3 (linear_attention): linear_attention needs at least one conv or recurrent state");
  s = consistent_f32_snapshot();
  s.layers[9].keys = make(DType::F32, {1, 1, 1, 1}, 1);
  expect_serialize_refused(s, "layer 9 (mlp): mlp has no attention, but keys / values were given");
  s = consistent_f32_snapshot();
  s.layers[9].keys = Tensor(DType::F32, {});  // rank 0 but a scalar's data: not "empty"
  expect_serialize_refused(s, "mlp has no attention");
  s = consistent_f32_snapshot();
  s.layers[8].sides.push_back(make(DType::F32, {1, 6, 1}, 1));
  expect_serialize_refused(s, "layer 8 (moe): moe has no attention, but 1 side tensors were given");
  s = consistent_f32_snapshot();
  s.layers[0].conv_states.push_back(make(DType::F32, {1, 1, 1}, 1));
  expect_serialize_refused(s, "layer 0 (full_attention): full_attention has no conv state, but 1 were given");
  s = consistent_f32_snapshot();
  s.layers[0].kind = static_cast<LayerKind>(42);
  expect_serialize_refused(s, "layer 0: unknown kind 42");
}

TEST(SnapshotFormat, SerializeRefusesInconsistentTrailers) {
  Snapshot s = consistent_f32_snapshot();
  s.tokens.assign(7, 1);
  expect_serialize_refused(s, "7 tokens, more than the length 6");
  s = consistent_f32_snapshot();
  s.parent = "a/b";
  expect_serialize_refused(s, "parent key \"a/b\" has character 47 at index 1; allowed are [A-Za-z0-9._:-]");
  s = consistent_f32_snapshot();
  s.parent = std::string(257, 'a');
  expect_serialize_refused(s, "parent key of 257 characters, at most 256 allowed");
  s = consistent_f32_snapshot();
  s.logits = make(DType::F16, {9}, 1);
  expect_serialize_refused(s, "logits [9] f16 must be [V] f32 with 1 <= V <= 2^40, or an empty Tensor for none");
  s = consistent_f32_snapshot();
  s.logits = make(DType::F32, {1, 9}, 1);
  expect_serialize_refused(s, "logits [1, 9] f32 must be [V] f32");
  s = consistent_f32_snapshot();
  s.logits = Tensor(DType::F32, {0});
  expect_serialize_refused(s, "logits [0] f32 must be [V] f32 with 1 <= V");
  s = consistent_f32_snapshot();
  s.logits = Tensor(DType::F32, {});
  expect_serialize_refused(s, "logits [] f32 must be [V] f32");
}

// ---- read_snapshot_header -------------------------------------------------------------

TEST(SnapshotFormat, ReadSnapshotHeader) {
  const Snapshot s = sample_snapshot();
  const std::string fingerprint = "qwen3-next-80b sha256:0123abcd";
  const Bytes blob = rwd::serialize_snapshot(s, fingerprint);
  const rwd::SnapshotHeader h = rwd::read_snapshot_header(blob);
  EXPECT_EQ(h.version, 1u);
  EXPECT_EQ(h.model_fingerprint, fingerprint);
  EXPECT_EQ(h.length, 6);
  EXPECT_EQ(h.num_layers, 10);
  // A prefix holding the header and the fingerprint is enough ...
  const std::size_t needed = 56 + fingerprint.size();
  const rwd::SnapshotHeader p = rwd::read_snapshot_header(std::span<const std::byte>(blob.data(), needed));
  EXPECT_EQ(p.model_fingerprint, fingerprint);
  EXPECT_EQ(p.num_layers, 10);
  // ... and every shorter one is a truncation.
  for (std::size_t n = 0; n < needed; ++n) {
    try {
      rwd::read_snapshot_header(std::span<const std::byte>(blob.data(), n));
      ADD_FAILURE() << "prefix of " << n << " bytes accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("truncated at byte " + std::to_string(n)), std::string::npos) << e.what();
    }
  }
  Bytes bad = blob;
  bad[20] ^= std::byte{1};
  EXPECT_THROW(rwd::read_snapshot_header(bad), FormatError);
  bad = blob;
  bad[52] ^= std::byte{1};
  EXPECT_THROW(rwd::read_snapshot_header(bad), FormatError);
  bad = blob;
  bad[3] = std::byte{0};
  EXPECT_THROW(rwd::read_snapshot_header(bad), FormatError);
}

TEST(SnapshotFormat, FailedDeserializeLeavesFingerprintAlone) {
  Bytes blob = rwd::serialize_snapshot(small_snapshot(), "fp");
  blob.back() ^= std::byte{1};
  std::string fingerprint = "before";
  EXPECT_THROW(rwd::deserialize_snapshot(blob, &fingerprint), FormatError);
  EXPECT_EQ(fingerprint, "before");
}

// ---- fuzz seeds -------------------------------------------------------------------------

// The seed corpus of fuzz/fuzz_snapshot.cc: a snapshot of each kind (each
// dtype in turn), one with every kind and every optional field, and an empty
// one. REWIND_SNAPSHOT_SEED_DIR=<dir> writes them there (to regenerate
// fuzz/corpus/snapshot/); otherwise the checked-in corpus must match.
std::vector<std::pair<std::string, Bytes>> seeds() {
  std::vector<std::pair<std::string, Bytes>> out;
  LayerShape shape;
  shape.heads = 2;
  shape.key_dim = 2;
  shape.value_dim = 1;
  shape.side_dims = {2};
  shape.convs = {{2, 3}};
  shape.recurrents = {{2, 2}};
  const std::array<DType, 3> dtypes{DType::F32, DType::F16, DType::BF16};
  for (std::size_t i = 0; i < kAllKinds.size(); ++i) {
    Snapshot s;
    s.length = 3;
    s.layers.push_back(make_layer(kAllKinds[i], dtypes[i % 3], 3, 1, shape, static_cast<std::uint32_t>(i)));
    s.tokens = {1, 2};
    out.emplace_back("kind_" + std::string(rwd::layer_kind_name(kAllKinds[i])), rwd::serialize_snapshot(s, "seed"));
  }
  Snapshot all = small_snapshot();
  out.emplace_back("every_kind_and_field", rwd::serialize_snapshot(all, "seed model"));
  out.emplace_back("empty", rwd::serialize_snapshot(Snapshot{}, ""));
  return out;
}

TEST(SnapshotFormatSeeds, CorpusMatchesTheGenerator) {
  const auto generated = seeds();
  for (const auto& [name, blob] : generated) {
    EXPECT_EQ(rwd::serialize_snapshot(rwd::deserialize_snapshot(blob), name == "empty"                  ? ""
                                                                       : name == "every_kind_and_field" ? "seed model"
                                                                                                        : "seed"),
              blob)
        << name;
  }
  if (const char* dir = std::getenv("REWIND_SNAPSHOT_SEED_DIR")) {
    std::filesystem::create_directories(dir);
    for (const auto& [name, blob] : generated) {
      std::ofstream f(std::filesystem::path(dir) / name, std::ios::binary);
      f.write(reinterpret_cast<const char*>(blob.data()), static_cast<std::streamsize>(blob.size()));
      ASSERT_TRUE(f.good()) << name;
    }
    std::printf("wrote %zu seeds to %s\n", generated.size(), dir);
    return;
  }
  const auto corpus = std::filesystem::path(REWIND_SOURCE_DIR) / "fuzz" / "corpus" / "snapshot";
  if (!std::filesystem::is_directory(corpus)) GTEST_SKIP() << corpus << " is not here (tree moved after the build)";
  for (const auto& [name, blob] : generated) {
    std::ifstream f(corpus / name, std::ios::binary);
    ASSERT_TRUE(f.good()) << corpus / name << " is missing: regenerate with REWIND_SNAPSHOT_SEED_DIR";
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(bytes_of(text), blob) << name << " differs from the generator: regenerate with REWIND_SNAPSHOT_SEED_DIR";
  }
}

}  // namespace
