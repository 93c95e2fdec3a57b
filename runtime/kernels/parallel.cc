// runtime/kernels/parallel.cc: the thread pool behind detail::parallel_for
// (internal.h).
//
// Why not an OpenMP `parallel for`: its team ends in a barrier that waits for
// every thread of the team, including one the OS has descheduled before it
// took any work. On a busy machine that made each of a forward's dozens of
// short kernels wait for a time slice: the shipped target decoded at 87-406
// tok/s with two threads against 6,500 with one (docs/performance.md).
// Here the calling thread takes indices from a shared counter like the
// helpers do, and waits only for indices a helper has already taken: a
// helper that has not woken up yet finds nothing left and costs nothing.
//
// Lifetime without locks or allocation: a job lives in one of kSlots slots.
// A helper pins a slot (users > 0) before it reads the job, and checks the
// slot still holds the job it was told of; a caller takes a slot only while
// nobody pins it (users 0 -> kOwned), so it never waits for a straggler and
// a straggler never reads a reused slot. A helper calls the job's function
// only for an index it took, and the caller returns only after every index
// is done, so the caller's lambda outlives every call to it.
#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cstdint>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include "parallel.h"

namespace rwd::runtime::kernels::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How long an idle helper, or a caller waiting for a helper's last index,
// spins before it sleeps in the kernel. Long enough to span the gap between
// the kernels of one forward (so a decode keeps its helpers awake), short
// enough that an idle process does not hold a core.
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr int kSlots = 8;
constexpr int kMaxHelpers = 255;
constexpr int kOwned = -(1 << 30);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until pred() or kSpin has passed; returns pred().
template <class P>
bool spin_until(P pred) {
  const auto until = Clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return true;
      cpu_relax();
    }
    if (Clock::now() >= until) return pred();
  }
}

struct Slot {
  std::atomic<int> users{0};
  std::atomic<std::uint64_t> seq{0};
  // Written only while the slot is owned (users < 0), read by helpers that
  // pinned it after seeing `seq`.
  ParallelTask task = nullptr;
  void* ctx = nullptr;
  std::int64_t n = 0;
  int helpers_allowed = 0;
  std::atomic<int> helpers{0};
  std::atomic<std::int64_t> next{0};
  std::atomic<std::int64_t> done{0};
  std::atomic<std::uint32_t> finished{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
};

// Set on pool threads and while a caller runs its own job: a parallel_for
// inside a body runs on that thread alone.
thread_local bool t_inside = false;

class Pool {
 public:
  void run(std::int64_t n, int threads, ParallelTask task, void* ctx);

  Pool* inherited = nullptr;  // the parent process's pool, after a fork

 private:
  Slot& acquire_slot();
  void grow(int helpers);
  void helper_main(std::uint32_t seen);
  static void work(Slot& s);

  Slot slots_[kSlots];
  std::atomic<int> next_slot_{0};  // where callers start looking: a hint only
  // (slot index + 1) | seq << 8 of the newest job; 0 for none.
  std::atomic<std::uint64_t> current_{0};
  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> helpers_{0};
  std::mutex grow_mutex_;
  std::atomic<std::uint64_t> seq_{0};
};

Pool* g_pool = nullptr;
std::once_flag g_pool_once;

// A forked child has none of the parent's pool threads; it starts a fresh
// pool. The parent's stays reachable from it (never used again), so that
// leak checkers in the child see nothing lost.
void after_fork_in_child() {
  Pool* fresh = new Pool;
  fresh->inherited = g_pool;
  g_pool = fresh;
}

Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool = new Pool;  // never destroyed: helpers may still spin at exit
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
  });
  return *g_pool;
}

void Pool::work(Slot& s) {
  for (;;) {
    const std::int64_t i = s.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= s.n) return;
    try {
      s.task(s.ctx, i);
    } catch (...) {
      if (!s.failed.exchange(true, std::memory_order_relaxed)) s.error = std::current_exception();
    }
    if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == s.n) {
      s.finished.store(1, std::memory_order_release);
      s.finished.notify_all();
    }
  }
}

