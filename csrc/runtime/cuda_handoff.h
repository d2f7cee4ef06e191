#pragma once
// The CPU expert work of MoE layers ordered on a CUDA stream, with no Python and no GIL on the way,
// in one of two modes:
//
// - host functions (cudaLaunchHostFunc): submit / wait as host nodes run by CUDA's own thread;
// - stream memory operations (after start_polling): per layer two flag words in pinned,
//   device-mapped host memory, each alone on a 64-byte line. The stream writes go = T after the
//   D2H copies; the process-wide FlagPoller thread sees it, clears go, runs the layer on the T
//   staged rows on its own thread (as one of the engine pool's workers) and sets done = 1; the
//   stream waits for done == 1 and copies the output H2D. Every value is fixed (T is fixed per
//   (layer, T) node), so a captured graph replays the same protocol each time; the stream
//   clears done just before it writes go (both writes carry a memory barrier, in that order),
//   and the poller clears go before it sets done, so neither side can see a stale value, even
//   after a go that was never waited for.
//
// Per layer: a MoeLayer that adopts the packed buffers of a CPU expert engine (shared, not copied;
// the same worker pool) and computes on fixed staging buffers x [Tmax, H], ids [Tmax, K],
// weights [Tmax, K] -> out [Tmax, H]. Per (layer, T) one argument pack (Job) with a fixed
// address: a host node captured in a CUDA graph keeps pointing at it, so every replay computes
// the first T rows of that layer's staging buffers. The bindings check shapes, dtypes and devices
// when a layer is added; T is checked when work is enqueued; the host functions only read the
// pack (and check the ids, which the GPU wrote: an id out of range would make the engine index
// out of bounds). Bad arguments throw std::invalid_argument.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moe/moe_layer.h"
#include "runtime/cuda_host.h"

namespace hmoe {

// One layer's staging buffers (host memory, [max_tokens, H] and [max_tokens, K]).
struct HandoffStaging {
  void* x = nullptr;
  bool x_bf16 = false;
  const void* ids = nullptr;
  bool ids64 = false;
  const float* weights = nullptr;
  void* out = nullptr;  // x's dtype
};

// What the poller saw of the steps it served, summed (nanoseconds of the steady clock).
struct HandoffStats {
  int64_t layers = 0, cpu_ns = 0;  // layers served; their CPU work (go seen -> done written)
  int64_t late_ns = 0;             // how late each go may have been seen (since the previous look)
  int64_t steps = 0, first_cpu_ns = 0, first_late_ns = 0;  // the first layer of each step alone
  // Within a step: one layer's done -> the next one's go seen (the stream sees done, copies
  // the output back, runs the next layer's GPU work, copies its rows out and writes go).
  int64_t gaps = 0, between_ns = 0;
  // The spread behind the sums: the latest go and the longest CPU work of one layer, and how many
  // gos came more than kSlowLateNs after the previous look (the poller off its CPU, not spinning).
  int64_t late_max_ns = 0, slow_lates = 0, cpu_max_ns = 0;
};

class CudaHandoff : public FlagChannel {
 public:
  // A go word's flag for a merged call of a linked layer (link_deferred); the low bits are T.
  static constexpr uint32_t kMergedGo = 1u << 30;
  static constexpr int64_t kSlowLateNs = 20'000;
  struct Job;  // one (layer, T)'s argument pack (cuda_handoff.cpp)

  CudaHandoff(int max_tokens, int top_k);
  ~CudaHandoff() override;

  // A layer computing with the packed `buffers` (MoeLayer::buffers' names, each given once) on
  // `staging`; returns its index. Before start_polling only.
  int add_layer(const MoeConfig& cfg, const std::vector<PackedBuffer>& buffers, const HandoffStaging& staging);

  // On the CUDA stream `stream`: start layer `layer` on its first T staged rows / wait for it /
  // both (host functions, or the flag words once polling).
  void enqueue_submit(uintptr_t stream, int layer, int T);
  void enqueue_wait(uintptr_t stream, int layer, int T);
  void enqueue_forward(uintptr_t stream, int layer, int T);

  // What the stream's CPU work does, without CUDA: the CPU half of a step. prepare_run (the
  // calling thread may hold a lock, e.g. the GIL) looks up the layers' packs; run then computes
  // them in order. Host-function mode: submit and wait (the pool's driver thread computes); polling
  // mode: the layer on this thread, as the poller runs it (a linked layer with its deferred part,
  // as a merged go).
  using RunList = std::vector<std::pair<Job*, Job*>>;  // a linked layer's own and deferred parts (else nullptr)
  RunList prepare_run(const std::vector<int>& layers, int T);
  void run(const RunList& jobs);

  // Until the CUDA event `event` (a cudaEvent_t) completes, the calling thread works in the layers'
  // pool as one more worker (ThreadPool::help): the thread that drives a decode step, on a CPU of
  // its own, then computes in the layers the poller runs instead of spinning in CUDA's wait.
  void help_until(uintptr_t event);

