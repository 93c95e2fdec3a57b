// Tests of the safetensors reader / writer (runtime/safetensors.h).
#include "runtime/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "rewind/error.h"

namespace rwd::runtime {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() / ("rewind_st_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A file with a correct length field for `header` and `data_bytes` of data.
std::string file_with_header(const std::string& header, std::size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x5a');
}

template <typename T>
std::span<const std::byte> as_bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

// Opening `path` must throw FormatError whose one-line message names the
// file and contains `phrase`.
void expect_format_error(const std::string& path, const std::string& phrase) {
  try {
    SafetensorsFile::open(path);
    ADD_FAILURE() << "no error for " << path << " (expected '" << phrase << "')";
  } catch (const FormatError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(phrase), std::string::npos) << "expected '" << phrase << "' in: " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type for '" << phrase << "': " << e.what();
  }
}

TEST_F(SafetensorsTest, RoundTripAllDtypesBitwise) {
  // Special values (signed zero, infinities, NaN payloads, subnormals) must
  // come back bit for bit: the reader never converts.
  std::vector<float> f32 = {
      0.0f, -0.0f, 1.5f, -3.25e-8f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min()};
  std::uint32_t nan_bits = 0x7FC12345u;
  float nan;
  std::memcpy(&nan, &nan_bits, 4);
  f32.push_back(nan);
  f32.push_back(-1.0f);
  std::vector<std::uint16_t> f16 = {0x3C00, 0x8000, 0x7C00, 0x7E01, 0x0001, 0xFBFF, 0x1234};
  std::vector<std::uint16_t> bf16 = {0x3F80, 0xC040, 0x7FC1, 0x0001, 0xFF80, 0x4049};
  std::vector<float> scalar = {42.0f};
  std::vector<std::uint16_t> empty;

  const std::vector<TensorToWrite> tensors = {
      {"half", DType::F16, {7}, as_bytes_of(f16)},  // odd byte count before wider dtypes
      {"float.matrix", DType::F32, {2, 4}, as_bytes_of(f32)},
      {"brain", DType::BF16, {3, 1, 2}, as_bytes_of(bf16)},
      {"scalar", DType::F32, {}, as_bytes_of(scalar)},
      {"empty", DType::F16, {0, 5}, as_bytes_of(empty)},
      {"名前/ü", DType::F32, {1}, as_bytes_of(scalar)},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "ok \"quoted\""}};
  const std::string p = path("round.safetensors");
  write_safetensors(p, tensors, meta);

  SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.path(), p);
  EXPECT_EQ(f.size(), tensors.size());
  EXPECT_EQ(f.metadata(), meta);
  for (const TensorToWrite& t : tensors) {
    const TensorEntry* e = f.find(t.name);
    ASSERT_NE(e, nullptr) << t.name;
    EXPECT_EQ(e->name, t.name);
    EXPECT_EQ(e->dtype, t.dtype) << t.name;
    EXPECT_EQ(e->shape, t.shape) << t.name;
    ASSERT_EQ(e->nbytes, t.bytes.size()) << t.name;
    if (e->nbytes > 0) {
      EXPECT_EQ(std::memcmp(e->data, t.bytes.data(), e->nbytes), 0) << t.name;
    }
  }
  EXPECT_EQ(f.get("scalar").numel(), 1);
  EXPECT_EQ(f.get("brain").numel(), 6);
  EXPECT_EQ(f.get("empty").numel(), 0);

  // Layout promises: header padded to 8 bytes, every tensor aligned to its
  // element size, no holes in the data section.
  const std::string raw = read_bytes(p);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<unsigned char>(raw[static_cast<std::size_t>(i)]);
  }
  EXPECT_EQ(header_len % 8, 0u);
  const std::uint64_t data_size = raw.size() - 8 - header_len;
  std::uint64_t total = 0;
  const std::byte* data_start = f.entries().front().data;
  for (const TensorEntry& e : f.entries()) {
    total += e.nbytes;
    EXPECT_EQ(static_cast<std::size_t>(e.data - data_start) % dtype_size(e.dtype), 0u) << e.name;
  }
  EXPECT_EQ(total, data_size);

  // names() is data order and covers every tensor once.
  std::vector<std::string> names = f.names();
  ASSERT_EQ(names.size(), tensors.size());
  for (std::size_t i = 1; i < f.entries().size(); ++i) {
    EXPECT_LE(f.entries()[i - 1].data, f.entries()[i].data);
  }
}

