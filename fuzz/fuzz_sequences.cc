// libFuzzer target: the input bytes are decoded into operations on a
// rwd::SequenceCache (one of four layer mixes: every layer kind, f32 / f16 /
// bf16, block sizes 1, 2, 3 and 16), and after each one every live sequence
// is compared with its own naive single-sequence reference
// (tests/conformance/sequence_model.h: RefCache of reference.h, a fork is a
// deep copy), together with the block count of memory(). Any mismatch, crash,
// sanitizer report or non-rewind exception aborts with the operation log; a
// rwd::Error is accepted only where it is predicted (or, under a memory
// budget, a CapacityError) and only when nothing changed.
//
// Operations: add_sequence, fork, seq_rm (live, removed again, forged ids),
// seq_keep, per-sequence crops of any n (huge ones included), recording
// changes, ragged batched forwards (entries of 0 tokens, abandoned at any
// layer and stage, by abandon(), destruction or a move), shrink_to_fit,
// memory budgets set and lifted between operations (below the reservation:
// refused, the old budget kept). Hostile inputs:
// - every per-sequence call with a removed or forged SeqId;
// - token counts of 2^40 and more (also 2^62 + 2^62 over two entries),
//   get_mask_sizes / activate_past_recording past 2^40, keys of 2^59 tokens
//   as a broadcast view (stride 0);
// - inputs that alias the cache's own blocks (views built from block_spans
//   and block_layout().rows, possibly broadcast or reversed, also rows the
//   same call writes), conv inputs and recurrent states read from the cache
//   and written into fresh slots;
// - inside an open batch: wrong token counts, dtypes, channels, layer /
//   side / state indices, whole-state calls, an early commit: refused with
//   nothing changed, the batch still usable.
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conformance/sequence_model.h"
#include "fuzz_support.h"

namespace rwt::seqtest {
namespace {

constexpr i64 kI64Max = std::numeric_limits<i64>::max();
constexpr i64 kI64Min = std::numeric_limits<i64>::min();

constexpr std::array<i64, 16> kTokens{0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 12, 17, 33};
constexpr std::array<i64, 7> kHugeCrops{kI64Min,      kI64Min + 1,        kI64Max,        -(i64{1} << 62),
                                        i64{1} << 62, -(kTokenLimit + 1), kTokenLimit + 1};
constexpr std::array<i64, 5> kBadQueries{0, -1, kTokenLimit + 1, kI64Max, kI64Min};
constexpr std::array<i64, 4> kBadRecording{-1, kTokenLimit + 1, kI64Max, kI64Min};

SeqSpec make_spec(std::uint8_t h) {
  SeqSpec s;
  switch (h % 4) {
    case 0:
      s.name = "mixed_f32_bs3";
      s.kinds = {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::LinearAttention,
                 LayerKind::Conv,          LayerKind::SparseAttention,  LayerKind::Moe};
      s.dtype = DType::F32;
      s.block_size = 3;
      break;
    case 1:
      s.name = "hybrids_f16_bs1";
      s.kinds = {LayerKind::ChunkedAttention, LayerKind::Hybrid, LayerKind::Mlp, LayerKind::HybridSliding,
                 LayerKind::FullAttention};
      s.dtype = DType::F16;
      s.block_size = 1;
      s.window = 3;
      s.chunk = 5;
      s.kernel = 2;
      break;
    case 2:
      s.name = "every_kind_bf16_bs2";
      s.kinds = kEveryLayerKind;
      s.dtype = DType::BF16;
      s.block_size = 2;
      break;
    default:
      s.name = "attention_f32_bs16";
      s.kinds = {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::ChunkedAttention,
                 LayerKind::SparseAttention, LayerKind::HybridSliding};
      s.dtype = DType::F32;
      s.block_size = 16;
      s.window = 6;
      s.chunk = 3;
      s.kernel = 4;
      break;
  }
  return s;
}

std::string num(i64 v) { return std::to_string(v); }

// Counts of what the inputs exercised, printed at exit when
// REWIND_FUZZ_STATS is set (e.g. with -runs=0 over a corpus).
enum Stat {
  kForward,
  kHostileForward,
  kAbandoned,
  kAliasBlocks,
  kAliasConv,
  kRecFromCache,
  kProbe,
  kHugeBatch,
  kHugeQuery,
  kBudgetSet,
  kBudgetRefusal,
  kStale,
  kFork,
  kCrop,
  kSnapshot,
  kStatCount
};
constexpr const char* kStatNames[kStatCount] = {"batched forwards",
                                                "  with every hostile hook",
                                                "  abandoned",
                                                "inputs aliasing blocks",
                                                "inputs aliasing conv rows",
                                                "recurrent slots written from cache states",
                                                "refused calls inside a batch",
                                                "huge begin_batch",
                                                "mask sizes at / past 2^40",
                                                "budgets set",
                                                "CapacityErrors under a budget",
                                                "stale / forged id rounds",
                                                "forks",
                                                "crops",
                                                "snapshot operations"};
FuzzStats<kStatCount>& stats() {
  static FuzzStats<kStatCount> s(kStatNames);
  return s;
}
void count(Stat k, unsigned long long by = 1) { stats().count(static_cast<std::size_t>(k), by); }

class Fuzzer {
 public:
  Fuzzer(ByteReader& in, const SeqSpec& spec) : in_(in), m_(spec) {}

