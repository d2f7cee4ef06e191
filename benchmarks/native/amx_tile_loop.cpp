// The AMX 2x2 tile loop of csrc/moe/amx_kernels.inc alone: ns per tile product (one TDPBF16PS or
// TDPBSSD, 16 cycles each at the documented peak), one thread and every core at once, for step
// orders (all loads first / the reordered loads of k_loop), A tiles from an L1- or L2-sized ring,
// B from an L1- or L2-sized ring (bf16 kernels read B in place: 64 KiB a 32-row block of 1024 K),
// A prefetched into L1, C round trips, and the kernels' L2 prefetch of the next block from DRAM
// (prefetcht1, lines per step). Then the scaling of one case with the threads (1 .. every CPU,
// pinned to CPUs 0..n-1, and half the CPUs on the even ones): per-thread time that grows past
// some count is a shared unit (SMT siblings, power). Standalone (no repo code), for AMX hosts;
// built and run by
//
//   python3 benchmarks/kernel.py amx-tile [--json F]
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct alignas(64) Cfg { uint8_t palette = 1, start = 0, res[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static void cfg() { Cfg c; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; } _tile_loadconfig(&c); }

enum Order { kDpOnly, kLoadsFirst, kPipe };
// steps: K steps per C round trip (0: C stays in tiles); abytes / bbytes: size of the A / B ring
// (the streams); pf: prefetch A 2 steps ahead into L1; dram: prefetcht1 lines per step from a
// 64 MiB buffer of this thread's (the next block's weights on their way to L2).
template <bool kInt8>
double run(Order order, int abytes, int bbytes, int steps, bool pf, int dram, long total_steps) {
  cfg();
  std::vector<uint8_t> Abuf(abytes + 4096 * 2), Bbuf(bbytes + 4096), Cbuf(8192 + 128);
  std::vector<uint8_t> Dbuf(dram ? (64 << 20) : 0, 1);  // written: real pages, not the zero page
  size_t doff = 0;
  uint8_t* A = (uint8_t*)(((uintptr_t)Abuf.data() + 63) & ~uintptr_t(63));
  uint8_t* B = (uint8_t*)(((uintptr_t)Bbuf.data() + 63) & ~uintptr_t(63));
  uint8_t* C = (uint8_t*)(((uintptr_t)Cbuf.data() + 63) & ~uintptr_t(63));
  for (int i = 0; i < abytes; ++i) A[i] = kInt8 ? uint8_t(i % 7) : uint8_t(i % 3 == 0 ? 0x3f : 0);
  for (int i = 0; i < bbytes; ++i) B[i] = kInt8 ? uint8_t(i % 5) : uint8_t(i % 3 == 0 ? 0x3f : 0);
  memset(C, 0, 8192);
  const int astep = 2048;  // two A tiles (tokens 0-15, 16-31) per step, contiguous here
  const int nA = abytes / astep, nB = bbytes / 2048;
  auto dp = [&](auto c) {
    constexpr int cc = decltype(c)::value;
    if constexpr (kInt8) {
      if constexpr (cc == 0) _tile_dpbssd(0, 4, 6); else if constexpr (cc == 1) _tile_dpbssd(1, 4, 7);
      else if constexpr (cc == 2) _tile_dpbssd(2, 5, 6); else _tile_dpbssd(3, 5, 7);
    } else {
      if constexpr (cc == 0) _tile_dpbf16ps(0, 4, 6); else if constexpr (cc == 1) _tile_dpbf16ps(1, 4, 7);
      else if constexpr (cc == 2) _tile_dpbf16ps(2, 5, 6); else _tile_dpbf16ps(3, 5, 7);
    }
  };
  using I0 = std::integral_constant<int, 0>; using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>; using I3 = std::integral_constant<int, 3>;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, A, 64); _tile_loadd(5, A + 1024, 64); _tile_loadd(6, B, 128); _tile_loadd(7, B + 64, 128);
  auto t0 = std::chrono::steady_clock::now();
  long s = 0;
  while (s < total_steps) {
    const int n = steps ? steps : 64;
    if (steps) { _tile_loadd(0, C, 128); _tile_loadd(1, C + 64, 128); _tile_loadd(2, C + 2048, 128); _tile_loadd(3, C + 2048 + 64, 128); }
    for (int i = 0; i < n; ++i, ++s) {
      const uint8_t* a = A + size_t(s % nA) * astep;
      const uint8_t* b = B + size_t(s % nB) * 2048;
      for (int l = 0; l < dram; ++l, doff = (doff + 64) % Dbuf.size()) _mm_prefetch((const char*)Dbuf.data() + doff, _MM_HINT_T1);
      if (pf) {
        const uint8_t* ap = A + size_t((s + 2) % nA) * astep;
        for (int l = 0; l < 2048; l += 64) _mm_prefetch((const char*)ap + l, _MM_HINT_T0);
      }
      if (order == kDpOnly) { dp(I0{}); dp(I1{}); dp(I2{}); dp(I3{}); continue; }
      if (order == kLoadsFirst) {
        _tile_loadd(4, a, 64); _tile_loadd(5, a + 1024, 64); _tile_loadd(6, b, 128); _tile_loadd(7, b + 64, 128);
        dp(I0{}); dp(I1{}); dp(I2{}); dp(I3{});
      } else {
        const uint8_t* an = A + size_t((s + 1) % nA) * astep;
        const uint8_t* bn = B + size_t((s + 1) % nB) * 2048;
        dp(I0{}); dp(I2{});
        _tile_loadd(6, bn, 128);
        dp(I1{}); dp(I3{});
        _tile_loadd(4, an, 64); _tile_loadd(5, an + 1024, 64); _tile_loadd(7, bn + 64, 128);
      }
    }
    if (steps) { _tile_stored(0, C, 128); _tile_stored(1, C + 64, 128); _tile_stored(2, C + 2048, 128); _tile_stored(3, C + 2048 + 64, 128); }
  }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return ns / (4.0 * s);  // ns per tile product
}

