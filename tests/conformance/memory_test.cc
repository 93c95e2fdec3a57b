// Memory stays bounded by R while recording (docs/semantics.md section 4):
// after thousands of tokens a sliding / chunked / conv / recurrent part holds
// what W-1+R, C-1+R, K+R and R+1 allow, while full attention grows.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

constexpr i64 kR = 8;

// Feeds one forward to every layer without comparing the results.
std::string cache_step_unchecked(Cache& cache, RefCache& ref, i64 q, std::uint64_t salt) {
  try {
    for (int i = 0; i < cache.num_layers(); ++i) {
      RefLayer& r = ref.layers[static_cast<std::size_t>(i)];
      const StepData st = r.make_step(q, salt * 131 + static_cast<std::uint64_t>(i));
      if (r.has_attention()) {
        const HostTensor k = r.kv_input(st, true, false), v = r.kv_input(st, false, false);
        (void)cache.update(k.view(), v.view(), i);
      }
      for (std::size_t s = 0; s < r.conv_ch.size(); ++s) {
        const HostTensor x = r.conv_input(st, s);
        (void)cache.update_conv_state(x.view(), i, static_cast<int>(s));
      }
      for (std::size_t s = 0; s < r.rec_shapes.size(); ++s) {
        rwd::RecurrentUpdate u = cache.begin_recurrent_update(q, i, static_cast<int>(s));
        for (i64 t = 1; t <= q; ++t) scatter(st.rec[s][static_cast<std::size_t>(t - 1)], u.next(t));
        u.commit();
      }
      r.apply_update(st);
    }
  } catch (const rwd::Error& e) {
    return e.what();
  }
  return "";
}
constexpr i64 kMaxQ = 6;

LayerOptions wide_options(LayerKind kind) {
  LayerOptions o = small_options(kind, DType::F32, false, 2);
  if (o.num_kv_heads > 0) {
    o.key_dim = 8;
    o.value_dim = 8;
  }
  return o;
}

// Upper bound of bytes_used for a recording layer, from the retention rules
// (10.1) plus one update of slack.
std::size_t used_bound(const RefLayer& r) {
  const std::size_t es = r.esize();
  std::size_t bound = 0;
  const std::size_t attn_row = static_cast<std::size_t>(r.B * r.H * (r.Dk + r.Dv)) * es;
  if (r.attn() == Attn::Sliding) bound += static_cast<std::size_t>(r.W - 1 + kR + kMaxQ) * attn_row;
  if (r.attn() == Attn::Chunked) bound += static_cast<std::size_t>(r.C - 1 + kR + kMaxQ) * attn_row;
  for (i64 ch : r.conv_ch) bound += static_cast<std::size_t>((r.K + kR + kMaxQ) * r.B * ch) * es;
  for (i64 n : r.rec_numel) bound += static_cast<std::size_t>((kR + 1 + kMaxQ) * r.B * n) * r.resize();
  return bound;
}