  void run() {
    for (int step = 0; step < 48 && !in_.empty(); ++step) {
      if (m_.live.empty()) {
        check(m_.add());
        continue;
      }
      const std::uint8_t op = next() % 17;
      switch (op) {
        case 0:
        case 1:
        case 2:
        case 3: forward(false); break;
        case 4:
        case 5: crop(); break;
        case 6:
          if (m_.live.size() < 6) check(m_.add());
          break;
        case 7:
          if (m_.live.size() < 6) {
            count(kFork);
            check(m_.fork(pick()));
          }
          break;
        case 8: remove(); break;
        case 9: recording(); break;
        case 10: hostile_sizes(); break;
        case 11: budget(); break;
        case 12:
          if (next() & 1)
            check(m_.set_budget(0));
          else
            check(m_.shrink());
          break;
        case 13:
          if (next() % 4 == 0)
            check(m_.keep(pick()));
          else
            stale();
          break;
        case 14: invalid_batch(); break;
        case 16: snapshot_op(); break;
        default: forward(true); break;
      }
    }
    count(kBudgetRefusal, m_.budget_refusals);
    // Everything removed: nothing may stay in use.
    check(m_.set_budget(0));
    while (!m_.held.empty()) check(m_.drop_snapshot(m_.held.size() - 1));
    while (!m_.live.empty()) check(m_.remove(m_.live.size() - 1));
  }

 private:
  ByteReader& in_;
  SeqModel m_;

  std::uint8_t next() { return in_.next(); }
  std::size_t pick() { return next() % m_.live.size(); }
  SequenceCache& cache() { return m_.cache; }

  [[noreturn]] static void die(const std::string& what) {
    std::fprintf(stderr, "SequenceCache / reference mismatch\n%s\n", what.c_str());
    std::abort();
  }
  void check(const std::string& e) {
    if (!e.empty()) die(e);
  }

  // ---- operations

  // Snapshots: take, restore as a new sequence or into a live one, export
  // and import, drop (SeqModel checks each against the references).
  void snapshot_op() {
    count(kSnapshot);
    const std::size_t h = m_.held.size();
    const std::uint8_t c = next() % 5;
    if (h == 0 || (c == 0 && h < 4)) return check(m_.take_snapshot(pick()));
    const std::size_t k = next() % h;
    if (c == 1 && m_.live.size() < 6) return check(m_.restore_new(k));
    if (c == 2) return check(m_.restore_into(pick(), k));
    if (c == 3 && m_.live.size() < 6) return check(m_.export_import(pick(), next() & 1 ? k : h));
    check(m_.drop_snapshot(k));
  }

  void crop() {
    const std::size_t i = pick();
    const i64 L = m_.live[i].ref.seq_length();
    const i64 mr = m_.live[i].ref.max_rollback();
    i64 n = 0;
    switch (next() % 8) {
      case 0:
      case 1:
      case 2: n = -in_.range(1, L + 2); break;
      case 3: n = 0; break;
      case 4: n = in_.range(1, L + 2); break;
      case 5: n = -mr; break;
      case 6: n = -(mr + 1); break;
      default: n = kHugeCrops[next() % kHugeCrops.size()]; break;
    }
    count(kCrop);
    check(m_.crop(i, n));
  }

  void remove() {
    const int mode = next() % 4;
    if (mode <= 1 || m_.removed.empty()) {
      check(m_.remove(pick()));
    } else if (mode == 2) {
      check(m_.remove_again(next() % m_.removed.size()));
    } else {
      stale();
    }
  }

