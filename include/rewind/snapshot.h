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
#include <vector>

#include "rewind/layer.h"
#include "rewind/tensor.h"

namespace rwd {

// One layer's part of a snapshot at sequence length L (Snapshot::length).
// Tensors a layer kind does not have are empty (rank 0, no data) or absent.
struct LayerSnapshot {
  LayerKind kind = LayerKind::Mlp;
  // Attention kinds: the rows of positions [first, L), first <= L.
  std::int64_t first = 0;
  Tensor keys;                // [1, H, L - first, key_dim]
  Tensor values;              // [1, H, L - first, value_dim]
  std::vector<Tensor> sides;  // per side tensor: [1, L - first, D]
  // Conv states (linear attention, conv, hybrids): the inputs of positions
  // [L - K, L) per state, zeros for positions before 0 (get_conv_state).
  std::vector<Tensor> conv_states;       // per state: [1, C, K]
  // Recurrent states: S(L) per state.
  std::vector<Tensor> recurrent_states;  // per state: [1, shape...]
};

struct Snapshot {
  std::int64_t length = 0;            // L: the tokens the sequence has seen
  std::vector<LayerSnapshot> layers;  // one per model layer, in model order
  // Optional, for prefix-cache entries and user bookkeeping:
  std::vector<std::int32_t> tokens;   // the ids of positions [L - tokens.size(), L)
  Tensor logits;                      // [V] f32: the model's output after position L - 1
  std::string parent;                 // key of the entry this one continues ("" for none)
};

// The serialized form of `snapshot`, tagged with `model_fingerprint` (at
// most 1024 bytes; an identifier of the model the state belongs to, checked
// by whoever loads it). Throws InvalidArgument for an inconsistent snapshot
// (shapes that do not match the lengths, a tensor that is not contiguous,
// a fingerprint or parent key too long), CapacityError when the output
// cannot be allocated.
std::vector<std::byte> serialize_snapshot(const Snapshot& snapshot, std::string_view model_fingerprint);

// Parses what serialize_snapshot wrote. Throws FormatError saying what is
// wrong and where (bad magic, unsupported version, truncation, a checksum
// mismatch naming the layer and part, impossible shapes or lengths, trailing
// bytes) before allocating anything the input's size does not bound;
// nothing is returned then. `model_fingerprint`, when not null, receives the
// stored fingerprint.
Snapshot deserialize_snapshot(std::span<const std::byte> bytes, std::string* model_fingerprint = nullptr);

// Reads only the fixed header (magic, version, fingerprint, length, layer
// count) for `rewind snapshot inspect`-style listings and quick rejection of
// a foreign model. Throws FormatError as deserialize_snapshot does for the
// bytes it reads.
struct SnapshotHeader {
  std::uint32_t version = 0;
  std::string model_fingerprint;
  std::int64_t length = 0;
  std::int64_t num_layers = 0;
};
SnapshotHeader read_snapshot_header(std::span<const std::byte> bytes);

}  // namespace rwd
