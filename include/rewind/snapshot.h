// rewind/snapshot.h: a sequence's whole state as plain data, and its
// serialized form.
//
// A Snapshot is what a sequence needs to continue decoding exactly: for
// every layer the retained attention rows (keys, values, side tensors) of a
// range of positions, the last K inputs of every conv state and every
// recurrent state, all at the sequence's length L. Cache::snapshot and
// SequenceCache::export_snapshot make one; Cache::restore and
// SequenceCache::import_snapshot load one; continuing from a restored
// snapshot is bit-identical to continuing the original. The same struct
// carries a prefix-cache entry (rewind/prefix_cache.h): the attention rows
// of one range of positions plus the conv and recurrent states at its end.
//
// serialize_snapshot / deserialize_snapshot give it a documented, versioned,
// little-endian binary form (docs/snapshot-format.md) with a model
// fingerprint and a checksum per part. Deserializing validates every field
// before building anything: malformed, truncated or hostile input is a
// FormatError, never a crash or an unbounded allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rewind/layer.h"
#include "rewind/tensor.h"

namespace rwd {

// One layer's part of a snapshot at sequence length L (Snapshot::length).
// Tensors a layer kind does not have are empty (rank 0, no data) or absent.
// Which parts a kind has (the rules of Layer's constructor):
//   full / sliding / chunked attention: keys, values, any number of sides;
//   deepseek_sparse_attention: keys, values and at least one side;
//   hybrid / hybrid_sliding: keys, values, any number of sides, and at least
//     one conv or recurrent state;
//   linear_attention: at least one conv or recurrent state;
//   conv: at least one conv state, no recurrent state;
//   moe / mlp: nothing.
// Every extent is >= 1 except the token extent n = L - first (which may be
// 0), the leading (batch) extent is 1, and the product of a tensor's nonzero
// extents is at most 2^62.
struct LayerSnapshot {
  LayerKind kind = LayerKind::Mlp;
  // Attention kinds: the rows of positions [first, L), 0 <= first <= L.
  // Stored for every kind (0 <= first <= L is checked for every kind).
  std::int64_t first = 0;
  Tensor keys;                // [1, H, L - first, key_dim]
  Tensor values;              // [1, H, L - first, value_dim]
  std::vector<Tensor> sides;  // per side tensor: [1, L - first, D]
  // Conv states (linear attention, conv, hybrids): the inputs of positions
  // [L - K, L) per state, zeros for positions before 0 (get_conv_state).
  std::vector<Tensor> conv_states;  // per state: [1, C, K]
  // Recurrent states: S(L) per state.
  std::vector<Tensor> recurrent_states;  // per state: [1, shape...], rank 2..4
};

struct Snapshot {
  std::int64_t length = 0;            // L: the tokens the sequence has seen, 0..2^40
  std::vector<LayerSnapshot> layers;  // one per model layer, in model order
  // Optional, for prefix-cache entries and user bookkeeping:
  std::vector<std::int32_t> tokens;  // the ids of positions [L - tokens.size(), L); size <= L
  Tensor logits;                     // [V] f32, 1 <= V <= 2^40: the model's output after
                                     // position L - 1; an empty Tensor (rank 0, no data): none
  std::string parent;                // key of the entry this one continues ("" for none):
                                     // at most 256 characters from [A-Za-z0-9._:-]
};

// The serialized form of `snapshot`, tagged with `model_fingerprint` (at
// most 1024 bytes, any bytes; an identifier of the model the state belongs
// to, checked by whoever loads it). The encoding is canonical: equal
// snapshots give equal bytes, and deserialize_snapshot followed by
// serialize_snapshot reproduces its input exactly. Costs one copy of the
// tensor bytes plus their CRC-32C (no per-element work on a little-endian
// host). Throws InvalidArgument for an inconsistent snapshot (message names
// the layer and part: a kind with parts it does not have or without the
// ones it needs, shapes that do not match the rules above or the lengths,
// length outside [0, 2^40], first outside [0, L], more tokens than L,
// logits that are not [V] f32, a tensor that is not contiguous, a
// fingerprint or parent key too long, a parent key with other characters),
// CapacityError when the output cannot be allocated.
std::vector<std::byte> serialize_snapshot(const Snapshot& snapshot, std::string_view model_fingerprint);

// Parses what serialize_snapshot wrote. Throws FormatError saying what is
// wrong and where (bad magic, unsupported version, truncation with the byte
// offset and the field being read, a checksum mismatch naming the layer and
// part, unknown kind or dtype codes, a kind with the wrong parts, impossible
// shapes or lengths, nonzero unused fields, trailing bytes) before
// allocating anything the input's size does not bound; nothing is returned
// then. Every field is validated by the rules serialize_snapshot enforces,
// so whatever it accepts serializes back to `bytes` exactly. Throws
// CapacityError only when the system cannot allocate the tensors (whose
// sizes the input bounds). `model_fingerprint`, when not null, receives the
// stored fingerprint (and is left unchanged when this throws).
Snapshot deserialize_snapshot(std::span<const std::byte> bytes, std::string* model_fingerprint = nullptr);

// Reads only the header (magic, version, fingerprint, length, layer
// count) for `rewind snapshot inspect`-style listings and quick rejection of
// a foreign model. `bytes` may be the whole snapshot or any prefix that
// holds the header and fingerprint (56 + fingerprint bytes, at most 1080).
// Throws FormatError as deserialize_snapshot does for the bytes it reads
// (magic, version, header and fingerprint checksums, field ranges).
struct SnapshotHeader {
  std::uint32_t version = 0;
  std::string model_fingerprint;
  std::int64_t length = 0;
  std::int64_t num_layers = 0;
};
SnapshotHeader read_snapshot_header(std::span<const std::byte> bytes);

}  // namespace rwd