TEST_F(SafetensorsTest, FindAndGet) {
  std::vector<float> v = {1, 2, 3};
  const std::string p = path("fg.safetensors");
  write_safetensors(p, {{"a", DType::F32, {3}, as_bytes_of(v)}});
  SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_NE(f.find("a"), nullptr);
  EXPECT_EQ(f.find("b"), nullptr);
  EXPECT_EQ(f.find(""), nullptr);
  EXPECT_TRUE(f.metadata().empty());
  try {
    f.get("b");
    ADD_FAILURE() << "get of a missing tensor did not throw";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(p + ": missing tensor 'b'"), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsTest, MoveKeepsDataValid) {
  std::vector<float> v = {7, 8};
  const std::string p = path("mv.safetensors");
  write_safetensors(p, {{"x", DType::F32, {2}, as_bytes_of(v)}});
  SafetensorsFile a = SafetensorsFile::open(p);
  const std::byte* data = a.get("x").data;
  SafetensorsFile b = std::move(a);
  EXPECT_EQ(b.get("x").data, data);
  float got[2];
  std::memcpy(got, b.get("x").data, sizeof got);
  EXPECT_EQ(got[0], 7.0f);
  EXPECT_EQ(got[1], 8.0f);
  SafetensorsFile c = SafetensorsFile::open(p);
  c = std::move(b);
  std::memcpy(got, c.get("x").data, sizeof got);
  EXPECT_EQ(got[1], 8.0f);
}

TEST_F(SafetensorsTest, EmptyFileOfNoTensorsOpens) {
  const std::string p = path("none.safetensors");
  write_safetensors(p, {});
  SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.size(), 0u);
  EXPECT_TRUE(f.names().empty());
}

TEST_F(SafetensorsTest, AcceptsValidFilesFromOtherWriters) {
  // Unpadded header, keys in any order, a hole between tensors, extra entry
  // keys, and an empty tensor sharing an offset with a non-empty one.
  const std::string header = R"({"b":{"shape":[2],"dtype":"F16","data_offsets":[8,12],"extra":1},)"
                             R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("z":{"dtype":"BF16","shape":[0],"data_offsets":[8,8]}})";
  const std::string p = path("other.safetensors");
  write_bytes(p, file_with_header(header, 12));
  SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.size(), 3u);
  EXPECT_EQ(f.get("a").nbytes, 4u);
  EXPECT_EQ(f.get("b").data - f.get("a").data, 8);
  EXPECT_EQ(f.get("z").nbytes, 0u);
  EXPECT_EQ(f.names().front(), "a");
}

TEST_F(SafetensorsTest, WriterRejectsBadInputAndWritesNothing) {
  std::vector<float> v = {1, 2, 3, 4};
  const std::string p = path("bad.safetensors");
  const std::vector<std::vector<TensorToWrite>> cases = {
      {{"a", DType::F32, {4}, as_bytes_of(v)}, {"a", DType::F32, {4}, as_bytes_of(v)}},
      {{"a", DType::F32, {3}, as_bytes_of(v)}},
      {{"a", DType::F16, {4}, as_bytes_of(v)}},
      {{"a", DType::F32, {-4}, as_bytes_of(v)}},
      {{"", DType::F32, {4}, as_bytes_of(v)}},
      {{"__metadata__", DType::F32, {4}, as_bytes_of(v)}},
      {{"bad\xff", DType::F32, {4}, as_bytes_of(v)}},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    EXPECT_THROW(write_safetensors(p, cases[i]), InvalidArgument) << "case " << i;
    EXPECT_FALSE(fs::exists(p)) << "case " << i;
  }
  EXPECT_TRUE(fs::is_empty(dir_)) << "a temporary file was left behind";
}

