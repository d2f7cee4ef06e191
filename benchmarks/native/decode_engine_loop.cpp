// The decode loop of `kernel.py moe-layer --gap-us` in C++: layers of packed experts called in turn
// with T tokens, a gap of busy work between calls, ms per call and GB/s of the experts each call
// reads, beside the host read probe: the engine's own time (no Python). Every kernel build the
// binary holds (the shipped kernels and patched copies, kernel_variants.h) and every combination of
// the runtime knobs (--l1/--l2 prefetch distances, --item-blocks, --item-prefetch) is a row,
// interleaved round by round over the same packed weights (each build's layers adopt the same
// buffers). Built and run by `python3 benchmarks/kernel.py engine-loop` (its --help lists the options).
//
// Each layer's experts are copies of one packed random expert (the kernels' time does not depend
// on the values); every call routes each token to K distinct random experts, 16 routings cycled.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "decode_bench_common.h"
#include "kernel_variants.h"
#include "moe/moe_layer.h"
#include "runtime/read_bandwidth.h"

using namespace hmoe;

namespace {

void busy_wait(double s) {
  for (const double end = now_s() + s; now_s() < end;) {
  }
}

// memcpy on several threads (filling GBs of expert copies).
void parallel_copy(uint8_t* dst, const uint8_t* src, size_t bytes, int threads) {
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([=] {
      const size_t a = bytes * t / threads, b = bytes * (t + 1) / threads;
      std::memcpy(dst + a, src + a, b - a);
    });
  for (auto& t : ts) t.join();
}

// v[i] uniform in [-a, a) (a counter hash: fast, for the tens of millions of weights of a DSV3 expert).
void uniform_fill(std::vector<float>& v, float a, uint64_t seed) {
  for (size_t i = 0; i < v.size(); ++i) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
    v[i] = a * (float(z >> 40) / float(1 << 23) - 1.f);
  }
}

// Layers whose E experts are all copies of one packed random expert.
std::vector<std::unique_ptr<MoeLayer>> make_layers(const MoeConfig& cfg, int layers) {
  std::vector<std::unique_ptr<MoeLayer>> out;
  std::vector<float> gate(size_t(cfg.I) * cfg.H), up(gate.size()), down(size_t(cfg.H) * cfg.I);
  uniform_fill(gate, 1.f / std::sqrt(float(cfg.H)), 1);
  uniform_fill(up, 1.f / std::sqrt(float(cfg.H)), 2);
  uniform_fill(down, 1.f / std::sqrt(float(cfg.I)), 3);
  for (int l = 0; l < layers; ++l) {
    out.push_back(std::make_unique<MoeLayer>(cfg, false));
    MoeLayer& layer = *out.back();
    if (l == 0) {
      layer.pack_expert(0, gate.data(), up.data(), down.data());
      for (const PackedBuffer& b : layer.buffers()) {  // expert e's part of a buffer: the e-th of E
        const size_t per = b.bytes / cfg.E;
        auto* p = static_cast<uint8_t*>(b.data);
        for (int e = 1; e < cfg.E; e *= 2)  // experts [0, e) -> [e, 2e): doubling, each copy on every thread
          parallel_copy(p + e * per, p, std::min(e, cfg.E - e) * per, cfg.threads);
      }
    } else {
      const auto src = out[0]->buffers(), dst = layer.buffers();
      for (size_t i = 0; i < src.size(); ++i)
        parallel_copy(static_cast<uint8_t*>(dst[i].data), static_cast<const uint8_t*>(src[i].data), src[i].bytes,
                      cfg.threads);
    }
  }
  return out;
}

// A layer over src's packed buffers, running the kernel build selected now.
std::unique_ptr<MoeLayer> adopting(const MoeLayer& src) {
  auto l = std::make_unique<MoeLayer>(src.config(), true);
  for (const PackedBuffer& b : src.buffers()) l->set_buffer(b.name, b.data, b.bytes);
  return l;
}

struct Routing {
  std::vector<uint16_t> x;  // [T, H] bf16
  std::vector<int32_t> ids;
  std::vector<float> w;
  int experts;  // distinct experts touched
};

