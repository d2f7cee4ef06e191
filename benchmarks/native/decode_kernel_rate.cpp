// The decode kernels alone (Kernels::gemm of the ISA path, few tokens): GB/s of packed weight
// bytes (scales included) per core, at the expert shapes of the tables, two ways:
//   hot   the same few blocks (a few hundred KiB) again and again: they stay in L2, so the rate is
//         what the kernel computes per second, the ceiling of each core whatever the memory does
//   cold  item after item (item_blocks blocks, as the engine cuts them) through a buffer much
//         larger than the LLC, every core at once: the memory-bound rate, with the view's
//         software prefetch distances (--l1 / --l2 lists: every pair is a row)
// A shape computes fast enough for decode at >= 90% of the host's read bandwidth B over n cores
// only where hot >= 0.9 * B / n per core.
//
// Built against the repo's kernel files with the extension's flags (the timed code is the shipped
// code) and run by `python3 benchmarks/kernel.py kernel-rate` (its --help lists the options); with
// --isa avx512 every kernel build the binary holds (the shipped one and patched copies,
// kernel_variants.h) is a row.
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "decode_bench_common.h"
#include "kernel_variants.h"
#include "moe/pack.h"
#include "moe/packed.h"

using namespace hmoe;

namespace {

void* huge_alloc(size_t bytes) {  // as the engine packs experts (moe_layer.cpp alloc_on_node)
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

// One packed matrix W [N, K] (N = 32 * blocks): weights, then scales (int4: [blocks][G][32]).
struct Packed {
  Format f;
  int N, K, Kp, group, blocks;
  size_t wbytes, sfloats;
  std::vector<uint8_t> w;
  std::vector<float> scale;
};

Packed pack(Format f, int N, int K, int group, std::mt19937& rng) {
  Packed m{f, N, K, K, group, N / kBlockRows, 0, 0, {}, {}};
  m.Kp = f == Format::int4 ? K : round_up(K, 32);
  m.wbytes = size_t(m.blocks) * block_bytes(f, m.Kp);
  m.sfloats = f == Format::int8 ? size_t(N) : f == Format::int4 ? size_t(m.blocks) * (m.Kp / group) * kBlockRows : 0;
  std::vector<float> W(size_t(N) * K);
  std::uniform_real_distribution<float> ud(-0.03f, 0.03f);
  std::minstd_rand fast(rng());  // tens of millions of weights: a cheap generator
  for (float& v : W) v = ud(fast);
  m.w.resize(m.wbytes);
  m.scale.resize(m.sfloats);
  pack_blocks(f, group, W.data(), N, K, m.Kp, 0, m.blocks, m.w.data(), m.sfloats ? m.scale.data() : nullptr, nullptr);
  return m;
}

size_t block_total(const Packed& m) { return m.wbytes / m.blocks + m.sfloats * 4 / m.blocks; }

// Activations of n tokens in the kind the kernel reads (ActView).
struct Acts {
  std::vector<uint16_t> bf16;
  std::vector<int16_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sums;
  ActView view;
};

Acts make_acts(const Kernels& kn, const Packed& m, int n, std::mt19937& rng) {
  Acts a;
  const int ld = m.Kp + 32;
  std::vector<float> x(m.K);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int G = m.f == Format::int4 ? m.Kp / m.group : 0;
  a.bf16.resize(size_t(n) * ld);
  a.q.resize(size_t(n) * ld);
  a.scale.resize(n);
  a.sums.resize(size_t(n) * std::max(G, 1));
  for (int t = 0; t < n; ++t) {
    for (float& v : x) v = nd(rng);
    kn.ops.to_bf16(x.data(), false, m.K, m.Kp, a.bf16.data() + size_t(t) * ld);
    kn.ops.to_i16(x.data(), false, m.K, m.Kp, G ? m.group : 0, a.q.data() + size_t(t) * ld, &a.scale[t],
                  G ? a.sums.data() + size_t(t) * G : nullptr);
  }
  a.view.n = n;
  a.view.ld = ld;
  a.view.bf16 = a.bf16.data();
  a.view.q = a.q.data();
  a.view.qscale = a.scale.data();
  a.view.qsum = G ? a.sums.data() : nullptr;
  return a;
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof(set), &set);
}

struct Case {
  const Kernels* kn;
  const Packed* m;
  int T, l1, l2, item_blocks, reps;
  size_t hot_bytes, cold_bytes;
};

// Per thread: GB/s of weight bytes while it ran (hot: its own copy of a few blocks; cold: its own
// region of copies of the matrix, items of item_blocks blocks one after another).
std::vector<double> run_threads(const Case& c, int threads, bool hot) {
  std::vector<double> gbps(threads);
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      pin(t);
      const Packed& m = *c.m;
      std::mt19937 rng(7 + t);
      Acts a = make_acts(*c.kn, m, c.T, rng);
      const size_t bb = m.wbytes / m.blocks, sb = m.sfloats / m.blocks;  // per block: bytes, scale floats
      const int nb = hot ? std::clamp(int(c.hot_bytes / block_total(m)), 1, m.blocks) : m.blocks;
      // Copies of the matrix's first nb blocks (hot: one; cold: as many as fill cold_bytes), back to back.
      const size_t wbytes = nb * bb, sfloats = nb * sb;
      const size_t copies = hot ? 1 : std::max<size_t>(1, c.cold_bytes / (wbytes + sfloats * 4));
      uint8_t* w = static_cast<uint8_t*>(huge_alloc(copies * wbytes));
      float* s = sfloats ? static_cast<float*>(huge_alloc(copies * sfloats * 4)) : nullptr;
      for (size_t k = 0; k < copies; ++k) {
        std::memcpy(w + k * wbytes, m.w.data(), wbytes);
        if (s) std::memcpy(s + k * sfloats, m.scale.data(), sfloats * 4);
      }
      const int ldo = m.blocks * kBlockRows + 16;
      std::vector<float> out(size_t(c.T) * ldo);
      auto pass = [&] {  // one pass over the thread's blocks; its bytes
        size_t bytes = 0;
        for (size_t k = 0; k < copies; ++k) {
          PackedView v;
          v.w = w + k * wbytes;
          v.scale = s ? s + k * sfloats : nullptr;
          v.Kp = m.Kp;
          v.group = m.group;
          v.prefetch_l1 = c.l1;
          v.prefetch_l2 = c.l2;
          const int step = hot ? nb : c.item_blocks;
          for (int b = 0; b < nb; b += step) {
            const int e = std::min(nb, b + step);
            c.kn->gemm[int(m.f)](v, b, e, a.view, out.data() + size_t(b) * kBlockRows, ldo);
            bytes += size_t(e - b) * (bb + sb * 4);
          }
        }
        return bytes;
      };
      pass();  // warm-up: pages touched, hot blocks in cache
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      // Passes for at least this long per rep: every thread keeps reading while the others time.
      const double min_s = hot ? 0.05 : 0.03;
      double best = 0;
      for (int r = 0; r < c.reps; ++r) {
        size_t bytes = 0;
        const double t0 = now_s();
        do bytes += pass();
        while (now_s() - t0 < min_s);
        best = std::max(best, bytes / (now_s() - t0) / 1e9);
      }
      gbps[t] = best;
      munmap(w, copies * wbytes);
      if (s) munmap(s, copies * sfloats * 4);
    });
  for (auto& th : pool) th.join();
  return gbps;
}