TEST(Memory, BoundedByRWhileFullAttentionGrows) {
  const std::vector<LayerKind> kinds = {LayerKind::FullAttention,    LayerKind::SlidingAttention,
                                        LayerKind::ChunkedAttention, LayerKind::Conv,
                                        LayerKind::LinearAttention,  LayerKind::HybridSliding};
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k : kinds) spec.push_back({k, wide_options(k)});
  Built b = build_cache(spec);
  b.cache.activate_past_recording(kR);
  b.ref.activate(kR);
  std::uint64_t salt = 0;
  std::size_t reserved_at_1000 = 0;
  i64 q = 1;
  while (b.ref.seq_length() < 20000) {  // 20k tokens, as the performance issue asks
    // Checked once at the end (checking every update of the full layer is O(L)).
    ASSERT_EQ(cache_step_unchecked(b.cache, b.ref, q, ++salt), "");
    q = q % kMaxQ + 1;
    if (salt % 7 == 0) {  // a rejected draft now and then
      b.cache.crop(-2);
      b.ref.crop(-2);
    }
    if (reserved_at_1000 == 0 && b.ref.seq_length() >= 1000)
      reserved_at_1000 = b.cache.memory().layers[1].bytes_reserved;
    for (std::size_t i = 1; i < kinds.size(); ++i) {
      const std::size_t used = b.cache.layer(static_cast<int>(i)).memory().bytes_used;
      ASSERT_LE(used, used_bound(b.ref.layers[i])) << rwd::layer_kind_name(kinds[i]) << " at L=" << b.ref.seq_length();
    }
  }
  ASSERT_EQ(verify(b.cache, b.ref), "");
  const i64 L = b.ref.seq_length();
  const rwd::MemoryReport m = b.cache.memory();
  ASSERT_EQ(m.layers.size(), kinds.size());
  std::size_t sum_used = 0, sum_reserved = 0;
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    EXPECT_EQ(m.layers[i].kind, rwd::layer_kind_name(kinds[i]));
    EXPECT_LE(m.layers[i].bytes_used, m.layers[i].bytes_reserved);
    sum_used += m.layers[i].bytes_used;
    sum_reserved += m.layers[i].bytes_reserved;
  }
  EXPECT_EQ(m.bytes_used, sum_used);
  EXPECT_EQ(m.bytes_reserved, sum_reserved);
  // Full attention holds every token.
  const RefLayer& full = b.ref.layers[0];
  const std::size_t full_row = static_cast<std::size_t>(full.B * full.H * (full.Dk + full.Dv)) * 4;
  EXPECT_GE(m.layers[0].bytes_used, static_cast<std::size_t>(L) * full_row);
  // The bounded layers' allocations do not grow with L either.
  for (std::size_t i = 1; i < kinds.size(); ++i)
    EXPECT_LE(m.layers[i].bytes_reserved, 4 * used_bound(b.ref.layers[i]) + 65536) << rwd::layer_kind_name(kinds[i]);
  EXPECT_LE(m.layers[1].bytes_reserved, 2 * reserved_at_1000) << "sliding allocation keeps growing";
  // Bounded layers hold far less than the full-attention layer.
  EXPECT_LT(m.layers[1].bytes_used * 20, m.layers[0].bytes_used);
}

TEST(Memory, StaticLayersAllocateOnce) {
  LayerOptions o = wide_options(LayerKind::FullAttention);
  o.static_capacity = 64;
  Layer full(LayerKind::FullAttention, o, 0);
  RefLayer rfull(LayerKind::FullAttention, o, 0);
  LayerOptions so = wide_options(LayerKind::SlidingAttention);
  so.static_capacity = 24;
  Layer sliding(LayerKind::SlidingAttention, so, 1);
  RefLayer rsliding(LayerKind::SlidingAttention, so, 1);
  sliding.activate_past_recording(kR);
  rsliding.activate(kR);
  const std::size_t row = static_cast<std::size_t>(2 * 2 * 16) * 4;
  const std::size_t full_reserved = full.memory().bytes_reserved;
  const std::size_t sliding_reserved = sliding.memory().bytes_reserved;
  EXPECT_GE(full_reserved, 64 * row);
  EXPECT_GE(sliding_reserved, 24 * row);
  std::uint64_t salt = 0;
  for (i64 q = 1; rfull.L + q <= 64; q = q % kMaxQ + 1) ASSERT_EQ(do_update(Target::of(full), rfull, q, ++salt), "");
  for (int i = 0; i < 300; ++i) ASSERT_EQ(do_update(Target::of(sliding), rsliding, i % kMaxQ + 1, ++salt), "");
  EXPECT_EQ(full.memory().bytes_reserved, full_reserved);
  EXPECT_EQ(sliding.memory().bytes_reserved, sliding_reserved);
  ASSERT_EQ(verify(full, rfull), "");
  ASSERT_EQ(verify(sliding, rsliding), "");
}

}  // namespace
}  // namespace rwt
