// Storage backends (rewind/storage.h): the guarded backend really keeps its
// pages out of reach, copies between host and device views keep every bit,
// and a cache on guarded storage behaves bit for bit like one in host memory
// through updates, recurrent slots, crops, trees, snapshots and sequences.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "rewind/cache.h"
#include "rewind/cuda_storage.h"
#include "rewind/error.h"
#include "rewind/sequences.h"
#include "rewind/snapshot.h"
#include "rewind/storage.h"
#include "rewind/tensor.h"
#include "rewind/tree.h"

namespace {

using rwd::Cache;
using rwd::Device;
using rwd::DeviceType;
using rwd::DType;
using rwd::LayerOptions;
using rwd::Tensor;
using rwd::TensorView;

// A host tensor of `shape` whose elements are distinct small integers from `seed`.
Tensor pattern(DType dtype, std::initializer_list<std::int64_t> shape, std::uint32_t seed) {
  Tensor t(dtype, shape);
  std::mt19937 rng(seed);
  const TensorView v = t.view();
  const std::int64_t n = v.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const float value = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 8.0f;
    rwd::store_from_f32(static_cast<std::byte*>(v.data) + i * static_cast<std::int64_t>(rwd::dtype_size(dtype)), dtype,
                        value);
  }
  return t;
}

TEST(GuardedStorage, PagesCannotBeTouchedOutsideItsCopies) {
  rwd::Storage& s = *rwd::guarded_storage();
  EXPECT_EQ(s.device().type, DeviceType::Guarded);
  auto* p = static_cast<unsigned char*>(s.allocate(100));
  const unsigned char in[4] = {1, 2, 3, 4};
  s.copy(p + 10, true, in, false, sizeof in);
  unsigned char out[4] = {};
  s.copy(out, false, p + 10, true, sizeof out);
  EXPECT_EQ(std::memcmp(in, out, sizeof in), 0);
  // After the copies the pages are closed again: a direct read or write dies.
  EXPECT_DEATH({ std::printf("%d\n", static_cast<int>(*reinterpret_cast<volatile unsigned char*>(p + 10))); }, "");
  EXPECT_DEATH({ *reinterpret_cast<volatile unsigned char*>(p) = 7; }, "");
  s.deallocate(p, 100);
}

TEST(GuardedStorage, CopiesOverlapZeroAndSpanPages) {
  rwd::Storage& s = *rwd::guarded_storage();
  const std::size_t n = 3 * 4096 + 123;  // several pages
  auto* p = static_cast<unsigned char*>(s.allocate(n));
  std::vector<unsigned char> in(n), out(n), want(n);
  for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<unsigned char>(i * 7 + 3);
  s.copy(p, true, in.data(), false, n);
  // An overlapping move inside the allocation (memmove semantics).
  s.copy(p + 5, true, p, true, n - 5);
  want = in;
  std::memmove(want.data() + 5, want.data(), n - 5);
  s.copy(out.data(), false, p, true, n);
  EXPECT_EQ(out, want);
  s.fill_zero(p + 4000, 300);
  std::fill(want.begin() + 4000, want.begin() + 4300, 0);
  s.copy(out.data(), false, p, true, n);
  EXPECT_EQ(out, want);
  s.deallocate(p, n);
}

TEST(Storage, CopyTensorMovesStridedViewsBetweenHostAndGuarded) {
  rwd::Storage& s = *rwd::guarded_storage();
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    const Tensor src = pattern(dt, {2, 3, 5, 4}, 11);
    const std::size_t bytes = src.bytes();
    void* p = s.allocate(bytes);
    TensorView dev = TensorView::contiguous(p, dt, {2, 3, 5, 4});
    dev.device = s.device();
    rwd::copy_tensor(src.view(), dev);
    EXPECT_TRUE(rwd::bitwise_equal(src.view(), dev));
    EXPECT_TRUE(rwd::bitwise_equal(dev, src.view()));
    EXPECT_FLOAT_EQ(dev.get(1, 2, 4, 3), src.view().get(1, 2, 4, 3));
    dev.set(42.0f, 0, 1, 2, 3);
    EXPECT_EQ(dev.get(0, 1, 2, 3), 42.0f);
    EXPECT_FALSE(rwd::bitwise_equal(src.view(), dev));
    // A transposing read back to the host ([.., 5, 4] -> strides of [.., 4, 5]).
    Tensor t(dt, {2, 3, 4, 5});
    TensorView transposed = t.view();
    std::swap(transposed.shape[2], transposed.shape[3]);
    std::swap(transposed.strides[2], transposed.strides[3]);
    rwd::copy_tensor(dev, transposed);
    for (std::int64_t i = 0; i < 5; ++i)
      for (std::int64_t j = 0; j < 4; ++j) {
        const float want = i == 2 && j == 3 ? 42.0f : src.view().get(0, 1, i, j);
        EXPECT_EQ(t.view().get(0, 1, j, i), want);
      }
    EXPECT_NE(dev.describe().find("on guarded"), std::string::npos) << dev.describe();
    s.deallocate(p, bytes);
  }
}