TEST_F(SafetensorsTest, WriterReportsIoFailure) {
  std::vector<float> v = {1};
  EXPECT_THROW(write_safetensors(path("no/such/dir/x.safetensors"), {{"a", DType::F32, {1}, as_bytes_of(v)}}), Error);
}

TEST_F(SafetensorsTest, OpenMissingFileIsAnError) {
  const std::string p = path("absent.safetensors");
  try {
    SafetensorsFile::open(p);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos);
  }
}

struct MalformedCase {
  const char* label;
  std::function<std::string()> bytes;
  const char* phrase;
};

// One valid tensor entry with a given body.
std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

// Files whose framing or header JSON is not a tensor table.
std::vector<MalformedCase> malformed_header_cases() {
  return {
      {"empty file", [] { return std::string(); }, "shorter than the 8-byte header length"},
      {"truncated length field", [] { return std::string("\x10\0\0", 3); }, "shorter than the 8-byte header length"},
      {"header length beyond the file", [] { return le64(1000) + "{}"; },
       "header length 1000 runs past the end of the file"},
      {"header cut short", [] { return le64(20) + R"({"a":{"dtype")"; }, "runs past the end of the file"},
      {"absurd header length", [] { return le64(std::uint64_t{1} << 40) + "{}"; }, "exceeds the 100000000-byte limit"},
      {"max header length", [] { return le64(~std::uint64_t{0}) + "{}"; }, "exceeds the 100000000-byte limit"},
      {"not JSON", [] { return file_with_header("{not json", 0); }, "header is not valid JSON"},
      {"empty header", [] { return file_with_header("", 0); }, "header is not valid JSON"},
      {"trailing garbage", [] { return file_with_header("{} x", 0); }, "header is not valid JSON"},
      {"not an object", [] { return file_with_header("[1, 2]", 0); }, "header is not a JSON object"},
  };
}

