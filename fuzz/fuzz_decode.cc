// libFuzzer target: the runtime's batched forward (Model::forward_batch)
// over a SequenceCache, on small random hybrids with every layer kind the
// runtime supports, against a solo reference per sequence. The input bytes
// pick one of four models (f32 / f16 / bf16 weights, the Qwen3.5-style
// variants, block sizes 1, 2, 3 and 16, windows far below the lengths
// reached) and then a run of operations:
//   ragged forwards (entries of 0 tokens, any LogitRows, any order), adds,
//   forks, removals, crops of any n (huge ones included), recording on and
//   off, snapshots taken and restored (as new sequences and into live ones),
//   memory budgets set below, at and above what is reserved, and lifted;
// and hostile forwards that must be refused with nothing changed: a token
// outside the vocabulary, a sequence listed twice, a removed or forged id,
// a LogitRows outside its three values, an empty batch, a batch of no token.
//
// The oracle is batch invariance, the runtime's contract: every row of
// logits a forward returns for a sequence must equal, bit for bit, the row
// Model::forward gives on a single-sequence Cache fed that sequence's
// tokens. The reference is rebuilt by replaying the token history (one
// prompt-sized forward) after every crop, fork and restore, so an inexact
// rollback, a fork or snapshot that shares state it should not, or a refused
// forward that changed something shows up as a differing row in a later
// forward (the run ends with one for every live sequence). Any mismatch,
// crash, sanitizer report or exception not derived from rwd::Error aborts;
// an rwd::Error is accepted only where the contract allows one (a hostile
// forward, a crop or recording change the layers cannot do exactly, a
// CapacityError under a budget), and only with every length unchanged.
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_support.h"
#include "rewind/error.h"
#include "rewind/sequences.h"
#include "runtime/model.h"
#include "runtime/model_config.h"
#include "runtime/test_configs.h"

namespace {

using rwd::Cache;
using rwd::SeqId;
using rwd::SequenceCache;
using rwd::runtime::LogitRows;
using rwd::runtime::Model;
using rwd::runtime::ModelConfig;
using rwd::runtime::ModelWeights;
using rwd::runtime::SequenceTokens;
using Tokens = std::vector<std::int32_t>;
using i64 = std::int64_t;

constexpr i64 kVocab = 258;
constexpr std::size_t kMaxLive = 6;
constexpr std::array<i64, 8> kCropHuge{std::numeric_limits<i64>::min(),
                                       std::numeric_limits<i64>::max(),
                                       -(i64{1} << 62),
                                       i64{1} << 62,
                                       -(i64{1} << 40),
                                       i64{1} << 40,
                                       -1000,
                                       1000};
constexpr std::array<i64, 6> kRecording{0, 1, 2, 3, 5, 8};

struct Spec {
  const char* name;
  Model model;
  i64 block_size;
};

ModelConfig validated(ModelConfig c) {
  // The config a checkpoint would carry: what parse_model_config accepts.
  (void)rwd::runtime::parse_model_config(rwd::runtime::to_json(c), "fuzz_decode");
  return c;
}

Spec make_spec(int which) {
  namespace tc = rwd::runtime::testing_configs;
  switch (which) {
    case 0:
      return {"every_kind_f32_bs1", Model(ModelWeights::random(validated(tc::hybrid(tc::kEveryKind, 16, 3)), 11)), 1};
    case 1: {
      ModelConfig c = tc::hybrid({"conv", "full_attention", "linear_attention", "sliding_attention"}, 16, 2);
      c.norm_plus_one = true;
      c.qk_norm = true;
      c.attn_output_gate = true;
      c.rotary_dim = 2;
      return {"qwen35_variants_f16_bs3", Model(ModelWeights::random(validated(c), 12, rwd::DType::F16)), 3};
    }
    case 2: {
      ModelConfig c = tc::hybrid({"sliding_attention", "linear_attention", "sliding_attention", "conv"}, 16, 4);
      c.tie_word_embeddings = true;
      return {"tied_bf16_bs16", Model(ModelWeights::random(validated(c), 13, rwd::DType::BF16)), 16};
    }
    default: {
      ModelConfig c = tc::hybrid({"linear_attention", "full_attention", "conv", "linear_attention"}, 16, 3);
      c.fused_gdn_projections = true;
      c.norm_plus_one = true;
      return {"fused_gdn_f32_bs2", Model(ModelWeights::random(validated(c), 14)), 2};
    }
  }
}

const Spec& spec(int which) {
  static std::array<std::optional<Spec>, 4> specs;
  if (!specs[which]) specs[which].emplace(make_spec(which));
  return *specs[which];
}

enum Stat {
  kForward,
  kRows,
  kRefusedHostile,
  kCapacity,
  kCrop,
  kCropRefused,
  kFork,
  kSnapshot,
  kRestoreInto,
  kBudget,
  kRecord,
  kStatCount
};
constexpr const char* kStatNames[kStatCount] = {
    "batched forwards", "  rows compared", "hostile forwards refused",  "CapacityErrors under a budget", "crops done",
    "crops refused",    "forks",           "snapshots restored as new", "snapshots restored into",       "budgets set",
    "recording changes"};
rwt::FuzzStats<kStatCount>& stats() {
  static rwt::FuzzStats<kStatCount> s(kStatNames);
  return s;
}
void count(Stat k, unsigned long long by = 1) { stats().count(static_cast<std::size_t>(k), by); }

// One live sequence: its id in the batched cache, every token it holds, and
// the single-sequence reference fed those tokens.
struct Live {
  SeqId id;
  Tokens history;
  Cache solo;
};

struct Held {
  rwd::SequenceSnapshot snapshot;
  Tokens history;
};

class Fuzzer {
 public:
  Fuzzer(rwt::ByteReader& in, const Spec& s)
      : in_(in), spec_(s), model_(s.model), cache_(model_.make_sequence_cache({s.block_size})) {}

