// The README's API tour, compiled and run by the test suite.
#include <cstdio>
#include <vector>

#include "rewind/cache.h"
#include "rewind/error.h"

using namespace rwd;

int main() {
  // A hybrid model: a Gated DeltaNet layer (conv + recurrent state) before
  // full and sliding-window attention, shapes as a config.json gives them.
  LayerOptions options;
  options.dtype = DType::F32;
  options.num_kv_heads = 2;
  options.key_dim = 4;
  options.sliding_window = 8;
  options.conv_kernel_size = 4;
  options.conv_channels = {6};
  options.recurrent_shapes = {{2, 4, 4}};  // [heads, k_dim, v_dim]
  Cache cache({"linear_attention", "full_attention", "sliding_attention"}, options);

  // Speculative decoding: keep enough history to reject up to 4 drafts.
  cache.activate_past_recording(4);

  // One forward over q = 5 tokens (pending token + 4 drafts), every layer.
  const std::int64_t q = 5;
  std::vector<float> k(2 * q * 4, 0.5f), v(2 * q * 4, 0.25f), x(6 * q, 1.0f);
  const TensorView keys = TensorView::contiguous(k.data(), DType::F32, {1, 2, q, 4});
  const TensorView values = TensorView::contiguous(v.data(), DType::F32, {1, 2, q, 4});
  const TensorView conv_in = TensorView::contiguous(x.data(), DType::F32, {1, 6, q});
  auto linear_layer = [&](Cache& c) {
    TensorView window = c.update_conv_state(conv_in, 0);    // [1, 6, K-1+q]: the conv's input
    RecurrentUpdate step = c.begin_recurrent_update(q, 0);  // reads S(L) from step.previous()
    for (std::int64_t t = 1; t <= q; ++t) {
      step.next(t).set(static_cast<float>(t), 0, 0, 0, 0);  // the kernel writes S(L+t) in place
    }
    step.commit();
    return window;
  };
  // All or nothing: room for q tokens is reserved in every layer first, and
  // an exception before commit() (or a forgotten commit) restores them all.
  Forward forward = cache.begin_forward(q);
  const TensorView window = linear_layer(cache);
  const MaskSizes mask = cache.get_mask_sizes(q, 1);
  const KeyValueView kv = cache.update(keys, values, 1);  // keys of positions [0, 5)
  cache.update(keys, values, 2);
  forward.commit();

  // The target accepted 1 of the 4 drafts: remove the other 3 everywhere.
  cache.crop(-3);
  std::printf("conv window %lld columns, mask (%lld, %lld), %lld keys; after crop(-3): L = %lld, S(L)[0] = %g\n",
              static_cast<long long>(window.size(2)), static_cast<long long>(mask.kv_length),
              static_cast<long long>(mask.kv_offset), static_cast<long long>(kv.keys.size(2)),
              static_cast<long long>(cache.get_seq_length()), cache.get_recurrent_state(0).get(0, 0, 0, 0));

  // Without recording, a recurrent state cannot be rolled back: rewind
  // refuses (rather than keep rejected tokens folded in) and changes nothing.
  Cache plain({"linear_attention"}, options);
  linear_layer(plain);
  try {
    plain.crop(-1);
  } catch (const RollbackError& e) {
    std::printf("refused: %s\n", e.what());
  }
  return cache.get_seq_length() == 2 && plain.get_seq_length() == 5 ? 0 : 1;
}
