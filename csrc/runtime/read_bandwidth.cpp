#include "runtime/read_bandwidth.h"

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "runtime/cpu_features.h"
#include "runtime/thread_pool.h"

namespace hmoe {
namespace {

constexpr size_t kBlock = size_t(1) << 20;      // bytes a worker claims at a time
constexpr size_t kAlign = size_t(2) << 20;      // buffer alignment: lets the kernel back it with huge pages
volatile uint64_t g_sink;                        // the XOR of everything read, so no load is optimized away

// Each reader XORs one block into four independent accumulators (loads in flight, not a chain
// of dependent ops) and returns the folded 64-bit result. Prefetch: software prefetches ahead of
// the loads, as the decode kernels issue them (L1 4 KiB ahead, L2 16 KiB ahead): more bytes in
// flight per core than the hardware prefetchers keep. A template argument, so the plain reader's
// loop has no prefetch (nor any test for one) in it.
template <bool Prefetch>
__attribute__((target("avx512f"))) uint64_t read_avx512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 256) {
    if constexpr (Prefetch) {
      for (int l = 0; l < 256; l += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p + i + l) + 4096, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + i + l) + 16384, _MM_HINT_T1);
      }
    }
    a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t r = 0;
  for (uint64_t v : lanes) r ^= v;
  return r;
}

__attribute__((target("avx2"))) uint64_t read_avx2(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}

uint64_t read_generic(const uint8_t* p, size_t n) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (size_t i = 0; i < n / 8; i += 4) {
    a0 ^= w[i];
    a1 ^= w[i + 1];
    a2 ^= w[i + 2];
    a3 ^= w[i + 3];
  }
  return a0 ^ a1 ^ a2 ^ a3;
}

using Reader = uint64_t (*)(const uint8_t*, size_t);

Reader best_reader(bool prefetch) {
  const auto& f = cpu_features();
  if (f.avx512f) return prefetch ? read_avx512<true> : read_avx512<false>;
  if (f.avx2) return read_avx2;
  return read_generic;
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

}  // namespace

const char* read_bandwidth_isa() {
  const Reader r = best_reader(false);
  return r == read_avx512<false> ? "avx512" : r == read_avx2 ? "avx2" : "generic";
}

namespace {

// One buffer of whole blocks, first touched by the pool's own (pinned) workers, and the passes
// that read it; pass() optionally adds each worker's bytes and nanoseconds inside the reader.
class Probe {
 public:
  Probe(size_t nbytes, int threads, bool prefetch)
      : blocks_((nbytes + kBlock - 1) / kBlock),
        buf_(static_cast<uint8_t*>(std::aligned_alloc(kAlign, blocks_ * kBlock))),
        pool_(shared_pool(threads, 1)),
        reader_(best_reader(prefetch)),
        sinks_(size_t(pool_->slots()) * 8, 0) {  // one sink line per worker: none shared
    if (!buf_) throw std::bad_alloc();
    madvise(buf_.get(), bytes(), MADV_HUGEPAGE);  // a hint: fewer TLB misses where THP is on "madvise"
    pass(true, nullptr, nullptr);
  }
  ~Probe() {
    uint64_t all = 0;
    for (size_t w = 0; w < sinks_.size(); w += 8) all ^= sinks_[w];
    g_sink = all;
  }
  size_t bytes() const { return blocks_ * kBlock; }
  int threads() const { return pool_->threads(); }
  int slots() const { return pool_->slots(); }

  // Seconds of one pass over the buffer (fill: first touch, with bytes that are not the zero page).
  double pass(bool fill, uint64_t* worker_bytes, int64_t* worker_ns) {
    uint8_t* data = buf_.get();
    const auto start = std::chrono::steady_clock::now();
    pool_->run_here([&] {
      pool_->run(int(blocks_), [&](int block, int worker) {
        uint8_t* p = data + size_t(block) * kBlock;
        if (fill) std::memset(p, 1 + block % 251, kBlock);
        const auto t0 = std::chrono::steady_clock::now();
        sinks_[size_t(worker) * 8] ^= reader_(p, kBlock);
        if (worker_bytes) {
          worker_ns[worker] += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - t0).count();
          worker_bytes[worker] += kBlock;
        }
      });
    });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

 private:
  size_t blocks_;
  std::unique_ptr<uint8_t, FreeDeleter> buf_;
  std::shared_ptr<ThreadPool> pool_;
  Reader reader_;
  std::vector<uint64_t> sinks_;
};

void check_args(size_t nbytes, int threads, int passes, int rounds) {
  if (nbytes == 0 || threads < 1 || passes < 1 || rounds < 1)
    throw std::invalid_argument("read_bandwidth needs nbytes, threads, passes and rounds of at least 1");
}

}  // namespace

double read_bandwidth(size_t nbytes, int threads, int passes, int rounds, bool prefetch) {
  check_args(nbytes, threads, passes, rounds);
  Probe probe(nbytes, threads, prefetch);
  double best = 0;
  std::vector<double> seconds(passes);
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < passes; ++i) seconds[i] = probe.pass(false, nullptr, nullptr);
    std::nth_element(seconds.begin(), seconds.begin() + passes / 2, seconds.end());
    best = std::max(best, double(probe.bytes()) / seconds[passes / 2]);
  }
  return best;
}

std::vector<double> read_bandwidth_by_worker(size_t nbytes, int threads, int passes) {
  check_args(nbytes, threads, passes, 1);
  Probe probe(nbytes, threads, false);
  std::vector<uint64_t> bytes(probe.slots(), 0);  // (a helping guest's share is left out of the rates)
  std::vector<int64_t> ns(probe.slots(), 0);
  for (int i = 0; i < passes; ++i) probe.pass(false, bytes.data(), ns.data());
  std::vector<double> out(probe.threads(), 0.0);
  for (int w = 0; w < probe.threads(); ++w)
    if (ns[w] > 0) out[w] = double(bytes[w]) / (double(ns[w]) * 1e-9);
  return out;
}

}  // namespace hmoe