  void stale() {
    count(kStale);
    const int mode = next() % 4;
    if (mode == 0 && !m_.removed.empty()) {
      check(m_.stale_calls(m_.removed[next() % m_.removed.size()]));
      return;
    }
    const SeqId live = m_.live[pick()].id;
    const SeqId forged[3] = {SeqId{}, SeqId{live.slot, live.generation + 1 + next()}, SeqId{0xFFFFFFFFu, 1}};
    check(m_.stale_calls(forged[next() % 3]));
  }

  void recording() {
    const std::size_t i = pick();
    const int mode = next() % 8;
    if (mode < 4) {
      check(m_.activate(i, in_.range(0, 9)));
    } else if (mode < 6) {
      check(m_.deactivate(i));
    } else if (mode == 6) {
      check(m_.activate(i, kBadRecording[next() % kBadRecording.size()]));  // InvalidArgument predicted
    } else {
      // A large R (its R + 1 snapshot slots are allocated at once).
      check(m_.activate(i, next() & 1 ? i64{1} << 12 : i64{1} << 16));
    }
  }

  void budget() {
    const std::size_t reserved = cache().memory().bytes_reserved;
    if (next() % 4 == 0 && reserved > 1) {
      check(m_.set_budget(reserved - 1 - next() % std::min<std::size_t>(reserved - 1, 200)));
      return;
    }
    count(kBudgetSet);
    check(m_.set_budget(reserved + static_cast<std::size_t>(next()) * 32));
  }

  void invalid_batch() {
    std::vector<std::pair<std::size_t, i64>> plan;
    const std::size_t i = pick();
    switch (next() % 4) {
      case 0: break;
      case 1: plan = {{i, 1}, {i, in_.range(0, 3)}}; break;
      case 2: plan = {{i, -in_.range(1, 3)}}; break;
      default:
        for (std::size_t j = 0; j < m_.live.size(); ++j) plan.push_back({j, 0});
    }
    check(m_.forward(plan));
  }

  void hostile_sizes() {
    const std::size_t i = pick();
    const SeqId id = m_.live[i].id;
    const i64 L = m_.live[i].ref.seq_length();
    const std::string at = "(" + id_str(id) + ", L=" + num(L) + ")";
    switch (next() % 6) {
      case 0: {  // one entry past (or at) the token limit
        count(kHugeBatch);
        const std::array<i64, 5> qs{kTokenLimit + 1 - L, kTokenLimit - L, i64{1} << 59, kI64Max, kTokenLimit + 1};
        const i64 q = qs[next() % qs.size()];
        check(m_.refused("begin_batch {" + num(q) + " tokens} " + at,
                         [&] {
                           const BatchEntry en[1] = {{id, q}};
                           SequenceBatch b = cache().begin_batch(en);
                         },
                         {Err::Capacity}));
        break;
      }
      case 1: {  // totals that overflow int64
        if (m_.live.size() < 2) break;
        const SeqId other = m_.live[(i + 1) % m_.live.size()].id;
        const i64 a = i64{1} << 62, b = next() & 1 ? i64{1} << 62 : kI64Max;
        check(m_.refused("begin_batch {2^62, " + num(b) + "} " + at,
                         [&] {
                           const BatchEntry en[2] = {{id, a}, {other, b}};
                           SequenceBatch batch = cache().begin_batch(en);
                         },
                         {Err::Capacity, Err::Invalid}));
        break;
      }
      case 2: {  // a small entry with a huge one
        if (m_.live.size() < 2) break;
        const SeqId other = m_.live[(i + 1) % m_.live.size()].id;
        check(m_.refused("begin_batch {1, 2^59} " + at,
                         [&] {
                           const BatchEntry en[2] = {{id, 1}, {other, i64{1} << 59}};
                           SequenceBatch batch = cache().begin_batch(en);
                         },
                         {Err::Capacity}));
        break;
      }
      case 3: {  // mask sizes: out of range, and at the limit (no overflow)
        count(kHugeQuery);
        for (int layer = 0; layer < m_.num_layers(); ++layer) {
          const RefLayer& rl = m_.live[i].ref.layers[static_cast<std::size_t>(layer)];
          if (!rl.has_attention()) continue;
          const i64 q = kBadQueries[next() % kBadQueries.size()];
          check(m_.refused(
              "get_mask_sizes(" + num(q) + ", layer " + num(layer) + ") " + at,
              [&] { (void)cache().get_mask_sizes(id, q, layer); }, {Err::Invalid}, false));
          MaskSizes got;
          try {
            got = cache().get_mask_sizes(id, kTokenLimit, layer);
          } catch (const rwd::Error& e) {
            die(m_.fail(std::string("get_mask_sizes(2^40): unexpected ") + err_name(classify(e)) + ": " + e.what()));
          }
          const MaskSizes want = rl.mask_sizes(kTokenLimit);
          if (got.kv_length != want.kv_length || got.kv_offset != want.kv_offset)
            die(m_.fail("get_mask_sizes(2^40) of layer " + num(layer) + " = (" + num(got.kv_length) + ", " +
                        num(got.kv_offset) + "), expected (" + num(want.kv_length) + ", " + num(want.kv_offset) + ")"));
        }
        check(m_.check());
        break;
      }
      case 4: check(m_.crop(i, kHugeCrops[next() % kHugeCrops.size()])); break;
      default: check(m_.activate(i, kBadRecording[next() % kBadRecording.size()])); break;
    }
  }