struct Case { const char* name; Order o; int abytes, bbytes, steps; bool pf; int dram; };

// Mean ns per tile product of n threads at once, thread t pinned to CPU cpu0 + t * cpu_step.
template <bool kInt8>
double on_threads(const Case& c, int n, int cpu0, int cpu_step, long steps) {
  std::vector<double> res(n);
  std::vector<std::thread> th;
  for (int t = 0; t < n; ++t)
    th.emplace_back([&, t] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu0 + t * cpu_step, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      res[t] = run<kInt8>(c.o, c.abytes, c.bbytes, c.steps, c.pf, c.dram, steps);
    });
  for (auto& x : th) x.join();
  double m = 0;
  for (double v : res) m += v;
  return m / n;
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no AMX permission"); return 1; }
  constexpr int L1A = 16384, L2A = 131072, L1B = 16384, L2B = 65536;
  const Case cases[] = {
      {"products only (4 C tiles, no loads)", kDpOnly, L1A, L1B, 0, false, 0},
      {"loads first, A 16 KiB (L1), B 16 KiB (L1), C kept", kLoadsFirst, L1A, L1B, 0, false, 0},
      {"pipe,        A 16 KiB (L1), B 16 KiB (L1), C kept", kPipe, L1A, L1B, 0, false, 0},
      {"loads first, A 128 KiB (L2), B L1, C kept", kLoadsFirst, L2A, L1B, 0, false, 0},
      {"pipe,        A 128 KiB (L2), B L1, C kept", kPipe, L2A, L1B, 0, false, 0},
      {"pipe + A pf, A 128 KiB (L2), B L1, C kept", kPipe, L2A, L1B, 0, true, 0},
      {"pipe,        A L1, B L1, C round trip / 8 steps", kPipe, L1A, L1B, 8, false, 0},
      {"pipe + A pf, A L2, B L1, C round trip / 8 steps", kPipe, L2A, L1B, 8, true, 0},
      {"loads first, A 1 MiB (L2/L3), B L1, C kept", kLoadsFirst, 1 << 20, L1B, 0, false, 0},
      {"loads first, A L2, B 64 KiB (L2), C / 32 steps", kLoadsFirst, L2A, L2B, 32, false, 0},
      {"pipe,        A L2, B 64 KiB (L2), C / 32 steps", kPipe, L2A, L2B, 32, false, 0},
      {"loads first, A L2, B L2, C / 32, DRAM pf 4/step", kLoadsFirst, L2A, L2B, 32, false, 4},
      {"loads first, A L2, B L2, C / 32, DRAM pf 8/step", kLoadsFirst, L2A, L2B, 32, false, 8},
      {"loads first, A L2, B L1, C / 8, DRAM pf 8/step", kLoadsFirst, L2A, L1B, 8, false, 8},
      {"pipe,        A L2, B L1, C / 8, DRAM pf 8/step", kPipe, L2A, L1B, 8, false, 8},
  };
  const long steps = 200000;
  const int threads = std::thread::hardware_concurrency();
  printf("ns per tile product (16 cycles each at peak): 1 thread bf16 | int8 || %d threads bf16 | int8 (mean)\n", threads);
  for (const Case& c : cases)
    printf("%-52s %6.2f %6.2f || %6.2f %6.2f\n", c.name, on_threads<false>(c, 1, 0, 1, steps),
           on_threads<true>(c, 1, 0, 1, steps), on_threads<false>(c, threads, 0, 1, steps),
           on_threads<true>(c, threads, 0, 1, steps));
  // Threads scaling, bf16: products alone and the kernels' shape (A, B in L2, DRAM prefetch).
  printf("bf16 ns per tile product by threads (CPUs 0..n-1; 'even': n on CPUs 0, 2, 4, ...):\n");
  for (int ci : {0, 11}) {
    printf("%-52s", cases[ci].name);
    for (int n = 1; n <= threads; n *= 2) printf("  %d: %6.2f", n, on_threads<false>(cases[ci], n, 0, 1, steps));
    if (threads >= 2) printf("  even %d: %6.2f", threads / 2, on_threads<false>(cases[ci], threads / 2, 0, 2, steps));
    printf("\n");
  }
}