  void run() {
    for (int step = 0; step < 40 && !in_.empty(); ++step) {
      if (live_.empty()) {
        add();
        continue;
      }
      switch (next() % 16) {
        case 0:
        case 1:
        case 2:
        case 3:
        case 4: forward(); break;
        case 5:
        case 6: hostile_forward(); break;
        case 7:
          if (live_.size() < kMaxLive) add();
          break;
        case 8:
          if (live_.size() < kMaxLive) fork();
          break;
        case 9: remove(); break;
        case 10:
        case 11: crop(); break;
        case 12: recording(); break;
        case 13: snapshot_op(); break;
        case 14: budget(); break;
        default: stale_ops(); break;
      }
    }
    // Every state checked once more, under no budget.
    cache_.set_memory_budget(0);
    if (!live_.empty()) {
      std::vector<Tokens> chunks(live_.size(), Tokens{1});
      std::vector<LogitRows> rows(live_.size(), LogitRows::kAll);
      run_forward(order(live_.size()), chunks, rows, "final");
    }
    for (const Live& s : live_) {
      if (!cache_.seq_rm(s.id)) die("seq_rm of a live sequence returned false");
    }
    held_.clear();
    const rwd::SequenceMemory m = cache_.memory();
    if (m.blocks_in_use != 0 || cache_.num_sequences() != 0) die("blocks still in use after every sequence went");
  }

 private:
  rwt::ByteReader& in_;
  const Spec& spec_;
  const Model& model_;
  SequenceCache cache_;
  std::vector<Live> live_;
  std::vector<SeqId> dead_;
  std::vector<Held> held_;
  std::vector<float> logits_;  // reused across forwards, as a caller would
  std::string log_;

  std::uint8_t next() { return in_.next(); }
  std::size_t pick() { return next() % live_.size(); }

  [[noreturn]] void die(const std::string& what) {
    std::fprintf(stderr, "fuzz_decode (%s): %s\noperations:\n%s\n", spec_.name, what.c_str(), log_.c_str());
    std::abort();
  }
  void note(const std::string& s) { log_ += s + "\n"; }

