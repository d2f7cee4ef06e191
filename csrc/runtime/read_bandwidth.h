#pragma once
// Host memory read bandwidth, measured the way the expert kernels read weights: the engine's
// pinned thread pool streams one buffer much larger than the last-level cache with the widest
// loads this CPU has (AVX-512, else AVX2, else 64-bit words), claiming 1 MiB blocks one at a time.
#include <cstddef>
#include <vector>

namespace hmoe {

// Bytes/s reading nbytes on `threads` pool threads: `rounds` rounds of `passes` timed passes
// (after one untimed pass that touches every page and wakes the pool); each round's median pass
// time, and the best round. nbytes is rounded up to whole 1 MiB blocks. prefetch: AVX-512 loads
// with the decode kernels' software prefetches ahead of them (plain loads elsewhere).
double read_bandwidth(size_t nbytes, int threads, int passes, int rounds, bool prefetch = false);

// Bytes/s of each pool worker while it reads (its bytes over its time inside the reader), over
// `passes` passes of all `threads` threads at once: which cores stream slower than the others.
std::vector<double> read_bandwidth_by_worker(size_t nbytes, int threads, int passes);

// The load width read_bandwidth uses on this CPU: "avx512", "avx2" or "generic".
const char* read_bandwidth_isa();

}  // namespace hmoe
