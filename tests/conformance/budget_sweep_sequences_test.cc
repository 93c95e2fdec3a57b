// Budget sweeps of SequenceCache (issue 28): every memory-allocating
// operation (begin_batch of several sizes and sequences, fork, snapshot,
// restore, export_snapshot + import_snapshot, activate_past_recording,
// add_sequence), over layer mixes of 1..N layers, under each budget at which
// the refusal comes from a different allocation: the next budget is read
// off the refusal (what was reserved plus what was asked), from what the
// cache reserves up to what the operation needs. SeqModel checks that a
// refusal leaves every memory() figure, the sequences and their content as
// they were, and that a success matches the reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "conformance/budget_sweep.h"
#include "conformance/sequence_model.h"

namespace rwt::seqtest {
namespace {

// Sequences 0 (L 7, a snapshot held of it at L 5), 1 (recording R 3, L 5)
// and 2 (empty), with blocks of a removed sequence on the free lists.
std::unique_ptr<SeqModel> setup(const std::vector<LayerKind>& kinds, std::string& error) {
  SeqSpec spec;
  spec.name = "sweep";
  spec.kinds = kinds;
  spec.block_size = 4;
  auto m = std::make_unique<SeqModel>(spec);
  for (auto step : std::vector<std::function<std::string()>>{[&] { return m->add(); }, [&] { return m->add(); },
                                                             [&] {
                                                               return m->forward({{0, 5}, {1, 3}});
                                                             },
                                                             [&] { return m->take_snapshot(0); },
                                                             [&] {
                                                               return m->forward({{0, 2}});
                                                             },
                                                             [&] { return m->activate(1, 3); },
                                                             [&] {
                                                               return m->forward({{1, 2}});
                                                             },
                                                             [&] { return m->add(); },
                                                             [&] {
                                                               return m->forward({{2, 9}});
                                                             },
                                                             [&] { return m->remove(2); }, [&] { return m->add(); }}) {
    if (error = step(); !error.empty()) return m;
  }
  return m;
}

struct SeqOp {
  std::string name;
  std::function<std::string(SeqModel&)> run;
};

std::vector<SeqOp> seq_ops() {
  return {
      {"begin_batch {0: 1}",
       [](SeqModel& m) {
         return m.forward({{0, 1}});
       }},
      {"begin_batch {0: 5, 1: 17}",
       [](SeqModel& m) {
         return m.forward({{0, 5}, {1, 17}});
       }},
      {"begin_batch {2: 40}",
       [](SeqModel& m) {
         return m.forward({{2, 40}});
       }},
      {"begin_batch {0: 16, 1: 1, 2: 33}",
       [](SeqModel& m) {
         return m.forward({{0, 16}, {1, 1}, {2, 33}});
       }},
      {"begin_batch {1: 0, 0: 9}",
       [](SeqModel& m) {
         return m.forward({{1, 0}, {0, 9}});
       }},
      {"fork(0)", [](SeqModel& m) { return m.fork(0); }},
      {"fork(1)", [](SeqModel& m) { return m.fork(1); }},
      {"snapshot(1)", [](SeqModel& m) { return m.take_snapshot(1); }},
      {"restore(snapshot 0)", [](SeqModel& m) { return m.restore_new(0); }},
      {"restore(2, snapshot 0)", [](SeqModel& m) { return m.restore_into(2, 0); }},
      {"import_snapshot(export_snapshot(0))", [](SeqModel& m) { return m.export_import(0, 99); }},
      {"import_snapshot(export_snapshot(snapshot 0))", [](SeqModel& m) { return m.export_import(0, 0); }},
      {"activate_past_recording(0, 30)", [](SeqModel& m) { return m.activate(0, 30); }},
      {"add_sequence()", [](SeqModel& m) { return m.add(); }},
  };
}

TEST(BudgetSweep, EverySequenceCacheOperationRefusesAtEachAllocationChangingNothing) {
  std::uint64_t refusals = 0;
  for (const auto& kinds : sweep_mixes()) {
    std::string mix;
    for (LayerKind k : kinds) mix += std::string(mix.empty() ? "" : ",") + std::string(rwd::layer_kind_name(k));
    for (const SeqOp& op : seq_ops()) {
      std::string error;
      std::size_t budget = setup(kinds, error)->cache.memory().bytes_reserved;
      ASSERT_EQ(error, "") << "setup of [" << mix << "]";
      if (budget == 0) budget = 1;
      bool fitted = false;
      for (int round = 0; round < 4000 && !fitted; ++round) {
        std::unique_ptr<SeqModel> m = setup(kinds, error);
        ASSERT_EQ(m->set_budget(budget), "") << mix;
        const std::uint64_t refused_before = m->budget_refusals;
        // SeqModel checks the refusal (memory() and content unchanged) or the success.
        ASSERT_EQ(op.run(*m), "") << op.name << " over [" << mix << "] at budget " << budget;
        if (m->budget_refusals == refused_before) {
          fitted = true;
          EXPECT_LE(m->cache.memory().bytes_reserved, budget) << op.name << " over [" << mix << "]";
        } else {
          ++refusals;
          budget = next_budget(m->last_capacity, budget);
        }
      }
      ASSERT_TRUE(fitted) << op.name << " over [" << mix << "] never fitted";
    }
  }
  EXPECT_GT(refusals, 300u);
}

}  // namespace
}  // namespace rwt::seqtest