  Cache replay(const Tokens& history) const {
    Cache c = model_.make_cache();
    if (!history.empty()) {
      std::vector<float> unused;
      model_.forward(history, c, unused, /*all_logits=*/false);
    }
    return c;
  }

  Tokens random_tokens(i64 n) {
    Tokens t(static_cast<std::size_t>(n));
    for (auto& v : t) v = static_cast<std::int32_t>(next() % kVocab);
    return t;
  }

  std::vector<std::size_t> order(std::size_t n) {
    std::vector<std::size_t> o(n);
    for (std::size_t i = 0; i < n; ++i) o[i] = i;
    return o;
  }

  std::vector<i64> lengths() const {
    std::vector<i64> l;
    for (const Live& s : live_) l.push_back(cache_.seq_length(s.id));
    return l;
  }
  void expect_lengths(const std::vector<i64>& before, const std::string& what) {
    for (std::size_t i = 0; i < live_.size(); ++i) {
      const i64 now = cache_.seq_length(live_[i].id);
      if (now != before[i] || now != static_cast<i64>(live_[i].history.size())) {
        die(what + ": sequence " + std::to_string(i) + " holds " + std::to_string(now) + " tokens, expected " +
            std::to_string(before[i]));
      }
    }
  }

  // forward_batch of chunks[k] for live_[who[k]], then each sequence's
  // returned rows against its reference's forward of the same tokens.
  void run_forward(const std::vector<std::size_t>& who, const std::vector<Tokens>& chunks,
                   const std::vector<LogitRows>& rows, const std::string& what) {
    std::vector<SequenceTokens> batch;
    i64 total = 0;
    for (std::size_t k = 0; k < who.size(); ++k) {
      batch.push_back({live_[who[k]].id, chunks[k], rows[k]});
      total += static_cast<i64>(chunks[k].size());
    }
    note(what + ": " + std::to_string(who.size()) + " entries, " + std::to_string(total) + " tokens");
    const std::vector<i64> before = lengths();
    try {
      model_.forward_batch(batch, cache_, logits_);
    } catch (const rwd::CapacityError& e) {
      if (cache_.memory_budget() == 0) die(what + ": CapacityError without a budget: " + e.what());
      count(kCapacity);
      expect_lengths(before, what + " refused by the budget");
      return;
    } catch (const rwd::Error& e) {
      die(what + ": a valid batch refused: " + e.what());
    }
    if (total == 0) die(what + ": a batch of no token was accepted");
    count(kForward);
    const auto V = static_cast<std::size_t>(kVocab);
    std::size_t row = 0;
    for (std::size_t k = 0; k < who.size(); ++k) {
      Live& s = live_[who[k]];
      const Tokens& c = chunks[k];
      if (c.empty()) continue;
      std::vector<float> solo;
      model_.forward(c, s.solo, solo, /*all_logits=*/true);
      s.history.insert(s.history.end(), c.begin(), c.end());
      const std::size_t first = rows[k] == LogitRows::kAll ? 0 : c.size() - 1;
      const std::size_t n = rows[k] == LogitRows::kAll ? c.size() : rows[k] == LogitRows::kLast ? 1 : 0;
      if ((row + n) * V > logits_.size()) die(what + ": fewer rows of logits than asked for");
      for (std::size_t r = 0; r < n; ++r) {
        if (std::memcmp(solo.data() + (first + r) * V, logits_.data() + (row + r) * V, V * sizeof(float)) != 0) {
          die(what + ": entry " + std::to_string(k) + " (sequence " + std::to_string(who[k]) + ", " +
              std::to_string(s.history.size()) + " tokens) row " + std::to_string(first + r) +
              " differs from its solo forward");
        }
      }
      count(kRows, n);
      row += n;
    }
    if (row * V != logits_.size()) die(what + ": more rows of logits than asked for");
    for (const Live& s : live_) {
      if (cache_.seq_length(s.id) != static_cast<i64>(s.history.size())) die(what + ": a length is off");
    }
  }