  // ---- batched forwards

  void forward(bool hostile) {
    const std::size_t n = m_.live.size();
    const std::size_t k = 1 + next() % std::min<std::size_t>(4, n);
    std::vector<std::pair<std::size_t, i64>> plan;
    std::vector<bool> used(n, false);
    std::size_t at = next() % n;
    for (std::size_t e = 0; e < k; ++e) {
      while (used[at]) at = (at + 1) % n;
      used[at] = true;
      plan.push_back({at, kTokens[next() % kTokens.size()]});
      at = (at + 1 + next() % n) % n;
    }
    bool any = false;
    for (const auto& pe : plan) any = any || pe.second > 0;
    if (!any) plan[0].second = 1;
    const std::uint8_t flags = next();
    ForwardOptions fo;
    fo.strided = (flags & 1) != 0;
    if ((flags & 6) == 6) {
      fo.abandon_layer = static_cast<int>(next() % (m_.num_layers() + 1));
      fo.abandon_stage = next() % 3;
      fo.abandon_how = next() % 3;
      fo.remove_after_abandon = (flags & 64) != 0;
    }
    if (hostile || (flags & 8) != 0)
      fo.input = [this](int layer, int part, const std::vector<i64>& shape) { return alias_input(layer, part, shape); };
    if (hostile || (flags & 16) != 0) fo.before_layer = [this](int layer, SequenceBatch& b) { return probe(layer, b); };
    if (hostile || (flags & 32) != 0)
      fo.write_rec = [this](int layer, int s, std::size_t, i64, const TensorView& slot) {
        return rec_from_cache(layer, s, slot);
      };
    count(kForward);
    if (hostile) count(kHostileForward);
    if (fo.abandon_layer >= 0) count(kAbandoned);
    check(m_.forward(plan, fo));
  }

  // `v` ([.., n, ..] along token_dim, n >= 1) made into `shape`: sliced, the
  // first token broadcast (stride 0), or reversed.
  std::optional<TensorView> fit(TensorView v, const std::vector<i64>& shape, int token_dim) {
    if (v.rank != static_cast<int>(shape.size())) return std::nullopt;
    for (int d = 0; d < v.rank; ++d)
      if (d != token_dim && v.size(d) != shape[static_cast<std::size_t>(d)]) return std::nullopt;
    const i64 T = shape[static_cast<std::size_t>(token_dim)];
    const auto td = static_cast<std::size_t>(token_dim);
    if (v.size(token_dim) >= T && (next() & 1)) {
      v = v.slice(token_dim, 0, T);
      if (T > 1 && (next() & 1)) {  // reversed
        std::array<i64, 4> last{0, 0, 0, 0};
        last[td] = T - 1;
        v.data = v.ptr(last[0], last[1], last[2], last[3]);
        v.strides[td] = -v.strides[td];
      }
      return v;
    }
    v = v.slice(token_dim, next() % v.size(token_dim), 1);
    v.shape[td] = T;
    v.strides[td] = 0;
    return v;
  }