Slot& Pool::acquire_slot() {
  const int start = next_slot_.load(std::memory_order_relaxed);
  for (int k = 0;; ++k) {
    const int index = (start + k) % kSlots;
    Slot& s = slots_[index];
    int expected = 0;
    if (s.users.compare_exchange_strong(expected, kOwned, std::memory_order_acq_rel)) {
      next_slot_.store((index + 1) % kSlots, std::memory_order_relaxed);
      return s;
    }
    // Every slot pinned by a straggler or owned by another caller: rare
    // (kSlots of them at once); let them move on.
    if (k % kSlots == kSlots - 1) std::this_thread::yield();
  }
}

void Pool::grow(int helpers) {
  std::lock_guard<std::mutex> lock(grow_mutex_);
  for (int h = helpers_.load(std::memory_order_relaxed); h < helpers; ++h) {
    // The epoch before this caller publishes its job, so that the new
    // thread takes part in it.
    std::thread(&Pool::helper_main, this, epoch_.load(std::memory_order_acquire)).detach();
    helpers_.store(h + 1, std::memory_order_release);
  }
}

void Pool::helper_main(std::uint32_t seen) {
  t_inside = true;
  for (;;) {
    if (!spin_until([&] { return epoch_.load(std::memory_order_acquire) != seen; })) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      while (epoch_.load(std::memory_order_seq_cst) == seen) epoch_.wait(seen, std::memory_order_seq_cst);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = epoch_.load(std::memory_order_acquire);
    const std::uint64_t cur = current_.load(std::memory_order_acquire);
    if (cur == 0) continue;
    Slot& s = slots_[(cur & 0xff) - 1];
    if (s.users.fetch_add(1, std::memory_order_acq_rel) >= 0) {
      if (s.seq.load(std::memory_order_acquire) == cur >> 8 &&
          s.helpers.fetch_add(1, std::memory_order_relaxed) < s.helpers_allowed) {
        work(s);
      }
    }
    s.users.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void Pool::run(std::int64_t n, int threads, ParallelTask task, void* ctx) {
  const int helpers = std::min(threads - 1, kMaxHelpers);
  if (helpers_.load(std::memory_order_acquire) < helpers) grow(helpers);
  Slot& s = acquire_slot();
  s.task = task;
  s.ctx = ctx;
  s.n = n;
  s.helpers_allowed = helpers;
  s.helpers.store(0, std::memory_order_relaxed);
  s.next.store(0, std::memory_order_relaxed);
  s.done.store(0, std::memory_order_relaxed);
  s.finished.store(0, std::memory_order_relaxed);
  s.failed.store(false, std::memory_order_relaxed);
  s.error = nullptr;
  const std::uint64_t seq = seq_.fetch_add(1, std::memory_order_relaxed) + 1;
  s.seq.store(seq, std::memory_order_release);
  // Unowned from here, but pinned by the caller itself until it has read the
  // result, so that no other caller takes the slot before then.
  s.users.fetch_sub(kOwned - 1, std::memory_order_acq_rel);
  current_.store(static_cast<std::uint64_t>(&s - slots_ + 1) | seq << 8, std::memory_order_release);
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) epoch_.notify_all();

  t_inside = true;
  work(s);
  t_inside = false;
  if (s.done.load(std::memory_order_acquire) != n &&
      !spin_until([&] { return s.done.load(std::memory_order_acquire) == n; })) {
    while (s.finished.load(std::memory_order_acquire) == 0) s.finished.wait(0, std::memory_order_acquire);
  }
  std::exception_ptr error;
  // Every index is done, so no helper writes the error any more.
  if (s.failed.load(std::memory_order_relaxed)) error = std::exchange(s.error, nullptr);
  s.users.fetch_sub(1, std::memory_order_acq_rel);
  if (error) std::rethrow_exception(error);
}

}  // namespace

int max_threads() {
  // More threads than CPUs this process may run on cannot speed up a kernel,
  // and a spinning helper would then take time from the calling thread.
  static const int cpus = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
    return std::max(1, CPU_COUNT(&set));
  }();
  return std::min(omp_get_max_threads(), cpus);
}

void run_parallel(std::int64_t n, int threads, ParallelTask task, void* ctx) {
  assert(n <= std::numeric_limits<std::int64_t>::max() - kMaxHelpers - 1);
  if (n <= 0) return;
  if (threads <= 1 || n == 1 || t_inside) {
    for (std::int64_t i = 0; i < n; ++i) task(ctx, i);
    return;
  }
  pool().run(n, threads, task, ctx);
}

}  // namespace rwd::runtime::kernels::detail