  LogitRows pick_rows() {
    switch (next() % 3) {
      case 0: return LogitRows::kAll;
      case 1: return LogitRows::kLast;
      default: return LogitRows::kNone;
    }
  }

  // Some live sequences in a random order, each with 0 to 9 tokens (a
  // prompt now and then).
  void forward() {
    std::vector<std::size_t> who;
    for (std::size_t i = 0; i < live_.size(); ++i) {
      if (next() % 4 != 0) who.push_back(i);
    }
    if (who.empty()) who.push_back(pick());
    for (std::size_t i = who.size(); i > 1; --i) std::swap(who[i - 1], who[next() % i]);
    std::vector<Tokens> chunks;
    std::vector<LogitRows> rows;
    bool any = false;
    for (std::size_t k = 0; k < who.size(); ++k) {
      const std::uint8_t c = next();
      const i64 n = c % 8 == 0 ? 0 : c % 8 == 7 ? 9 + c % 13 : c % 4;
      chunks.push_back(random_tokens(n));
      rows.push_back(pick_rows());
      any = any || n > 0;
    }
    if (!any) chunks[0] = random_tokens(1);
    run_forward(who, chunks, rows, "forward");
  }

  // A valid-looking batch with one defect: refused, nothing changed.
  void hostile_forward() {
    const std::size_t a = pick();
    std::vector<SequenceTokens> batch;
    std::vector<Tokens> chunks{random_tokens(1 + next() % 3), random_tokens(next() % 3)};
    batch.push_back({live_[a].id, chunks[0], LogitRows::kLast});
    std::string defect;
    switch (next() % 7) {
      case 0: {
        static constexpr std::array<std::int32_t, 4> kBad{static_cast<std::int32_t>(kVocab), -1,
                                                          std::numeric_limits<std::int32_t>::max(),
                                                          std::numeric_limits<std::int32_t>::min()};
        chunks[0][next() % chunks[0].size()] = kBad[next() % kBad.size()];
        batch[0].tokens = chunks[0];
        defect = "a token outside the vocabulary";
        break;
      }
      case 1:
        batch.push_back({live_[a].id, chunks[1], LogitRows::kAll});
        defect = "a sequence listed twice";
        break;
      case 2:
        if (dead_.empty()) return;
        batch.push_back({dead_[next() % dead_.size()], chunks[0], LogitRows::kAll});
        defect = "a removed sequence";
        break;
      case 3: {
        const SeqId forged{static_cast<std::uint32_t>(next()), 1 + next() * 1000003ull};
        if (cache_.contains(forged)) return;  // generations are process-wide: a forgery may hit a live one
        batch.push_back({forged, chunks[0], LogitRows::kAll});
        defect = "a forged id";
        break;
      }
      case 4:
        batch[0].logits = static_cast<LogitRows>(3 + next() % 250);
        defect = "a LogitRows outside its three values";
        break;
      case 5:
        batch.clear();
        defect = "an empty batch";
        break;
      default:
        for (auto& e : batch) e.tokens = {};
        if (live_.size() > 1) batch.push_back({live_[(a + 1) % live_.size()].id, {}, LogitRows::kAll});
        defect = "a batch of no token";
        break;
    }
    if (next() & 1 && batch.size() > 0) std::swap(batch.front(), batch.back());
    note("hostile forward: " + defect);
    const std::vector<i64> before = lengths();
    const std::vector<float> logits_before = logits_;
    bool refused = false;
    try {
      model_.forward_batch(batch, cache_, logits_);
    } catch (const rwd::Error&) {
      refused = true;
    }
    if (!refused) die("hostile forward accepted: " + defect);
    count(kRefusedHostile);
    expect_lengths(before, "hostile forward (" + defect + ")");
    if (logits_ != logits_before) die("a refused forward wrote logits (" + defect + ")");
  }