  // A view of the cache's own storage as the input of (layer, part).
  std::optional<TensorView> alias_input(int layer, int part, const std::vector<i64>& shape) {
    if (next() % 3 != 0) return std::nullopt;
    const SeqState& s = m_.live[pick()];
    try {
      if (part < 100) {  // keys, values or a side tensor: rows of some attention layer's blocks
        std::vector<int> layers;
        for (int j = 0; j < m_.num_layers(); ++j) {
          const RefLayer& rl = m_.proto(j);
          if (rl.has_attention() && (part < 2 || static_cast<std::size_t>(part - 2) < rl.side_dims.size()))
            layers.push_back(j);
        }
        if (layers.empty()) return std::nullopt;
        const int j = layers[next() % layers.size()];
        const std::vector<BlockSpan> spans = cache().block_spans(s.id, j);
        std::vector<const BlockSpan*> nonempty;
        for (const BlockSpan& sp : spans)
          if (sp.num_tokens > 0) nonempty.push_back(&sp);
        if (nonempty.empty()) return std::nullopt;
        const BlockSpan& sp = *nonempty[next() % nonempty.size()];
        // Inside a batch the spans already cover the batch's positions,
        // whose rows are undefined until the layer's update: mostly rows
        // below the length the reference has for that layer; sometimes the
        // rows this very call writes (overlapping the retained ones: the
        // input must be read as it was before the call).
        const bool written = next() % 4 == 0;
        const i64 end = written ? sp.position + sp.num_tokens
                                : std::min(sp.position + sp.num_tokens, s.ref.layers[static_cast<std::size_t>(j)].L);
        if (end <= sp.position) return std::nullopt;
        const i64 bs = cache().block_size();
        const i64 p = sp.position + next() % (end - sp.position);
        const i64 avail = std::min(bs - p % bs, end - p);
        const i64 rows = 1 + next() % avail;
        const std::byte* block = sp.blocks[p / bs - sp.position / bs];
        const TensorView v = cache().block_layout(j).rows(block, part, p % bs, rows);
        count(kAliasBlocks);
        m_.note("  layer " + num(layer) + " part " + num(part) + ": input aliases " + num(rows) + " rows of " +
                id_str(s.id) + " layer " + num(j) + " from position " + num(p));
        return fit(v, shape, part < 2 ? 2 : 1);
      }
      const int st = part - 100;  // conv state st: inputs or the conv state of some layer that has it
      std::vector<int> layers;
      for (int j = 0; j < m_.num_layers(); ++j)
        if (static_cast<std::size_t>(st) < m_.proto(j).conv_ch.size()) layers.push_back(j);
      if (layers.empty()) return std::nullopt;
      const int j = layers[next() % layers.size()];
      const TensorView v = next() & 1 ? cache().conv_inputs(s.id, j, st) : cache().get_conv_state(s.id, j, st);
      if (v.rank != 3 || v.size(2) < 1) return std::nullopt;
      count(kAliasConv);
      m_.note("  layer " + num(layer) + " conv " + num(st) + ": input aliases the conv inputs of " + id_str(s.id) +
              " layer " + num(j));
      return fit(v, shape, 2);
    } catch (const rwd::StateError&) {
      return std::nullopt;  // a read the open batch does not allow
    }
  }

  // Writes a recurrent state read from the cache into a fresh slot.
  bool rec_from_cache(int layer, int s, const TensorView& slot) {
    if (next() % 3 != 0) return false;
    const SeqState& src = m_.live[pick()];
    try {
      const TensorView v = cache().get_recurrent_state(src.id, layer, s);
      rwd::copy_tensor(v, slot);
      count(kRecFromCache);
      return true;
    } catch (const rwd::StateError&) {
      return false;
    }
  }

  // One whole-state call on sequence id, refused while a batch is open.
  std::string probe_whole_state_call(SeqId id, const std::string& at) {
    std::string e;
    auto refuse = [&](const std::string& what, auto&& f) {
      if (e.empty()) e = m_.refused(what + at, f, {Err::State}, false);
    };
    switch (next() % 10) {
      case 0: refuse("crop(0)", [&] { cache().crop(id, 0); }); break;
      case 1: refuse("add_sequence", [&] { (void)cache().add_sequence(); }); break;
      case 2: refuse("fork", [&] { (void)cache().fork(id); }); break;
      case 3: refuse("seq_rm", [&] { (void)cache().seq_rm(id); }); break;
      case 4: refuse("seq_keep", [&] { cache().seq_keep(id); }); break;
      case 5: refuse("activate_past_recording", [&] { cache().activate_past_recording(id, 3); }); break;
      case 6: refuse("set_memory_budget", [&] { cache().set_memory_budget(1); }); break;
      case 7: refuse("shrink_to_fit", [&] { cache().shrink_to_fit(); }); break;
      case 8: refuse("deactivate_past_recording", [&] { cache().deactivate_past_recording(id); }); break;
      default:
        refuse("begin_batch", [&] {
          const BatchEntry en[1] = {{id, 1}};
          SequenceBatch other = cache().begin_batch(en);
        });
    }
    return e;
  }