// Tensor entries with a missing or wrong field, tensors that overlap or share
// a name, names that are not UTF-8, metadata that is not strings.
std::vector<MalformedCase> malformed_entry_cases() {
  return {
      {"entry not an object", [] { return file_with_header(R"({"a": 5})", 0); },
       "tensor 'a': entry is not a JSON object"},
      {"missing dtype", [] { return file_with_header(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4); },
       "tensor 'a': missing 'dtype'"},
      {"missing data_offsets", [] { return file_with_header(R"({"a":{"dtype":"F32","shape":[1]}})", 4); },
       "tensor 'a': missing 'data_offsets'"},
      {"unknown dtype I64", [] { return file_with_header(R"({"a":)" + entry("I64", "[1]", "[0,8]") + "}", 8); },
       "unsupported dtype 'I64' (supported: F32, F16, BF16, I8)"},
      {"dtype not a string",
       [] { return file_with_header(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4); },
       "dtype is not a string"},
      {"negative extent", [] { return file_with_header(R"({"a":)" + entry("F32", "[-1]", "[0,4]") + "}", 4); },
       "shape is not a list of non-negative integers"},
      {"fractional extent", [] { return file_with_header(R"({"a":)" + entry("F32", "[1.5]", "[0,4]") + "}", 4); },
       "shape is not a list of non-negative integers"},
      {"shape not a list", [] { return file_with_header(R"({"a":)" + entry("F32", "4", "[0,16]") + "}", 16); },
       "shape is not a list of non-negative integers"},
      {"shape overflowing 64 bits",
       [] { return file_with_header(R"({"a":)" + entry("F32", "[4294967296,4294967296]", "[0,4]") + "}", 4); },
       "overflows 64 bits"},
      {"byte size overflowing 64 bits",
       [] { return file_with_header(R"({"a":)" + entry("F32", "[4611686018427387904]", "[0,4]") + "}", 4); },
       "overflows 64 bits"},
      {"offsets not two integers", [] { return file_with_header(R"({"a":)" + entry("F32", "[1]", "[0]") + "}", 4); },
       "data_offsets is not two non-negative integers"},
      {"negative offset", [] { return file_with_header(R"({"a":)" + entry("F32", "[1]", "[-4,0]") + "}", 4); },
       "data_offsets is not two non-negative integers"},
      {"begin > end", [] { return file_with_header(R"({"a":)" + entry("F32", "[0]", "[8,4]") + "}", 8); },
       "data_offsets [8, 4] has begin > end"},
      {"size mismatch", [] { return file_with_header(R"({"a":)" + entry("F32", "[2]", "[0,4]") + "}", 8); },
       "data_offsets [0, 4] span 4 bytes, but shape [2] F32 needs 8"},
      {"offsets out of range", [] { return file_with_header(R"({"a":)" + entry("F32", "[4]", "[0,16]") + "}", 8); },
       "extend past the end of the data section (8 bytes)"},
      {"offsets far out of range",
       [] {
         return file_with_header(R"({"a":)" + entry("F16", "[2]", "[18446744073709551612,18446744073709551616]") + "}",
                                 8);
       },
       "data_offsets is not two non-negative integers"},
      {"overlapping offsets",
       [] {
         return file_with_header(
             R"({"a":)" + entry("F32", "[2]", "[0,8]") + R"(,"b":)" + entry("F32", "[2]", "[4,12]") + "}", 12);
       },
       "tensors 'a' [0, 8] and 'b' [4, 12] overlap"},
      {"tensor inside another",
       [] {
         return file_with_header(
             R"({"a":)" + entry("F32", "[4]", "[0,16]") + R"(,"b":)" + entry("F16", "[2]", "[4,8]") + "}", 16);
       },
       "overlap"},
      {"duplicate names",
       [] {
         return file_with_header(
             R"({"a":)" + entry("F32", "[1]", "[0,4]") + R"(,"a":)" + entry("F32", "[1]", "[4,8]") + "}", 8);
       },
       "duplicate tensor name 'a'"},
      {"duplicate key inside an entry",
       [] { return file_with_header(R"({"a":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", 4); },
       "duplicate key 'dtype'"},
      {"non-UTF-8 name", [] { return file_with_header("{\"a\xff\":" + entry("F32", "[1]", "[0,4]") + "}", 4); },
       "header is not valid UTF-8"},
      {"overlong UTF-8 name", [] { return file_with_header("{\"\xc0\xaf\":" + entry("F32", "[1]", "[0,4]") + "}", 4); },
       "header is not valid UTF-8"},
      {"surrogate escape in a name",
       [] { return file_with_header(R"({"\ud800":)" + entry("F32", "[1]", "[0,4]") + "}", 4); },
       "header is not valid JSON"},
      {"metadata not an object", [] { return file_with_header(R"({"__metadata__":[1]})", 0); },
       "__metadata__ must be an object"},
      {"metadata value not a string", [] { return file_with_header(R"({"__metadata__":{"k":1}})", 0); },
       "__metadata__ value of 'k' is not a string"},
  };
}

TEST_F(SafetensorsTest, MalformedFilesThrowFormatError) {
  std::vector<MalformedCase> cases = malformed_header_cases();
  for (MalformedCase& c : malformed_entry_cases()) cases.push_back(std::move(c));
  for (std::size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].label);
    const std::string p = path("bad_" + std::to_string(i) + ".safetensors");
    write_bytes(p, cases[i].bytes());
    expect_format_error(p, cases[i].phrase);
  }
}

TEST_F(SafetensorsTest, TruncatedRealFileIsRejected) {
  std::vector<float> v(64, 1.0f);
  const std::string p = path("t.safetensors");
  write_safetensors(p, {{"w", DType::F32, {8, 8}, as_bytes_of(v)}});
  const std::string full = read_bytes(p);
  write_bytes(p, full.substr(0, full.size() - 4));
  expect_format_error(p, "extend past the end of the data section");
  write_bytes(p, full.substr(0, 20));
  expect_format_error(p, "runs past the end of the file");
}