  void add() {
    try {
      const SeqId id = cache_.add_sequence();
      live_.push_back({id, {}, model_.make_cache()});
      note("add");
      // Most sequences record, as speculative decoding's do: their crops
      // are the ones that must be exact.
      if (next() % 4 != 0) {
        const i64 R = kRecording[1 + next() % (kRecording.size() - 1)];
        note("activate recording R " + std::to_string(R));
        cache_.activate_past_recording(id, R);
      }
    } catch (const rwd::CapacityError&) {
      if (cache_.memory_budget() == 0) die("add_sequence refused without a budget");
      count(kCapacity);
    }
  }

  void fork() {
    const std::size_t p = pick();
    const std::vector<i64> before = lengths();
    try {
      const SeqId id = cache_.fork(live_[p].id);
      live_.push_back({id, live_[p].history, replay(live_[p].history)});
      count(kFork);
      note("fork " + std::to_string(p));
    } catch (const rwd::CapacityError&) {
      if (cache_.memory_budget() == 0) die("fork refused without a budget");
      count(kCapacity);
      expect_lengths(before, "fork refused");
    }
  }

  void remove() {
    const std::size_t i = pick();
    if (!cache_.seq_rm(live_[i].id)) die("seq_rm of a live sequence returned false");
    dead_.push_back(live_[i].id);
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
    note("remove " + std::to_string(i));
  }

  void crop() {
    const std::size_t i = pick();
    Live& s = live_[i];
    const i64 L = static_cast<i64>(s.history.size());
    const std::uint8_t c = next();
    i64 n;
    if (c % 8 == 0)
      n = kCropHuge[next() % kCropHuge.size()];
    else if (c % 8 == 1)
      n = next() % (L + 2);  // legacy keep-the-first-n
    else if (c % 8 == 2)
      n = 0;
    else
      n = -static_cast<i64>(1 + next() % 6);
    const i64 rollback = cache_.max_rollback(s.id);
    const std::vector<i64> before = lengths();
    note("crop " + std::to_string(i) + " by " + std::to_string(n) + " (L " + std::to_string(L) + ", max_rollback " +
         std::to_string(rollback) + ")");
    try {
      cache_.crop(s.id, n);
    } catch (const rwd::Error& e) {
      // Within max_rollback a crop is exact; so is a full rollback wherever
      // crop is allowed at all (recording, or max_rollback reaching L:
      // docs/semantics.md section 3).
      const bool full = n < 0 && n <= -L;
      const bool within = n < 0 && !full && -n <= rollback;
      if (within || (full && (cache_.is_recording(s.id) || (L > 0 && rollback >= L)))) {
        die(std::string("a crop the contract allows refused: ") + e.what());
      }
      count(kCropRefused);
      expect_lengths(before, "crop refused");
      return;
    }
    const i64 kept = n < 0 ? (n <= -L ? 0 : L + n) : n == 0 ? L : std::min(n, L);
    if (cache_.seq_length(s.id) != kept) die("crop left " + std::to_string(cache_.seq_length(s.id)) + " tokens");
    count(kCrop);
    if (kept != L) {
      s.history.resize(static_cast<std::size_t>(kept));
      s.solo = replay(s.history);
    }
  }

  void recording() {
    const std::size_t i = pick();
    count(kRecord);
    const bool off = next() % 4 == 0;
    const i64 R = kRecording[next() % kRecording.size()];
    note(off ? "deactivate recording " + std::to_string(i)
             : "activate recording " + std::to_string(i) + " R " + std::to_string(R));
    const std::vector<i64> before = lengths();
    try {
      if (off)
        cache_.deactivate_past_recording(live_[i].id);
      else
        cache_.activate_past_recording(live_[i].id, R);
    } catch (const rwd::CapacityError&) {
      expect_lengths(before, "recording change refused");
      if (cache_.memory_budget() == 0) die("recording refused without a budget");
      count(kCapacity);
    }
  }