// (name, kernels) of --isa: each AVX-512 build named in `names` (empty: all), or the one portable set.
std::vector<std::pair<std::string, const Kernels*>> kernel_sets(const std::string& isa, const std::string& names) {
  if (isa == "generic") return {{"generic", &kernels_generic()}};
  if (isa == "avx2") return {{"avx2", &kernels_avx2()}};
  std::vector<std::pair<std::string, const Kernels*>> out;
  for (const KernelVariant& v : kernel_variants())
    if (variant_chosen(v.name, names)) out.emplace_back(v.name, &v.kernels());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const char *threads_s = "1", *isa = "avx512", *tokens_s = "1,4", *formats_s = "int4,int8,bf16",
             *shapes_s = "deepseek-v3,qwen3-30b-a3b", *l1_s = "4096", *l2_s = "16384", *modes_s = "hot,cold",
             *variants_s = "";
  int cold_mib = 256, hot_kib = 384, item_blocks = 8, reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--threads") threads_s = v;
    else if (k == "--isa") isa = v;
    else if (k == "--tokens") tokens_s = v;
    else if (k == "--formats") formats_s = v;
    else if (k == "--shapes") shapes_s = v;
    else if (k == "--l1") l1_s = v;
    else if (k == "--l2") l2_s = v;
    else if (k == "--modes") modes_s = v;
    else if (k == "--variants") variants_s = v;
    else if (k == "--cold-mib") cold_mib = std::atoi(v);
    else if (k == "--hot-kib") hot_kib = std::atoi(v);
    else if (k == "--item-blocks") item_blocks = std::atoi(v);
    else if (k == "--reps") reps = std::atoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  const auto sets = kernel_sets(isa, variants_s);
  std::mt19937 rng(1);
  std::printf("# decode kernels (%s), GB/s of packed weights per core: hot %d KiB per core in cache; cold %d MiB per "
              "core, items of %d blocks\n", isa, hot_kib, cold_mib, item_blocks);
  std::printf("%-14s %-5s %-4s %2s %-4s %3s %6s %6s %-10s | %7s %7s %7s %8s\n", "shape", "mat", "fmt", "T", "mode",
              "thr", "l1", "l2", "kernels", "median", "min", "max", "sum");
  for (const std::string& sname : str_list(shapes_s)) {
    const DecodeShape* sh = find_decode_shape(sname);
    if (!sh) {
      std::fprintf(stderr, "unknown shape %s\n", sname.c_str());
      return 2;
    }
    for (const std::string& fname : str_list(formats_s)) {
      const Format f = fname == "int4" ? Format::int4 : fname == "int8" ? Format::int8 : Format::bf16;
      // gate (up the same) [I, H] and down [H, I]
      const Packed mats[2] = {pack(f, sh->I, sh->H, 128, rng), pack(f, sh->H, sh->I, 128, rng)};
      for (int mi = 0; mi < 2; ++mi)
        for (int T : int_list(tokens_s))
          for (const std::string& mode : str_list(modes_s))
            for (int threads : int_list(threads_s))
              for (int l1 : int_list(l1_s))
                for (int l2 : int_list(l2_s))
                  for (const auto& [kname, kn] : sets) {
                    const Case c{kn, &mats[mi], T, l1, l2, item_blocks, reps, size_t(hot_kib) << 10,
                                 size_t(cold_mib) << 20};
                    std::vector<double> g = run_threads(c, threads, mode == "hot");
                    double sum = 0;
                    for (double v : g) sum += v;
                    std::sort(g.begin(), g.end());
                    std::printf("%-14s %-5s %-4s %2d %-4s %3d %6d %6d %-10s | %7.1f %7.1f %7.1f %8.1f\n", sh->name,
                                mi ? "down" : "gate", fname.c_str(), T, mode.c_str(), threads, l1, l2, kname.c_str(),
                                g[g.size() / 2], g.front(), g.back(), sum);
                    std::fflush(stdout);
                  }
    }
  }
  return 0;
}