  // Calls that must be refused inside the open batch, changing nothing.
  std::string probe(int layer, SequenceBatch& b) {
    if (next() % 2 != 0) return "";
    count(kProbe);
    const RefLayer& rl = m_.proto(layer);
    const i64 T = b.num_tokens();
    const SeqId id = m_.live[pick()].id;
    static std::vector<unsigned char> zeros(4096, 0);
    void* z = zeros.data();
    const DType dt = m_.options().dtype;
    const std::string at = " inside a batch at layer " + num(layer);
    const i64 H = m_.options().num_kv_heads, Dk = m_.options().key_dim, Dv = m_.options().value_dim;
    auto attention_or_state = [&](Err e) {
      return rl.has_attention() ? std::vector<Err>{e} : std::vector<Err>{e, Err::State};
    };
    switch (next() % 9) {
      case 0: {  // T + 1 tokens
        const TensorView k = raw_view(z, dt, {1, H, T + 1, Dk}, {0, 0, 0, 0});
        const TensorView v = raw_view(z, dt, {1, H, T + 1, Dv}, {0, 0, 0, 0});
        return m_.refused(
            "update of T + 1 tokens" + at, [&] { (void)cache().update(k, v, layer); }, attention_or_state(Err::Invalid),
            false);
      }
      case 1: {  // 2^59 tokens, broadcast
        const TensorView k = raw_view(z, dt, {1, H, i64{1} << 59, Dk}, {0, 0, 0, 0});
        const TensorView v = raw_view(z, dt, {1, H, i64{1} << 59, Dv}, {0, 0, 0, 0});
        return m_.refused(
            "update of 2^59 broadcast tokens" + at, [&] { (void)cache().update(k, v, layer); },
            attention_or_state(Err::Invalid), false);
      }
      case 2: {  // another dtype
        const DType other = dt == DType::F32 ? DType::BF16 : DType::F32;
        const TensorView k = raw_view(z, other, {1, H, T, Dk}, {0, 0, 0, 0});
        const TensorView v = raw_view(z, other, {1, H, T, Dv}, {0, 0, 0, 0});
        return m_.refused(
            "update with another dtype" + at, [&] { (void)cache().update(k, v, layer); },
            attention_or_state(Err::Invalid), false);
      }
      case 3: {  // conv input with a wrong channel count
        const TensorView x = raw_view(z, dt, {1, 7, T}, {0, 0, 0});
        return m_.refused(
            "update_conv_state with 7 channels" + at, [&] { (void)cache().update_conv_state(x, layer, 0); },
            rl.conv_ch.empty() ? std::vector<Err>{Err::State} : std::vector<Err>{Err::Invalid}, false);
      }
      case 4: return probe_whole_state_call(id, at);
      case 5:  // commit before this layer got its tokens
        if (std::string e = m_.refused(
                "commit" + at, [&] { b.commit(); }, {Err::State}, false);
            !e.empty())
          return e;
        return b.is_open() ? "" : m_.fail("a refused commit closed the batch");
      case 6: {
        const TensorView k = raw_view(z, dt, {1, H, T, Dk}, {0, 0, 0, 0});
        const TensorView v = raw_view(z, dt, {1, H, T, Dv}, {0, 0, 0, 0});
        const int bad = next() & 1 ? m_.num_layers() : -1;
        return m_.refused(
            "update of layer " + num(bad) + at, [&] { (void)cache().update(k, v, bad); }, {Err::Index}, false);
      }
      case 7: {
        const TensorView r = raw_view(z, dt, {1, T, 4}, {0, 0, 0});
        return m_.refused(
            "update_side of side 9" + at, [&] { (void)cache().update_side(r, layer, 9); }, {Err::Index, Err::State},
            false);
      }
      default:
        return m_.refused(
            "begin_recurrent_update of state 9" + at,
            [&] { BatchRecurrentUpdate u = cache().begin_recurrent_update(layer, 9); }, {Err::Index, Err::State},
            false);
    }
  }
};

}  // namespace
}  // namespace rwt::seqtest

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static rwt::WarningCapture quiet;  // the deprecation warning of positive crops
  rwt::ByteReader in(data, size);
  const rwt::seqtest::SeqSpec spec = rwt::seqtest::make_spec(in.next());
  rwt::seqtest::Fuzzer fuzzer(in, spec);
  fuzzer.run();
  return 0;
}
