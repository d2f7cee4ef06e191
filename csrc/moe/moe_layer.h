#pragma once
// One MoE layer's routed experts on the CPU: packed weights, and forward =
//   group tokens by expert -> per expert: fused gate/up, SiLU * up, down -> weighted sum.
// Shapes: T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
// Matrices: gate, up [I, H]; down [H, I]. Each is cut into `numa_nodes` slices of output
// rows (whole 32-row blocks); slice s of every expert lives in one buffer on node s and is
// computed by the worker group of node s.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe/moe_trace.h"
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
  // The weights the kernels compute with, dequantized to fp32.
  void unpack_expert(int e, float* gate, float* up, float* down) const;

  std::vector<PackedBuffer> buffers() const;
  void set_buffer(const std::string& name, void* data, size_t bytes);

  uint64_t submit(const MoeCall& call);
  void wait(uint64_t ticket);
  // Wakes the pool's sleeping workers ahead of a call (a no-op while they spin); any thread.
  void prewake();
  // forward on the calling thread (it works as one of the pool's threads); blocks until done.
  void run(const MoeCall& call);
  // Reads the packed weights of the given experts (each in [0, E), repeats allowed) into the
  // caches, on the calling thread with the pool (as run()), so that a call that follows soon may
  // find them there (the idea: the CPU, idle while the GPU runs a layer's attention, fetches the
  // experts its router is likely to name; moe_prefetch.cpp says what it measured).
  // Work items of kPrefetchChunk bytes. Returns the bytes fetched. Results of later calls do not
  // depend on it. Measured on the GPU host (benchmarks/prefetch_gain.py), not yet used by the engine.
  size_t prefetch(const int* experts, int n);
  static constexpr size_t kPrefetchChunk = 16384;
  // How prefetch() touches each 64-byte line: 0 prefetcht1 (into L2), 1 prefetcht0 (into L1),
  // 2 a load (the line is in L1 when the item ends), 3 a load then cldemote (moved on to the L3,
  // which every core reads: the GPU host's L3 does not keep what the L2s hold).
  void set_prefetch_touch(int mode) { prefetch_touch_ = mode; }
  int prefetch_touch() const { return prefetch_touch_; }
  // Tracing (moe_trace.h): record the next `calls` forwards; take_trace() hands the records over.
  void trace(int calls) { tracer_.arm(calls); }
  std::vector<TraceCall> take_trace() { return tracer_.take(); }
  // 32-row blocks per GEMM work item (0: about 4 items per thread, 1 to 8 blocks): for
  // benchmarks that weigh the tail against per-item costs.
  void set_item_blocks(int blocks) { item_blocks_ = blocks; }
  int item_blocks() const { return item_blocks_; }
  // Bytes of each weight stream (and scales) of a GEMM item prefetched into L2 as it starts (0: none).
  void set_item_prefetch(int bytes) { item_prefetch_ = bytes; }
  int item_prefetch() const { return item_prefetch_; }
  // Software prefetch distances of the memory-bound kernels (PackedView::prefetch_l1 / _l2).
  void set_kernel_prefetch(int l1_bytes, int l2_bytes) {
    kernel_prefetch_l1_ = l1_bytes;
    kernel_prefetch_l2_ = l2_bytes;
  }
  int kernel_prefetch_l1() const { return kernel_prefetch_l1_; }
  int kernel_prefetch_l2() const { return kernel_prefetch_l2_; }
  // Whether a decode call (x converted on one thread) starts the GEMM run before converting x:
  // the workers join and prefetch their first items' weights while the calling thread converts
  // x, and gate/up items wait for it (traced: their wait). On, with padded_counters: on the GPU
  // host (session 5 r3, Qwen3 decode loop at 15 threads, variants rotated in one run) the two
  // together against neither: int4 T=1 0.148 vs 0.152 ms, T=4 0.594 vs 0.605, int8 T=4 1.093 vs
  // 1.107, bf16 T=4 submit 2.080 vs 2.096; 9 of 12 cells faster, the others within 0.5%. On tiny
  // experts (r2, rotated) early_start alone saved 0.2-1.3 us of a 22-28 us call.
  void set_early_start(bool on) { early_start_ = on; }
  bool early_start() const { return early_start_; }
  // Whether a call's counters (per active expert, per down block) sit on a cache line each
  // (workers counting down neighbouring ones would bounce one line between their cores). On: see
  // early_start for the two measured together.
  void set_padded_counters(bool on) { padded_counters_ = on; }
  bool padded_counters() const { return padded_counters_; }
  // Whether one-token experts read two weight blocks at once (PackedView::paired). Off: no
  // clear win on the GPU host (mini round: within the noise, int8 T=1 slower).
  void set_paired(bool on) { paired_ = on; }
  ThreadPool& pool() const { return *pool_; }
  bool paired() const { return paired_; }
  // Whether the run's last down items (about two blocks per thread) are cut into 1-block items.
  void set_tail_split(bool on) { tail_split_ = on; }
  bool tail_split() const { return tail_split_; }
  // Whether each side's last gate/up items (about two blocks per thread) are cut into 1-block items,
  // so that its experts' gate/up ends on every worker within a block of each other (see forward).
  void set_gate_up_tail(bool on) { gate_up_tail_ = on; }
  bool gate_up_tail() const { return gate_up_tail_; }
  // Whether GEMM items are sized so that the run should end soonest, by the gate/up items' rounds
  // and all the work over the workers (see forward), else about 4 items per thread over all blocks.
  void set_balanced_items(bool on) { balanced_items_ = on; }
  bool balanced_items() const { return balanced_items_; }
  // Whether calls of few tokens sum the experts' outputs inside the GEMM run (see forward).
  void set_combine_in_run(bool on) { combine_in_run_ = on; }
  bool combine_in_run() const { return combine_in_run_; }

 private:
  struct Matrix {
    int N, K, Kp, blocks;
    std::vector<int> slice_begin;  // blocks of slice s: [slice_begin[s], slice_begin[s+1])
    std::vector<uint8_t*> w;
    std::vector<float*> scale, zero;
  };
  size_t scale_floats(const Matrix& m, int blocks) const;
  PackedView view(const Matrix& m, int e, int s) const;
  void forward(const MoeCall& call, int64_t call_ns);

  MoeConfig cfg_;
  Matrix mats_[3];  // gate, up, down
  bool adopt_;
  std::vector<std::pair<void*, size_t>> owned_;
  std::shared_ptr<ThreadPool> pool_;
  const Kernels* base_;   // few tokens
  const Kernels* many_;   // many tokens (AMX where present, else base_)
  uint64_t last_ticket_ = 0;
  Tracer tracer_;
  int item_blocks_ = 0;
  int item_prefetch_ = 4096;
  // L1 4 KiB and L2 16 KiB ahead: on the GPU host (r1, Qwen3 decode loop, side by side) the
  // fastest of 0/2/4/8 KiB into L1 and 8 or 16 KiB into L2: int8 T=1 268 vs 425 us, bf16 T=4
  // 1963 vs 2451, int4 T=4 651 vs 680 (T=1 189 vs 197); per core 9-12 GB/s instead of 8-9.
  int kernel_prefetch_l1_ = 4096, kernel_prefetch_l2_ = 16384;
  bool paired_ = false;
  bool early_start_ = true;
  bool padded_counters_ = true;
  bool tail_split_ = true;
  bool gate_up_tail_ = true;
  bool combine_in_run_ = true;
  bool balanced_items_ = true;
  int prefetch_touch_ = 0;
};

}  // namespace hmoe