TEST(Storage, RefusesWhatNoBackendCanDo) {
  TensorView cuda = TensorView::contiguous(reinterpret_cast<void*>(std::uintptr_t{4096}), DType::F32, {4});
  cuda.device = {DeviceType::Cuda, 0};
  Tensor host(DType::F32, {4});
  void* p = rwd::guarded_storage()->allocate(16);
  TensorView guarded = TensorView::contiguous(p, DType::F32, {4});
  guarded.device = rwd::guarded_storage()->device();
  // Two different devices: refused before anything is copied.
  EXPECT_THROW(rwd::copy_tensor(guarded, cuda), rwd::InvalidArgument);
  if (rwd::cuda_device_count() == 0) {
    // No CUDA backend in this build, or no device for it.
    EXPECT_THROW(rwd::storage_for(cuda.device), rwd::InvalidArgument);
    EXPECT_THROW(rwd::copy_tensor(host.view(), cuda), rwd::InvalidArgument);
    EXPECT_THROW(rwd::cuda_storage(0), rwd::InvalidArgument);
  }
  EXPECT_EQ(&rwd::storage_for(Device{}), rwd::host_storage().get());
  EXPECT_EQ(&rwd::storage_for(guarded.device), rwd::guarded_storage().get());
  EXPECT_EQ(Device({DeviceType::Cuda, 3}).describe(), "cuda:3");
  rwd::guarded_storage()->deallocate(p, 16);
}

// ---- a cache on guarded storage against the same cache in host memory -------

LayerOptions hybrid_options(std::shared_ptr<rwd::Storage> storage) {
  LayerOptions o;
  o.num_kv_heads = 2;
  o.key_dim = 4;
  o.value_dim = 3;
  o.sliding_window = 3;
  o.conv_kernel_size = 3;
  o.conv_channels = {5};
  o.recurrent_shapes = {{2, 3}};
  o.storage = std::move(storage);
  return o;
}

const std::vector<std::string> kLayers = {"full_attention", "sliding_attention", "linear_attention"};

// The device storages under test: guarded always, CUDA device 0 where one
// is present (the cases skip without one).
std::shared_ptr<rwd::Storage> storage_named(const std::string& name) {
  if (name == "guarded") return rwd::guarded_storage();
  if (rwd::cuda_device_count() == 0) return nullptr;
  return rwd::cuda_storage(0);
}

class DeviceCache : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    storage_ = storage_named(GetParam());
    if (!storage_) GTEST_SKIP() << "no CUDA device here (cuda_built: " << rwd::cuda_built() << ")";
  }
  std::shared_ptr<rwd::Storage> storage_;
};

struct Pair {
  explicit Pair(std::shared_ptr<rwd::Storage> storage)
      : host(kLayers, hybrid_options(rwd::host_storage())), guarded(kLayers, hybrid_options(std::move(storage))) {}
  Cache host;
  Cache guarded;  // on the storage under test
};

// One forward of q tokens through both caches, every returned view compared.
void forward_both(Pair& c, std::int64_t q, std::uint32_t seed) {
  rwd::Forward fh = c.host.begin_forward(q), fg = c.guarded.begin_forward(q);
  for (int i = 0; i < 2; ++i) {
    const Tensor k = pattern(DType::F32, {1, 2, q, 4}, seed + 10 * i), v = pattern(DType::F32, {1, 2, q, 3}, seed + 1);
    const rwd::KeyValueView a = c.host.update(k, v, i), b = c.guarded.update(k, v, i);
    ASSERT_EQ(b.keys.device, c.guarded.layer(i).options().storage->device());
    ASSERT_FALSE(b.keys.device.is_host());
    ASSERT_TRUE(rwd::bitwise_equal(a.keys, b.keys)) << "layer " << i;
    ASSERT_TRUE(rwd::bitwise_equal(a.values, b.values)) << "layer " << i;
  }
  const Tensor x = pattern(DType::F32, {1, 5, q}, seed + 2);
  ASSERT_TRUE(rwd::bitwise_equal(c.host.update_conv_state(x, 2), c.guarded.update_conv_state(x, 2)));
  rwd::RecurrentUpdate uh = c.host.begin_recurrent_update(q, 2), ug = c.guarded.begin_recurrent_update(q, 2);
  ASSERT_TRUE(rwd::bitwise_equal(uh.previous(), ug.previous()));
  for (std::int64_t t = 1; t <= q; ++t) {
    const Tensor s = pattern(DType::F32, {1, 2, 3}, seed + 100 + static_cast<std::uint32_t>(t));
    rwd::copy_tensor(s, uh.next(t));
    rwd::copy_tensor(s, ug.next(t));
  }
  uh.commit();
  ug.commit();
  fh.commit();
  fg.commit();
}

