#pragma once
// One MoE layer's routed experts on the CPU: packed weights, and forward =
//   group tokens by expert -> per expert: fused gate/up, SiLU * up, down -> weighted sum;
// or, set per layer, gate/up/down biases and gpt-oss's clamped SwiGLU in place of SiLU * up (Glu).
// Shapes: T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
// Matrices: gate, up [I, H]; down [H, I]. Each is cut into `numa_nodes` slices of output
// rows (whole 32-row blocks); slice s of every expert lives in one buffer on node s and is
// computed by the worker group of node s.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe/moe_backward.h"
#include "moe/moe_trace.h"
#include "moe/pack.h"
#include "moe/packed.h"
#include "runtime/thread_pool.h"

namespace hmoe {

struct MoeConfig {
  int E = 0, H = 0, I = 0;
  Format format = Format::bf16;
  int group = 128;           // int4 group size (32, 64, 128)
  bool zero_points = false;  // int4: asymmetric groups with zero points
  int threads = 1;
  Isa isa = Isa::generic;
  int numa_nodes = 1;
};

// One forward call: raw views, already checked at the Python boundary.
struct MoeCall {
  const void* x = nullptr;  // [T, H] fp32 or bf16
  bool x_bf16 = false;
  int T = 0, K = 0;
  const void* ids = nullptr;  // [T, K] int32 or int64, each in [0, E), distinct per token
  bool ids64 = false;
  const float* weights = nullptr;  // [T, K]
  void* out = nullptr;             // [T, H], x's dtype
  // Expert deferral in one call (the hybrid decode's, HybridExperts.merged_deferral): each token's last
  // `deferred` slots are summed into out2 [T, H] (x's dtype) instead of out. The run computes the experts of
  // the other slots first; once out is complete it notes the time in *out_ready_ns and stores 1 to *out_ready
  // (release; either may be null) and goes on with the deferred slots' experts. Without deferral out_ready is
  // stored when the call ends.
  int deferred = 0;
  void* out2 = nullptr;
  uint32_t* out_ready = nullptr;
  int64_t* out_ready_ns = nullptr;
};

// How a call's GEMM work is cut and prefetched: timing only, results never depend on it. The
// fields and their defaults are documented once, in src/hybridmoe/experts/tuning.py (EngineTuning).
struct MoeTuning {
  int item_blocks = 0;             // 32-row blocks per GEMM item (0: automatic, 1 to 8 blocks)
  int item_prefetch = 4096;        // bytes of each weight stream prefetched into L2 as an item starts
  int kernel_prefetch_l1 = 4096;   // PackedView::prefetch_l1
  int kernel_prefetch_l2 = 16384;  // PackedView::prefetch_l2
  bool early_start = true;         // a decode call converts x inside the GEMM run (forward)
  bool padded_counters = true;     // a call's counters on a cache line each (Counters)
  bool tail_split = true;          // the run's last down items in 1-block items
  bool gate_up_tail = true;        // each side's last gate/up items in 1-block items
  bool balanced_items = true;      // automatic item sizes by the run's critical path (step_for)
  bool combine_in_run = true;      // calls of few tokens sum the outputs inside the GEMM run
  int prefetch_touch = 0;          // prefetch()'s touch: 0 prefetcht1, 1 prefetcht0, 2 load, 3 load + cldemote
};

struct PackedBuffer {
  std::string name;  // "<gate|up|down>.<slice>.<w|scale|zero>"
  void* data;
  size_t bytes;
  bool is_float;     // float32 values, else raw bytes
};

class MoeLayer {
 public:
  // Allocates packed storage, unless `adopt`: then set_buffer must provide every buffer.
  MoeLayer(const MoeConfig& cfg, bool adopt);
  ~MoeLayer();