Routing make_routing(int T, const DecodeShape& s, int E, std::mt19937& rng) {
  Routing r;
  std::normal_distribution<float> nd(0.f, 1.f);
  r.x.resize(size_t(T) * s.H);
  for (auto& v : r.x) v = f32_to_bf16(nd(rng));
  std::vector<int> perm(E), used(E, 0);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < s.K; ++k) {
      r.ids.push_back(perm[k]);
      r.w.push_back(1.f / s.K);
      used[perm[k]] = 1;
    }
  }
  r.experts = int(std::count(used.begin(), used.end(), 1));
  return r;
}

// ms and GB/s of each of `calls` calls, after one warm-up cycle over the layers: layer c % L,
// routing c % 16, a busy gap before each.
void timed_calls(std::vector<std::unique_ptr<MoeLayer>>& layers, const std::vector<Routing>& routings, const DecodeShape& sh,
                 int calls, double gap_s, double per_expert, uint16_t* out, std::vector<double>& ms,
                 std::vector<double>& gbps) {
  const int L = int(layers.size());
  for (int c = -L; c < calls; ++c) {
    const Routing& r = routings[(c + L) % routings.size()];
    MoeCall call;
    call.x = r.x.data();
    call.x_bf16 = true;
    call.T = int(r.x.size() / sh.H);
    call.K = sh.K;
    call.ids = r.ids.data();
    call.weights = r.w.data();
    call.out = out;
    busy_wait(gap_s);
    const double a = now_s();
    layers[(c + L) % L]->run(call);
    const double s = now_s() - a;
    if (c < 0) continue;
    ms.push_back(s * 1e3);
    gbps.push_back(r.experts * per_expert / s / 1e9);
  }
}

struct Knobs {
  int l1, l2, item_blocks, item_prefetch;
};

}  // namespace

