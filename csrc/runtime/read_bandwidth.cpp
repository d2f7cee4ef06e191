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
// of dependent ops) and returns the folded 64-bit result.
__attribute__((target("avx512f"))) uint64_t read_avx512(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 256) {
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

Reader best_reader() {
  const auto& f = cpu_features();
  if (f.avx512f) return read_avx512;
  if (f.avx2) return read_avx2;
  return read_generic;
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

}  // namespace

const char* read_bandwidth_isa() {
  const Reader r = best_reader();
  return r == read_avx512 ? "avx512" : r == read_avx2 ? "avx2" : "generic";
}

double read_bandwidth(size_t nbytes, int threads, int passes, int rounds) {
  if (nbytes == 0 || threads < 1 || passes < 1 || rounds < 1)
    throw std::invalid_argument("read_bandwidth needs nbytes, threads, passes and rounds of at least 1");
  const size_t blocks = (nbytes + kBlock - 1) / kBlock;
  const size_t bytes = blocks * kBlock;
  std::unique_ptr<uint8_t, FreeDeleter> buf(static_cast<uint8_t*>(std::aligned_alloc(kAlign, bytes)));
  if (!buf) throw std::bad_alloc();
  madvise(buf.get(), bytes, MADV_HUGEPAGE);  // a hint: fewer TLB misses where THP is on "madvise"
  uint8_t* data = buf.get();

  auto pool = shared_pool(threads, 1);
  const Reader reader = best_reader();
  // one sink line per worker: no two workers write the same cache line
  std::vector<uint64_t> sinks(size_t(pool->threads()) * 8, 0);
  auto pass = [&](bool fill) {
    pool->run_here([&] {
      pool->run(int(blocks), [&](int block, int worker) {
        uint8_t* p = data + size_t(block) * kBlock;
        // first touch by the pool's own (pinned) workers, with bytes that are not the zero page
        if (fill) std::memset(p, 1 + block % 251, kBlock);
        sinks[size_t(worker) * 8] ^= reader(p, kBlock);
      });
    });
  };
  pass(true);
  double best = 0;
  std::vector<double> seconds(passes);
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < passes; ++i) {
      const auto start = std::chrono::steady_clock::now();
      pass(false);
      seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    std::nth_element(seconds.begin(), seconds.begin() + passes / 2, seconds.end());
    best = std::max(best, double(bytes) / seconds[passes / 2]);
  }
  uint64_t all = 0;
  for (size_t w = 0; w < sinks.size(); w += 8) all ^= sinks[w];
  g_sink = all;
  return best;
}

}  // namespace hmoe
