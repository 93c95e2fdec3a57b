// libFuzzer target: deserialize_snapshot on arbitrary bytes. Every input
// either deserializes, and then serializes back to exactly the same bytes
// (the encoding is canonical) with read_snapshot_header agreeing, or raises
// rwd::FormatError; nothing else (no crash, no other exception, no
// allocation the input does not bound: libFuzzer's -rss_limit_mb and
// -malloc_limit_mb catch those).
//
// Random bytes almost never carry valid CRC-32Cs, so each input is also
// tried "resealed": walked along the layout of docs/snapshot-format.md with
// every checksum recomputed. That lets mutations of sizes, codes and shapes
// reach the field checks behind the checksums. The walk is written from the
// document, independently of the decoder.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "rewind/checksum.h"
#include "rewind/error.h"
#include "rewind/snapshot.h"

namespace {

// How often each outcome occurred, printed when REWIND_FUZZ_STATS is set
// (e.g. with -runs=0 over a corpus): the resealed inputs are what reach the
// checks behind the checksums.
enum Stat {
  kAccepted,
  kRefusedChecksum,
  kRefusedTruncated,
  kRefusedOther,
  kResealedAccepted,
  kResealedRefused,
  kStatCount
};
constexpr const char* kStatNames[kStatCount] = {
    "inputs accepted as they are", "  refused: checksum mismatch",
    "  refused: truncated",        "  refused: another check (magic, version, fields, trailing bytes)",
    "resealed inputs accepted",    "resealed inputs refused (by a field check)"};
rwt::FuzzStats<kStatCount>& stats() {
  static rwt::FuzzStats<kStatCount> s(kStatNames);
  return s;
}

using Bytes = std::vector<std::byte>;

std::uint64_t get(const Bytes& b, std::size_t at, int width) {
  std::uint64_t v = 0;
  for (int i = 0; i < width; ++i) v |= std::to_integer<std::uint64_t>(b[at + static_cast<std::size_t>(i)]) << (8 * i);
  return v;
}

// Stores the CRC-32C of [from, to) at `to`; false when the bytes run out.
bool reseal(Bytes& b, std::size_t from, std::size_t to) {
  if (to > b.size() || b.size() - to < 4) return false;
  const std::uint32_t c = rwd::crc32c(std::span<const std::byte>(b.data() + from, to - from));
  for (int i = 0; i < 4; ++i) b[to + static_cast<std::size_t>(i)] = static_cast<std::byte>(c >> (8 * i));
  return true;
}

bool has_attention(std::uint64_t kind) { return kind <= 2 || (kind >= 5 && kind <= 7); }

// Recomputes every checksum the layout places, as far as the sizes make
// sense and the bytes last.
void reseal_all(Bytes& b) {
  if (b.size() < 52 || !reseal(b, 0, 48)) return;
  const std::uint64_t fingerprint = get(b, 12, 4);
  const std::uint64_t layers = get(b, 24, 4);
  const std::uint64_t parent = get(b, 28, 4);
  const std::uint64_t tokens = get(b, 32, 8);
  const std::uint64_t logits = get(b, 40, 8);
  std::size_t pos = 52;
  if (fingerprint > b.size() - pos || !reseal(b, pos, pos + fingerprint)) return;
  pos += fingerprint + 4;
  for (std::uint64_t l = 0; l < layers; ++l) {
    if (b.size() - pos < 28 || !reseal(b, pos, pos + 24)) return;
    const std::uint64_t kind = get(b, pos, 4);
    const std::uint64_t parts = (has_attention(kind) ? 2 : 0) + get(b, pos + 4, 4) + get(b, pos + 8, 4) +
                                get(b, pos + 12, 4);
    pos += 28;
    for (std::uint64_t p = 0; p < parts; ++p) {
      if (b.size() - pos < 44 || !reseal(b, pos, pos + 40)) return;
      const std::uint64_t element = get(b, pos, 4) == 0 ? 4 : 2;
      const std::uint64_t rank = std::min<std::uint64_t>(get(b, pos + 4, 4), 4);
      std::uint64_t bytes = element;
      for (std::uint64_t d = 0; d < rank; ++d) {
        const std::uint64_t e = get(b, pos + 8 + 8 * d, 8);
        if (e > b.size() || (e != 0 && bytes > b.size() / e)) return;
        bytes *= e;
      }
      pos += 44;
      if (bytes > b.size() - pos || !reseal(b, pos, pos + bytes)) return;
      pos += bytes + 4;
    }
  }
  if (tokens > b.size() || logits > b.size() || parent > b.size()) return;
  const std::uint64_t trailer = 4 * tokens + 4 * logits + parent;
  if (trailer > b.size() - pos) return;
  reseal(b, pos, pos + trailer);
}

// Returns true when `input` was accepted; `refusal` receives the message.
bool check(const Bytes& input, std::string& refusal) {
  try {
    std::string fingerprint;
    const rwd::Snapshot s = rwd::deserialize_snapshot(input, &fingerprint);
    if (rwd::serialize_snapshot(s, fingerprint) != input) std::abort();
    const rwd::SnapshotHeader h = rwd::read_snapshot_header(input);
    if (h.version != 1 || h.model_fingerprint != fingerprint || h.length != s.length ||
        h.num_layers != static_cast<std::int64_t>(s.layers.size())) {
      std::abort();
    }
    return true;
  } catch (const rwd::FormatError& e) {
    refusal = e.what();
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* begin = reinterpret_cast<const std::byte*>(data);
  Bytes input(begin, begin + size);
  std::string refusal;
  if (check(input, refusal)) {
    stats().count(kAccepted);
  } else if (refusal.find("checksum mismatch") != std::string::npos) {
    stats().count(kRefusedChecksum);
  } else if (refusal.find("truncated") != std::string::npos) {
    stats().count(kRefusedTruncated);
  } else {
    stats().count(kRefusedOther);
  }
  const Bytes raw = input;
  reseal_all(input);
  if (input != raw) stats().count(check(input, refusal) ? kResealedAccepted : kResealedRefused);
  return 0;
}