int main(int argc, char** argv) {
  std::string shape_s = "deepseek-v3", formats_s = "int4,int8,bf16", tokens_s = "1,4", l1_s = "4096", l2_s = "16384",
              ib_s = "0", ipf_s = "4096", variants_s;
  int threads = int(std::thread::hardware_concurrency()) - 1, experts = 32, layers = 3, calls = 120, rounds = 2,
      probe_on = 1;
  double gap_us = 100;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--shape") shape_s = v;
    else if (k == "--formats") formats_s = v;
    else if (k == "--tokens") tokens_s = v;
    else if (k == "--threads") threads = std::atoi(v.c_str());
    else if (k == "--experts") experts = std::atoi(v.c_str());
    else if (k == "--layers") layers = std::atoi(v.c_str());
    else if (k == "--calls") calls = std::atoi(v.c_str());
    else if (k == "--rounds") rounds = std::atoi(v.c_str());
    else if (k == "--probe") probe_on = std::atoi(v.c_str());
    else if (k == "--gap-us") gap_us = std::atof(v.c_str());
    else if (k == "--l1") l1_s = v;
    else if (k == "--l2") l2_s = v;
    else if (k == "--item-blocks") ib_s = v;
    else if (k == "--item-prefetch") ipf_s = v;
    else if (k == "--variants") variants_s = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  const DecodeShape* sh = find_decode_shape(shape_s);
  if (!sh) {
    std::fprintf(stderr, "unknown shape %s\n", shape_s.c_str());
    return 2;
  }
  std::vector<int> variants;  // indices into kernel_variants()
  for (size_t i = 0; i < kernel_variants().size(); ++i)
    if (variant_chosen(kernel_variants()[i].name, variants_s)) variants.push_back(int(i));
  std::vector<Knobs> knobs;
  for (int l1 : int_list(l1_s))
    for (int l2 : int_list(l2_s))
      for (int ib : int_list(ib_s))
        for (int ipf : int_list(ipf_s)) knobs.push_back({l1, l2, ib, ipf});
  // The host read probe (nan with --probe 0: runs that compare builds can probe once, not per build).
  const double probe = probe_on ? read_bandwidth(size_t(2) << 30, threads, 5, 3) / 1e9 : NAN;
  const double probe_pf = probe_on ? read_bandwidth(size_t(2) << 30, threads, 5, 3, true) / 1e9 : NAN;
  std::printf("# %s: E=%d (of %d) H=%d I=%d top-%d, %d layers, %d threads, gap %g us; host read %.1f GB/s (plain), "
              "%.1f (with the kernels' prefetches)\n", sh->name, experts, sh->E, sh->H, sh->I, sh->K, layers, threads,
              gap_us, probe, probe_pf);
  std::printf("%-5s %2s %-10s %5s %6s %3s %6s %5s | %8s %8s %7s %5s %5s\n", "fmt", "T", "kernels", "l1", "l2", "ib",
              "ipf", "round", "ms", "p90 ms", "GB/s", "%bw", "%pf");
  std::fflush(stdout);
  for (const std::string& fname : str_list(formats_s)) {
    MoeConfig cfg;
    cfg.E = experts;
    cfg.H = sh->H;
    cfg.I = sh->I;
    cfg.format = fname == "int4" ? Format::int4 : fname == "int8" ? Format::int8 : Format::bf16;
    cfg.threads = threads;
    cfg.isa = Isa::avx512;
    const double t0 = now_s();
    auto ls = make_layers(cfg, layers);
    size_t layer_bytes = 0;
    for (const PackedBuffer& b : ls[0]->buffers()) layer_bytes += b.bytes;
    const double per_expert = double(layer_bytes) / experts;
    std::printf("# %s: %d layers packed and copied in %.1f s, %.1f MB per expert\n", fname.c_str(), layers,
                now_s() - t0, per_expert / 1e6);
    for (int T : int_list(tokens_s)) {
      std::mt19937 rng(1000 + T);
      std::vector<Routing> routings;
      for (int r = 0; r < 16; ++r) routings.push_back(make_routing(T, *sh, experts, rng));
      // Weights read by the other layers between two calls of one layer: below the LLC, part of a
      // layer's experts can still be cached when it is called again, so the rows are not DRAM-bound.
      double call_bytes = 0;
      for (const Routing& r : routings) call_bytes += r.experts * per_expert / routings.size();
      std::printf("# %s T=%d: %.0f MB per call, %.0f MB read by the other layers between a layer's calls\n",
                  fname.c_str(), T, call_bytes / 1e6, (layers - 1) * call_bytes / 1e6);
      std::vector<uint16_t> out(size_t(T) * sh->H);
      // Rows: (knobs, build) pairs. Each round runs them all, starting one row later than the round
      // before (no row always first after the warm-up); one untimed pass of the first row warms up
      // (the pool learns the gap, the routings' activations are made).
      std::vector<std::pair<Knobs, int>> rows;
      for (const Knobs& kn : knobs)
        for (int vi : variants) rows.emplace_back(kn, vi);
      for (int pass = -1; pass < rounds * int(rows.size()); ++pass) {
        const int round = std::max(pass, 0) / int(rows.size());
        const auto& [kn, vi] = rows[pass < 0 ? 0 : (pass + round) % rows.size()];
        select_kernel_variant(vi);
        std::vector<std::unique_ptr<MoeLayer>> vl;
        for (auto& l : ls) {
          vl.push_back(adopting(*l));
          MoeTuning t = vl.back()->tuning();
          t.kernel_prefetch_l1 = kn.l1;
          t.kernel_prefetch_l2 = kn.l2;
          t.item_blocks = kn.item_blocks;
          t.item_prefetch = kn.item_prefetch;
          vl.back()->set_tuning(t);
        }
        std::vector<double> ms, gbps;
        timed_calls(vl, routings, *sh, calls, gap_us * 1e-6, per_expert, out.data(), ms, gbps);
        if (pass < 0) continue;
        std::sort(ms.begin(), ms.end());
        std::sort(gbps.begin(), gbps.end());
        const double g = gbps[gbps.size() / 2];
        std::printf("%-5s %2d %-10s %5d %6d %3d %6d %5d | %8.3f %8.3f %7.1f %4.0f%% %4.0f%%\n", fname.c_str(), T,
                    kernel_variants()[vi].name, kn.l1, kn.l2, kn.item_blocks, kn.item_prefetch, round,
                    ms[ms.size() / 2], ms[ms.size() * 9 / 10], g, 100 * g / probe, 100 * g / probe_pf);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