  // Flag words: [go 0 | done 0 | go 1 | done 1 | ...], each word alone on a 64-byte line. go_word
  // and done_word check the layer.
  static constexpr int kWordsPerLine = 16;
  int flag_words() const { return 2 * num_layers() * kWordsPerLine; }
  int go_word(int layer) const { return go_index(checked(layer)); }
  int done_word(int layer) const { return done_index(checked(layer)); }

  // From now on the stream's CPU work goes through `flags` (flag_words() words, 64-byte aligned;
  // zeroed here) and the poller thread. device_mapped: the words are pinned and the stream reaches
  // them (else only a thread of the caller's, playing the GPU's part, can: tests).
  void start_polling(uint32_t* flags, bool device_mapped);

  // Expert deferral in one call per layer (HybridExperts.merged_deferral): `partner` (polling too) holds
  // the deferred part of this handoff's layer `layer`, as its layer `partner_layer`: the same packed experts,
  // its own staging ids, weights and output (x is this layer's). The stream then stages both parts' rows,
  // clears both done words and writes only this layer's go word; the poller runs the two parts as one call
  // (MoeCall::deferred): this layer's done word is set as soon as its output is complete, the partner's
  // once the deferred output is too. That go word carries kMergedGo | T; a plain T still runs this part
  // alone (the partner's part then has a go of its own). Link before such work is enqueued.
  void link_deferred(int layer, CudaHandoff& partner, int partner_layer);

  // Called by the poller thread only: serves every layer whose go word is set.
  bool poll() override;

  // Trace (moe_trace.h) the next `calls` calls of a layer, as the pipeline runs them (the poller's
  // or CUDA's thread), and take the records (call_ns is set too).
  void trace(int layer, int calls);
  std::vector<TraceCall> take_trace(int layer);

  // Polling mode: what the poller saw since the last call (then zeroed): the CPU work's own time
  // inside a running pipeline, apart from the GPU's and the handoff's.
  HandoffStats take_stats();
  // The first failure the CPU work recorded since the last call (then cleared).
  std::optional<std::string> take_error();
  std::string mode() const { return polling_ ? "stream_mem_ops" : "host_function"; }

  // One token: leave out its trailing slots of weight 0 (the padding of a row whose other experts
  // are on the GPU: it repeats one of the row's own experts, and adds 0 x its output). Read by the
  // CPU work of every later call (set it between steps).
  bool trim_padding() const { return trim_padding_; }
  void set_trim_padding(bool on) { trim_padding_ = on; }
  // Every layer's MoeTuning (set it between steps); tuning() reads the first layer's.
  void set_tuning(const MoeTuning& t);
  const MoeTuning& tuning() const;

  int checked(int layer) const;
  int num_layers() const { return int(layers_.size()); }
  int max_tokens() const { return max_tokens_; }
  int top_k() const { return top_k_; }

 private:
  struct Layer {
    std::unique_ptr<MoeLayer> moe;
    int E = 0, H = 0;
    size_t out_row_bytes = 0;
    MoeCall base;  // the staging buffers; T left 0
  };
  // link_deferred: per layer the partner handoff and its layer holding the deferred part (none: nullptr).
  struct Link {
    CudaHandoff* partner = nullptr;
    int layer = -1;
  };

  static int go_index(int layer) { return 2 * layer * kWordsPerLine; }
  static int done_index(int layer) { return (1 + 2 * layer) * kWordsPerLine; }
  Job* job(int layer, int T);
  Job* served(int layer, uint32_t T) { return served_[size_t(layer) * max_tokens_ + T - 1]; }
  void serve_go(int layer, uint32_t go, int64_t look);
  void note_layer(int layer, int64_t look, int64_t seen, int64_t done, int64_t late = -1);
  uint64_t flag_addr(int word) const;
  void record(const std::string& msg);
  static void record_failure(Job& j, const std::string& what);
  static bool ids_in_range(Job& j);
  static MoeCall trimmed(const Job& j);
  static void serve(Job* p) noexcept;
  void serve_linked(Job* o, Job* d, int64_t& ready_ns) noexcept;
  MoeCall merged_call(const MoeCall& co, const MoeCall& cd);
  static void submit_fn(void* p) noexcept;
  static void wait_fn(void* p) noexcept;
  static void forward_fn(void* p) noexcept;

  int max_tokens_, top_k_;
  bool trim_padding_ = false;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::map<std::pair<int, int>, std::unique_ptr<Job>> jobs_;
  // Polling mode: the flag words (host address; device address, 0 if not mapped) and the packs
  // the poller serves, by layer * max_tokens + T - 1.
  bool polling_ = false;
  uint32_t* flags_ = nullptr;
  uint64_t flags_dev_ = 0;
  std::vector<Job*> served_;
  std::vector<Link> links_;
  // serve_linked's merged rows, [T, K own + K deferred] (the poller's thread, or run()'s, never both at once).
  std::vector<int64_t> merged_ids_;
  std::vector<float> merged_w_;
  std::mutex stats_mu_;
  HandoffStats stats_;
  // The poller's own bookkeeping (only its thread touches these).
  int last_layer_ = -1;
  int64_t last_done_ns_ = 0, last_look_ns_ = 0;
  std::mutex error_mu_;
  std::optional<std::string> error_;
};

}  // namespace hmoe