void expect_same_state(const Pair& c) {
  ASSERT_EQ(c.host.get_seq_length(), c.guarded.get_seq_length());
  ASSERT_EQ(c.host.max_rollback(), c.guarded.max_rollback());
  ASSERT_TRUE(rwd::bitwise_equal(c.host.get_conv_state(2), c.guarded.get_conv_state(2)));
  ASSERT_TRUE(rwd::bitwise_equal(c.host.get_recurrent_state(2), c.guarded.get_recurrent_state(2)));
  const rwd::MemoryReport mh = c.host.memory(), mg = c.guarded.memory();
  ASSERT_EQ(mh.bytes_reserved, mg.bytes_reserved);
  ASSERT_EQ(mh.bytes_used, mg.bytes_used);
}

TEST_P(DeviceCache, MatchesHostThroughUpdatesCropsAndSnapshots) {
  Pair c(storage_);
  c.host.activate_past_recording(4);
  c.guarded.activate_past_recording(4);
  std::mt19937 rng(7);
  for (int step = 0; step < 60; ++step) {
    const std::int64_t q = 1 + static_cast<std::int64_t>(rng() % 4);
    forward_both(c, q, static_cast<std::uint32_t>(step * 1000));
    expect_same_state(c);
    const std::int64_t depth = c.host.max_rollback();
    if (depth > 0 && rng() % 3 == 0) {
      const std::int64_t k = 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(depth));
      c.host.crop(-k);
      c.guarded.crop(-k);
      expect_same_state(c);
    }
  }
  // A snapshot of the guarded cache is plain host data equal to the host cache's,
  // and restoring it into a fresh guarded cache gives the same state again.
  const rwd::Snapshot sh = c.host.snapshot(), sg = c.guarded.snapshot();
  ASSERT_EQ(rwd::serialize_snapshot(sh, "m"), rwd::serialize_snapshot(sg, "m"));
  Pair restored(storage_);
  restored.host.restore(sg);
  restored.guarded.restore(sg);
  expect_same_state(restored);
  forward_both(restored, 2, 99);
  expect_same_state(restored);
}

TEST_P(DeviceCache, TreeCommitMatchesHost) {
  Pair c(storage_);
  forward_both(c, 3, 1);
  const std::vector<std::int64_t> parents = {-1, 0, 0, 1};
  const std::int64_t n = 4;
  rwd::TreeForward th = c.host.begin_tree(parents), tg = c.guarded.begin_tree(parents);
  for (int i = 0; i < 2; ++i) {
    const Tensor k = pattern(DType::F32, {1, 2, n, 4}, 50 + i), v = pattern(DType::F32, {1, 2, n, 3}, 60 + i);
    const rwd::TreeKeyValues a = th.update(k, v, i), b = tg.update(k, v, i);
    ASSERT_TRUE(rwd::bitwise_equal(a.nodes.keys, b.nodes.keys));
    ASSERT_EQ(b.nodes.keys.device, storage_->device());
    ASSERT_TRUE(rwd::bitwise_equal(a.committed.values, b.committed.values));
  }
  const Tensor x = pattern(DType::F32, {1, 5, n}, 70);
  ASSERT_TRUE(rwd::bitwise_equal(th.update_conv(x, 2), tg.update_conv(x, 2)));
  rwd::TreeRecurrentSlots rh = th.recurrent_slots(2), rg = tg.recurrent_slots(2);
  for (std::int64_t node = 0; node < n; ++node) {
    ASSERT_TRUE(rwd::bitwise_equal(rh.previous(node), rg.previous(node)));
    const Tensor s = pattern(DType::F32, {1, 2, 3}, 80 + static_cast<std::uint32_t>(node));
    rwd::copy_tensor(s, rh.next(node));
    rwd::copy_tensor(s, rg.next(node));
  }
  th.commit(3);
  tg.commit(3);
  expect_same_state(c);
  forward_both(c, 1, 90);
  expect_same_state(c);
}