  const MoeConfig& config() const { return cfg_; }
  // Quantize and tile expert e from fp32 gate, up [I, H] and down [H, I] (on the pool).
  void pack_expert(int e, const float* gate, const float* up, const float* down);
  // Tile expert e of an fp8 layer from its block-FP8 codes and scales as they are (on the pool):
  // gate, up [I, H], down [H, I]. std::invalid_argument for another format, a NaN code or a scale
  // that is not finite, naming the matrix.
  void pack_expert_fp8(int e, const Fp8Codes mats[3]);
  // Tile expert e of an mxfp4 layer from its MXFP4 codes and e8m0 scales as they are (on the pool): gate, up
  // [I, H], down [H, I]. std::invalid_argument for another format or a nonzero code under a scale outside
  // [kE8m0Min, kE8m0Max] (packed.h), naming the matrix, row and group.
  void pack_expert_mxfp4(int e, const Mxfp4Codes mats[3]);
  // The weights the kernels compute with, dequantized to fp32.
  void unpack_expert(int e, float* gate, float* up, float* down) const;
  // What h is (packed.h Glu; default silu(g) * u) and the experts' biases, fp32 gate and up [E, I],
  // down [E, H] (copied; each expert's y = h Wd^T + down bias before its routing weight multiplies it).
  // Between calls, like set_tuning. set_glu throws std::invalid_argument for a limit that is not positive
  // and finite or a gain that is not finite.
  void set_glu(GluKind kind, float alpha, float limit);
  void set_biases(const float* gate, const float* up, const float* down);
  bool has_biases() const { return !bias_[0].empty(); }

  std::vector<PackedBuffer> buffers() const;
  void set_buffer(const std::string& name, void* data, size_t bytes);

  uint64_t submit(const MoeCall& call);
  void wait(uint64_t ticket);
  // Wakes the pool's sleeping workers ahead of a call (a no-op while they spin); any thread.
  void prewake();
  // forward on the calling thread (it works as one of the pool's threads); blocks until done.
  void run(const MoeCall& call);
  // The gradients of x and of the routing weights (moe_backward.cpp), on the calling thread with the pool, as run().
  void backward(const MoeBackwardCall& call);
  // Reads the packed weights of the given experts (each in [0, E), repeats allowed) into the
  // caches, on the calling thread with the pool (as run()), so that a call that follows soon may
  // find them there: the CPU, idle while the GPU runs a layer's attention, fetches the experts its
  // router is likely to name. Work items of kPrefetchChunk bytes, each line touched as
  // MoeTuning::prefetch_touch says. Returns the bytes fetched. Results of later calls do not
  // depend on it; the engine does not call it (benchmarks measure what it saves).
  size_t prefetch(const int* experts, int n);
  static constexpr size_t kPrefetchChunk = 16384;
  // Tracing (moe_trace.h): record the next `calls` forwards; take_trace() hands the records over.
  void trace(int calls) { tracer_.arm(calls); }
  std::vector<TraceCall> take_trace() { return tracer_.take(); }
  // The knobs of later calls (set between calls).
  void set_tuning(const MoeTuning& t) { tuning_ = t; }
  const MoeTuning& tuning() const { return tuning_; }
  ThreadPool& pool() const { return *pool_; }

 private:
  struct Matrix {
    int N, K, Kp, blocks;
    std::vector<int> slice_begin;  // blocks of slice s: [slice_begin[s], slice_begin[s+1])
    std::vector<uint8_t*> w;
    std::vector<uint8_t*> scale, zero;  // fp32 values (int8, int4, fp8) or e8m0 bytes (mxfp4)
  };
  size_t scale_bytes(const Matrix& m, int blocks) const;
  PackedView view(const Matrix& m, int e, int s) const;
  // pack(m, global block b, its slice's view of expert e, b's index in that slice) for every block of
  // expert e's three matrices, as items on the pool.
  template <class PackBlock>
  void each_block(int e, PackBlock pack);
  // One call on the pool, step by step (moe_layer.cpp): its state and steps.
  struct Forward;
  void forward(const MoeCall& call, int64_t call_ns);
  struct Backward;  // one backward call (moe_backward.cpp)

  // Expert e's Glu with its biases from column col of h on; null for a plain layer (silu, no biases),
  // whose kernels then run as if Glu did not exist.
  const Glu* glu_of(int e, int col, Glu& scratch) const;
  // Expert e's down bias from column col on; null without biases.
  const float* down_bias(int e, int col) const;

  MoeConfig cfg_;
  Matrix mats_[3];  // gate, up, down
  Glu glu_;                      // kind, alpha, limit (no bias pointers: glu_of sets them per expert)
  std::vector<float> bias_[3];   // gate, up [E][gate blocks * 32], down [E][down blocks * 32]; zeros past I, H
  bool adopt_;
  std::vector<std::pair<void*, size_t>> owned_;
  std::shared_ptr<ThreadPool> pool_;
  const Kernels* base_;   // few tokens
  const Kernels* many_;   // many tokens (AMX where present, else base_)
  uint64_t last_ticket_ = 0;
  Tracer tracer_;
  MoeTuning tuning_;
};

}  // namespace hmoe
