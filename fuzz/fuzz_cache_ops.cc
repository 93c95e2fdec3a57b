// libFuzzer target: the input bytes are decoded into a sequence of cache
// operations (updates of 1..8 tokens, crops of any n, recording changes,
// batch select / repeat / reorder, reset, memory budgets) on a hybrid cache
// with every layer kind, and after each step the cache is compared with the
// naive replay reference of tests/cache/reference.h: it either matches, or
// the operation threw the error the reference predicts and nothing changed.
// Any mismatch aborts with the operation log.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

class ByteReader {
 public:
  ByteReader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  std::uint8_t next() { return pos_ < size_ ? data_[pos_++] : 0; }
  i64 range(i64 lo, i64 hi) { return lo + static_cast<i64>(next()) % (hi - lo + 1); }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

std::vector<std::pair<LayerKind, LayerOptions>> every_kind(DType dt, bool with_static) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k : {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::ChunkedAttention,
                      LayerKind::LinearAttention, LayerKind::Conv, LayerKind::Hybrid, LayerKind::HybridSliding,
                      LayerKind::SparseAttention, LayerKind::Moe}) {
    LayerOptions o = small_options(k, dt, false, 2);
    if (with_static && (k == LayerKind::SlidingAttention || k == LayerKind::ChunkedAttention)) o.static_capacity = 24;
    spec.push_back({k, o});
  }
  return spec;
}

[[noreturn]] void fail(const std::string& log, const std::string& what) {
  std::fprintf(stderr, "cache/reference mismatch\noperations:%s\n=> %s\n", log.c_str(), what.c_str());
  std::abort();
}

void run(ByteReader& in) {
  const std::uint8_t header = in.next();
  const DType dt = header % 3 == 0 ? DType::F32 : header % 3 == 1 ? DType::F16 : DType::BF16;
  Built b = build_cache(every_kind(dt, (header & 8) != 0));
  std::string log;
  std::uint64_t salt = 0;
  auto check = [&](const std::string& name, auto&& f, const std::vector<Expect>& xs, auto&& apply) {
    log += "\n  " + name;
    Observed before;
    if (!xs.empty()) before = observe(b.cache);
    if (std::string e = expect_any_outcome(f, xs); !e.empty()) fail(log, e);
    if (!xs.empty()) {
      if (std::string e = diff(before, observe(b.cache)); !e.empty()) fail(log, "refused operation changed: " + e);
    } else {
      apply();
    }
    if (std::string e = verify(b.cache, b.ref); !e.empty()) fail(log, e);
  };
  for (int step = 0; step < 64 && !in.empty(); ++step) {
    const std::uint8_t op = in.next() % 10;
    switch (op) {
      case 0:
      case 1:
      case 2: {  // update every layer with q tokens
        const i64 q = in.range(1, 8);
        log += "\n  update(q=" + std::to_string(q) + ")";
        bool refused = false;
        for (int i = 0; i < b.cache.num_layers() && !refused; ++i) {
          RefLayer& rl = b.ref.layers[static_cast<std::size_t>(i)];
          if (rl.stateless()) continue;
          const Expect x = rl.update_expect(q);
          if (x.ok()) continue;
          const StepData st = rl.make_step(q, salt);
          const HostTensor k = rl.kv_input(st, true, false), v = rl.kv_input(st, false, false);
          const Observed before = observe(b.cache);
          if (std::string e = expect_outcome([&] { (void)b.cache.update(k.view(), v.view(), i); }, x); !e.empty())
            fail(log, e);
          if (std::string e = diff(before, observe(b.cache)); !e.empty()) fail(log, "refused update changed: " + e);
          refused = true;
        }
        if (refused) break;
        const UpdateStyle style{(in.next() & 1) != 0, (in.next() & 1) != 0};
        if (std::string e = cache_step(b.cache, b.ref, q, ++salt, style); !e.empty()) fail(log, e);
        if (std::string e = verify(b.cache, b.ref); !e.empty()) fail(log, e);
        break;
      }
      case 3:
      case 4: {  // crop(n), n in [-(L+2), 3]
        const i64 L = b.ref.seq_length();
        const i64 n = -(L + 2) + static_cast<i64>(in.next()) % (L + 6);
        const std::vector<Expect> xs = b.ref.crop_expect(n);
        check("crop(" + std::to_string(n) + ")", [&] { b.cache.crop(n); }, xs, [&] { b.ref.crop(n); });
        break;
      }
      case 5: {
        const i64 R = in.range(0, 9);
        check("activate_past_recording(" + std::to_string(R) + ")", [&] { b.cache.activate_past_recording(R); },
              {}, [&] { b.ref.activate(R); });
        break;
      }
      case 6:
        check("deactivate_past_recording()", [&] { b.cache.deactivate_past_recording(); }, {},
              [&] { b.ref.deactivate(); });
        break;
      case 7: {  // batch select (indices possibly out of range) or reorder
        const i64 B = b.ref.batch();
        std::vector<i64> idx(static_cast<std::size_t>(in.range(1, 3)));
        for (i64& i : idx) i = in.range(-1, B);
        std::vector<Expect> xs;
        if (Expect x = b.ref.select_expect(idx); !x.ok()) xs.push_back(x);
        check("batch_select_indices(" + shape_str(idx) + ")", [&] { b.cache.batch_select_indices(idx); }, xs,
              [&] { b.ref.batch_apply(idx); });
        break;
      }
      case 8: {
        const i64 B = b.ref.batch();
        if (B > 3) break;  // keep batches small
        const i64 r = in.range(1, 2);
        const std::vector<i64> idx = b.ref.repeat_indices(r);
        check("batch_repeat_interleave(" + std::to_string(r) + ")", [&] { b.cache.batch_repeat_interleave(r); },
              {}, [&] { b.ref.batch_apply(idx); });
        break;
      }
      default:
        check("reset()", [&] { b.cache.reset(); }, {}, [&] { b.ref.reset(); });
        break;
    }
  }
}

}  // namespace
}  // namespace rwt

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static rwt::WarningCapture quiet;  // the deprecation warning of positive crops
  rwt::ByteReader in(data, size);
  rwt::run(in);
  return 0;
}