TEST_P(DeviceCache, SequenceForkAndCopyOnWriteMatchHost) {
  using rwd::SequenceCache;
  SequenceCache host(kLayers, hybrid_options(rwd::host_storage()), rwd::SequenceCacheOptions{4});
  SequenceCache guarded(kLayers, hybrid_options(storage_), rwd::SequenceCacheOptions{4});
  EXPECT_EQ(guarded.layer_options(0).storage, storage_);
  const rwd::SeqId a = host.add_sequence(), ga = guarded.add_sequence();
  host.activate_past_recording(a, 4);
  guarded.activate_past_recording(ga, 4);
  auto step = [&](std::vector<std::pair<rwd::SeqId, rwd::SeqId>> seqs, std::int64_t q, std::uint32_t seed) {
    std::vector<rwd::BatchEntry> eh, eg;
    for (auto [h, g] : seqs) {
      eh.push_back({h, q});
      eg.push_back({g, q});
    }
    const auto B = static_cast<std::int64_t>(seqs.size());
    rwd::SequenceBatch bh = host.begin_batch(eh), bg = guarded.begin_batch(eg);
    for (int i = 0; i < 2; ++i) {
      const Tensor k = pattern(DType::F32, {1, 2, B * q, 4}, seed + i), v = pattern(DType::F32, {1, 2, B * q, 3}, seed);
      host.update(k, v, i);
      guarded.update(k, v, i);
    }
    const Tensor x = pattern(DType::F32, {1, 5, B * q}, seed + 5);
    host.update_conv_state(x, 2);
    guarded.update_conv_state(x, 2);
    rwd::BatchRecurrentUpdate uh = host.begin_recurrent_update(2), ug = guarded.begin_recurrent_update(2);
    for (std::size_t e = 0; e < seqs.size(); ++e)
      for (std::int64_t t = 1; t <= q; ++t) {
        const Tensor s = pattern(DType::F32, {1, 2, 3}, seed + 200 + static_cast<std::uint32_t>(10 * e + t));
        rwd::copy_tensor(s, uh.next(e, t));
        rwd::copy_tensor(s, ug.next(e, t));
      }
    uh.commit();
    ug.commit();
    bh.commit();
    bg.commit();
  };
  auto same = [&](rwd::SeqId h, rwd::SeqId g) {
    ASSERT_EQ(host.seq_length(h), guarded.seq_length(g));
    for (int i = 0; i < 2; ++i) {
      const Tensor kh = host.keys(h, i), kg = guarded.keys(g, i);
      ASSERT_TRUE(rwd::bitwise_equal(kh, kg)) << "layer " << i;
      ASSERT_TRUE(rwd::bitwise_equal(host.values(h, i), guarded.values(g, i))) << "layer " << i;
    }
    ASSERT_TRUE(rwd::bitwise_equal(host.get_conv_state(h, 2), guarded.get_conv_state(g, 2)));
    ASSERT_TRUE(rwd::bitwise_equal(host.get_recurrent_state(h, 2), guarded.get_recurrent_state(g, 2)));
  };
  step({{a, ga}}, 6, 1);  // one and a half blocks: the fork shares a partly filled block
  const rwd::SeqId b = host.fork(a), gb = guarded.fork(ga);
  step({{a, ga}, {b, gb}}, 3, 2);  // both write: copy-on-write of the shared block
  same(a, ga);
  same(b, gb);
  host.crop(b, -2);
  guarded.crop(gb, -2);
  step({{b, gb}}, 1, 3);
  same(a, ga);
  same(b, gb);
  EXPECT_EQ(host.memory().bytes_reserved, guarded.memory().bytes_reserved);
}

TEST(GuardedCache, RefusesInputsOnAnotherDeviceChangingNothing) {
  Pair c(rwd::guarded_storage());
  forward_both(c, 2, 5);
  const Tensor k = pattern(DType::F32, {1, 2, 1, 4}, 1), v = pattern(DType::F32, {1, 2, 1, 3}, 2);
  TensorView elsewhere = k.view();
  elsewhere.device = {DeviceType::Cuda, 0};
  const rwd::MemoryReport before = c.guarded.memory();
  try {
    c.guarded.update(elsewhere, v, 0);
    FAIL() << "an input on cuda:0 was accepted by a cache on guarded storage";
  } catch (const rwd::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is on cuda:0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("inputs may be host memory or guarded"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.guarded.get_seq_length(0), 2);
  EXPECT_EQ(c.guarded.memory().bytes_reserved, before.bytes_reserved);
  // A host cache takes host inputs only: a guarded view is another device to it.
  const rwd::KeyValueView guarded_rows = c.guarded.update(k, v, 0);
  EXPECT_THROW(c.host.update(guarded_rows.keys.slice(2, 0, 1), v, 0), rwd::InvalidArgument);
  EXPECT_EQ(c.host.get_seq_length(0), 2);
  // The same refusals in a batch of sequences.
  rwd::SequenceCache seqs(kLayers, hybrid_options(rwd::guarded_storage()));
  const rwd::SeqId id = seqs.add_sequence();
  const std::vector<rwd::BatchEntry> one = {{id, 1}};
  rwd::SequenceBatch batch = seqs.begin_batch(one);
  EXPECT_THROW(seqs.update(elsewhere, v, 0), rwd::InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Storages, DeviceCache, ::testing::Values("guarded", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
