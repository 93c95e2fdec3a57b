// runtime/kernels/parallel.h: the threads kernels run on (not installed;
// kernels use it through internal.h's parallel_for).
#pragma once

#include <cstdint>

namespace rwd::runtime::kernels::detail {

// The thread count kernels use: OpenMP's setting for the calling thread
// (OMP_NUM_THREADS, omp_set_num_threads), at most the CPUs this process may
// run on.
int max_threads();

using ParallelTask = void (*)(void* ctx, std::int64_t i);

// Runs task(ctx, i) once for every i in [0, n) on the calling thread and up
// to threads - 1 pool threads (parallel.cc), and returns when all are done;
// rethrows the first exception a call threw, after every call has finished.
// The calling thread takes indices like the pool threads, so a pool thread
// that is slow to wake delays nothing it has not started. Inside a task, and
// for threads <= 1, everything runs on the calling thread.
// REQUIRES: n <= INT64_MAX - 256 (each thread counts one past n when done).
void run_parallel(std::int64_t n, int threads, ParallelTask task, void* ctx);

}  // namespace rwd::runtime::kernels::detail