TEST_F(SafetensorsTest, MutatedFilesOpenOrThrowFormatError) {
  // Corrupting any byte of a valid file (length field, header or data) must
  // either leave a valid file or give a FormatError: never a crash, another
  // exception, or an entry reaching outside the file.
  std::vector<float> a(6, 0.5f);
  std::vector<std::uint16_t> b(5, 0x3C00);
  const std::string p = path("m.safetensors");
  write_safetensors(p, {{"a.weight", DType::F32, {2, 3}, as_bytes_of(a)}, {"b", DType::BF16, {5}, as_bytes_of(b)}},
                    {{"k", "v"}});
  const std::string good = read_bytes(p);
  std::uint64_t state = 12345;
  auto next = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  const char replacements[] = {'"', '{', '}', '[', ']', ',', ':', '0', '9', '-', ' ', '\xff', 'F'};
  int opened = 0, rejected = 0;
  for (int iter = 0; iter < 400; ++iter) {
    std::string bad = good;
    const int edits = 1 + static_cast<int>(next() % 3);
    for (int e = 0; e < edits; ++e) {
      const std::size_t pos = next() % bad.size();
      bad[pos] = (next() % 2) ? replacements[next() % sizeof replacements] : static_cast<char>(next() & 0xFF);
    }
    write_bytes(p, bad);
    try {
      SafetensorsFile f = SafetensorsFile::open(p);
      ++opened;
      const auto* begin = f.entries().empty() ? nullptr : f.entries().front().data;
      for (const TensorEntry& e : f.entries()) {
        ASSERT_GE(e.data, begin);
        ASSERT_LE(static_cast<std::size_t>(e.data - begin) + e.nbytes, bad.size());
        ASSERT_EQ(e.nbytes, static_cast<std::size_t>(e.numel()) * dtype_size(e.dtype));
      }
    } catch (const FormatError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 100);
  EXPECT_GT(opened, 0);  // data-only corruption is not a format error
}

TEST(SafetensorsUtf8, Validation) {
  EXPECT_TRUE(is_valid_utf8(""));
  EXPECT_TRUE(is_valid_utf8("plain ascii"));
  EXPECT_TRUE(is_valid_utf8("\xc3\xbc \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf"));
  std::size_t at = 99;
  EXPECT_FALSE(is_valid_utf8("ab\x80", &at));  // lone continuation byte
  EXPECT_EQ(at, 2u);
  EXPECT_FALSE(is_valid_utf8("a\xc3", &at));  // truncated sequence
  EXPECT_EQ(at, 1u);
  EXPECT_FALSE(is_valid_utf8("\xc3\x28"));          // bad continuation
  EXPECT_FALSE(is_valid_utf8("\xc0\x80"));          // overlong NUL
  EXPECT_FALSE(is_valid_utf8("\xe0\x80\xaf"));      // overlong '/'
  EXPECT_FALSE(is_valid_utf8("\xed\xa0\x80"));      // UTF-16 surrogate
  EXPECT_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(is_valid_utf8("\xf8\x88\x80\x80\x80"));
  EXPECT_FALSE(is_valid_utf8("\xff"));
}

TEST(SafetensorsNames, DtypeAndShapeStrings) {
  EXPECT_EQ(safetensors_dtype_name(DType::F32), "F32");
  EXPECT_EQ(safetensors_dtype_name(DType::F16), "F16");
  EXPECT_EQ(safetensors_dtype_name(DType::BF16), "BF16");
  const std::vector<std::int64_t> s = {2, 3, 4};
  EXPECT_EQ(shape_string(s), "[2, 3, 4]");
  EXPECT_EQ(shape_string({}), "[]");
}

}  // namespace
}  // namespace rwd::runtime