  void snapshot_op() {
    const std::uint8_t c = next() % 4;
    try {
      if (held_.empty() || (c == 0 && held_.size() < 3)) {
        const std::size_t i = pick();
        held_.push_back({cache_.snapshot(live_[i].id), live_[i].history});
        note("snapshot " + std::to_string(i));
        return;
      }
      const std::size_t k = next() % held_.size();
      if (c == 1 && live_.size() < kMaxLive) {
        const SeqId id = cache_.restore(held_[k].snapshot);
        live_.push_back({id, held_[k].history, replay(held_[k].history)});
        count(kSnapshot);
        note("restore snapshot " + std::to_string(k) + " as new");
      } else if (c == 2) {
        const std::size_t i = pick();
        const std::vector<i64> before = lengths();
        try {
          cache_.restore(live_[i].id, held_[k].snapshot);
        } catch (const rwd::CapacityError&) {
          expect_lengths(before, "restore into refused");
          throw;
        }
        live_[i].history = held_[k].history;
        live_[i].solo = replay(live_[i].history);
        count(kRestoreInto);
        note("restore snapshot " + std::to_string(k) + " into " + std::to_string(i));
      } else {
        held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(k));
        note("drop snapshot " + std::to_string(k));
      }
    } catch (const rwd::CapacityError&) {
      if (cache_.memory_budget() == 0) die("a snapshot operation refused without a budget");
      count(kCapacity);
    }
  }

  // A budget below, at or above what is reserved now, or none.
  void budget() {
    count(kBudget);
    const std::size_t reserved = cache_.memory().bytes_reserved;
    const std::size_t old = cache_.memory_budget();
    static constexpr std::array<std::size_t, 6> kSlack{0, 1, 512, 4096, 32768, 262144};
    const std::uint8_t c = next() % 4;
    if (c == 0) {
      cache_.set_memory_budget(0);
      note("budget lifted");
      return;
    }
    if (c == 1 && reserved > 1) {
      note("budget below the reservation");
      try {
        cache_.set_memory_budget(reserved - 1 - next() % (reserved - 1));
      } catch (const rwd::CapacityError&) {
        if (cache_.memory_budget() != old) die("a refused budget changed the budget");
        return;
      }
      die("a budget below what is reserved was accepted");
    }
    const std::size_t b = reserved + kSlack[next() % kSlack.size()];
    note("budget " + std::to_string(b) + " (reserved " + std::to_string(reserved) + ")");
    cache_.set_memory_budget(b == 0 ? 1 : b);
  }

  // Per-sequence calls on removed and forged ids: refused, nothing changed.
  void stale_ops() {
    if (dead_.empty()) return;
    const bool removed = next() & 1;
    const SeqId id = removed ? dead_[next() % dead_.size()] : SeqId{next(), 7777777ull + next()};
    if (cache_.contains(id)) {
      if (removed) die("a removed id is contained");
      return;  // a forgery that names a live sequence
    }
    const std::vector<i64> before = lengths();
    note("stale id calls");
    if (cache_.seq_rm(id)) die("seq_rm of a removed or forged id returned true");
    const auto refused = [&](auto&& f, const char* what) {
      try {
        f();
      } catch (const rwd::IndexError&) {
        return;
      }
      die(std::string(what) + " of a removed or forged id was accepted");
    };
    refused([&] { cache_.crop(id, -1); }, "crop");
    refused([&] { (void)cache_.fork(id); }, "fork");
    refused([&] { (void)cache_.snapshot(id); }, "snapshot");
    refused([&] { cache_.activate_past_recording(id, 2); }, "activate_past_recording");
    refused([&] { (void)cache_.seq_length(id); }, "seq_length");
    expect_lengths(before, "stale id calls");
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  rwt::ByteReader in(data, size);
  const Spec& s = spec(in.next() % 4);
  try {
    Fuzzer(in, s).run();
  } catch (const rwd::Error& e) {
    std::fprintf(stderr, "fuzz_decode (%s): unexpected rwd::Error: %s\n", s.name, e.what());
    std::abort();
  }
  return 0;
}
