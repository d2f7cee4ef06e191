// hybridmoe._native.CudaHandoff: the CPU expert work of MoE layers ordered on a CUDA stream, with
// no Python and no GIL on the way, in one of two modes:
//
// - host functions (cudaLaunchHostFunc): submit / wait as host nodes run by CUDA's own thread;
// - stream memory operations (after start_polling): per layer two flag words in pinned,
//   device-mapped host memory, each alone on a 64-byte line. The stream writes go = T after the
//   D2H copies; the process-wide FlagPoller thread sees it, clears go, runs the layer on the T
//   staged rows on its own thread (as one of the engine pool's workers) and sets done = 1; the
//   stream waits for done == 1 and copies the output H2D. Every value is fixed (T is fixed per
//   (layer, T) node), so a captured graph replays the same protocol each time; the stream
//   clears done just before it writes go (both writes carry a memory barrier, in that order),
//   and we clear go before we set done, so neither side can see a stale value, even after a go
//   that was never waited for.
//
// Per layer: a MoeLayer that adopts the packed buffers of a CpuExperts engine (shared, not
// copied; the same worker pool) and computes on fixed staging buffers x [Tmax, H], ids [Tmax, K],
// weights [Tmax, K] -> out [Tmax, H]. Per (layer, T) one argument pack (Job) with a fixed
// address: a host node captured in a CUDA graph keeps pointing at it, so every replay computes
// the first T rows of that layer's staging buffers. Shapes, dtypes and devices are checked when a
// layer is added and T when work is enqueued; the host functions only read the pack (and check
// the ids, which the GPU wrote: an id out of range would make the engine index out of bounds).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_args.h"
#include "moe/moe_layer.h"
#include "runtime/cuda_host.h"

namespace nb = nanobind;
using namespace nb::literals;

nb::list trace_records(std::vector<hmoe::TraceCall> calls);  // csrc/bindings.cpp

namespace {

using MutArray = nb::ndarray<>;
using namespace hmoe::args;

bool in_host_memory(const MutArray& a) {
  return a.device_type() == nb::device::cpu::value || a.device_type() == nb::device::cuda_host::value;
}

// Host memory (pinned or not), C-contiguous, exactly `rows` x `cols`.
void check_staging(const MutArray& a, const char* what, int64_t rows, int64_t cols) {
  if (!in_host_memory(a)) fail(std::string(what) + " must be in host memory");
  if (a.ndim() != 2 || int64_t(a.shape(0)) != rows || int64_t(a.shape(1)) != cols)
    fail(std::string(what) + " must have shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  if ((cols > 1 && a.stride(1) != 1) || (rows > 1 && a.stride(0) != cols))
    fail(std::string(what) + " must be contiguous");
}

class Handoff;

struct Layer {
  std::unique_ptr<hmoe::MoeLayer> moe;
  int E = 0, H = 0;
  size_t out_row_bytes = 0;
  hmoe::MoeCall base;  // the staging buffers; T left 0
};

// The argument pack of one (layer, T). ticket/started pass from submit to wait, which run in
// stream order on CUDA's thread (or one after the other in run()). In polling mode every pack
// exists from start_polling on (the poller reads them while Python may look them up).
struct Job {
  Handoff* owner;
  int layer;
  Layer* l;
  hmoe::MoeCall call;
  uint64_t ticket = 0;
  bool started = false;
};

class Handoff : public hmoe::FlagChannel {
 public:
  Handoff(int max_tokens, int top_k) : max_tokens_(max_tokens), top_k_(top_k) {
    if (max_tokens < 1) fail("max_tokens must be >= 1, got " + std::to_string(max_tokens));
    if (top_k < 1) fail("top_k must be >= 1, got " + std::to_string(top_k));
  }

  ~Handoff() override {
    if (polling_) hmoe::FlagPoller::instance().remove(this);  // waits out a poll in progress
    // A submitted job still reads the staging buffers: let it finish before they go.
    for (auto& [key, job] : jobs_)
      if (job->started) try { job->l->moe->wait(job->ticket); } catch (...) {}
  }

  int add_layer(int E, int H, int I, const std::string& format, int group_size, bool zero_points, int threads,
                const std::string& isa, int numa_nodes, nb::dict buffers, MutArray x, MutArray ids,
                MutArray weights, MutArray out) {
    if (polling_) fail("layers must be added before start_polling");
    if (top_k_ > E) fail("top_k " + std::to_string(top_k_) + " exceeds the layer's " + std::to_string(E) + " experts");
    const hmoe::MoeConfig cfg = moe_config(E, H, I, format, group_size, zero_points, threads, isa, numa_nodes);

    check_staging(x, "hidden staging", max_tokens_, H);
    const bool bf16 = x.dtype() == kBf16;
    if (!bf16 && x.dtype() != nb::dtype<float>()) fail("hidden staging must be bfloat16 or float32");
    check_staging(ids, "topk_ids staging", max_tokens_, top_k_);
    const bool ids64 = ids.dtype() == nb::dtype<int64_t>();
    if (!ids64 && ids.dtype() != nb::dtype<int32_t>()) fail("topk_ids staging must be int32 or int64");
    check_staging(weights, "topk_weights staging", max_tokens_, top_k_);
    if (weights.dtype() != nb::dtype<float>()) fail("topk_weights staging must be float32");
    check_staging(out, "output staging", max_tokens_, H);
    if (out.dtype() != x.dtype()) fail("output staging must have the hidden staging's dtype");

    auto l = std::make_unique<Layer>();
    l->moe = std::make_unique<hmoe::MoeLayer>(cfg, /*adopt=*/true);
    size_t given = 0;
    for (auto [name, arr] : buffers) {
      auto a = nb::cast<MutArray>(arr);
      if (!in_host_memory(a)) fail("packed buffers must be in host memory");
      l->moe->set_buffer(nb::cast<std::string>(name), a.data(), a.nbytes());
      ++given;
    }
    const auto expected = l->moe->buffers();
    for (const auto& b : expected)
      if (!b.data) fail("packed buffer '" + b.name + "' is missing");
    if (given != expected.size()) fail("packed buffers name one buffer twice");

    l->E = E;
    l->H = H;
    l->out_row_bytes = size_t(H) * (bf16 ? 2 : 4);
    l->base.x = x.data();
    l->base.x_bf16 = bf16;
    l->base.K = top_k_;
    l->base.ids = ids.data();
    l->base.ids64 = ids64;
    l->base.weights = static_cast<const float*>(weights.data());
    l->base.out = out.data();
    layers_.push_back(std::move(l));
    return int(layers_.size()) - 1;
  }

  void enqueue_submit(uintptr_t stream, int layer, int T) {
    Job* j = job(layer, T);
    if (polling_) {
      hmoe::stream_write_value32(stream, flag_addr(done_word(layer)), 0);
      hmoe::stream_write_value32(stream, flag_addr(go_word(layer)), uint32_t(T));
    } else {
      launch(stream, &submit_fn, j);
    }
  }
  void enqueue_wait(uintptr_t stream, int layer, int T) {
    Job* j = job(layer, T);
    if (polling_) {
      hmoe::stream_wait_value32(stream, flag_addr(done_word(layer)), 1);
    } else {
      launch(stream, &wait_fn, j);
    }
  }
  void enqueue_forward(uintptr_t stream, int layer, int T) {
    if (polling_) {
      enqueue_submit(stream, layer, T);
      enqueue_wait(stream, layer, T);
    } else {
      launch(stream, &forward_fn, job(layer, T));
    }
  }
  // What the stream's CPU work does, called here in order (no CUDA): the CPU half of a step.
  // Host-function mode: submit and wait (the pool's driver thread computes); polling mode: the
  // layer on this thread, as the poller runs it (a linked layer with its deferred part, as a merged go).
  void run(const std::vector<int>& layers, int T) {
    std::vector<std::pair<Job*, Job*>> jobs;  // a linked layer's own and deferred parts (else nullptr)
    for (int layer : layers) {
      const Handoff* partner = layer >= 0 && layer < int(links_.size()) ? links_[layer].partner : nullptr;
      jobs.emplace_back(job(layer, T), partner ? links_[layer].partner->job(links_[layer].layer, T) : nullptr);
    }
    nb::gil_scoped_release nogil;
    for (auto [j, d] : jobs) {
      int64_t ready = 0;
      if (d) serve_linked(j, d, ready);
      else polling_ ? serve(j) : forward_fn(j);
    }
  }

  // Until the CUDA event `event` (a cudaEvent_t) completes, the calling thread works in the layers'
  // pool as one more worker (ThreadPool::help): the thread that drives a decode step, on a CPU of
  // its own, then computes in the layers the poller runs instead of spinning in CUDA's wait.
  void help_until(uintptr_t event) {
    if (layers_.empty()) fail("help_until needs a layer");
    hmoe::ThreadPool& pool = layers_[0]->moe->pool();
    nb::gil_scoped_release nogil;
    pool.help([event] { return hmoe::event_done(event); });
  }

  // A go word's flag for a merged call of a linked layer (link_deferred); the low bits are T.
  static constexpr uint32_t kMergedGo = 1u << 30;
  // Flag words: [go 0 | done 0 | go 1 | done 1 | ...], each word alone on a 64-byte line.
  static constexpr int kWordsPerLine = 16;
  int flag_words() const { return 2 * num_layers() * kWordsPerLine; }
  int go_word(int layer) const { return 2 * layer * kWordsPerLine; }
  int done_word(int layer) const { return (1 + 2 * layer) * kWordsPerLine; }

  // "" if this device can run the polling mode on these (pinned) flag words, else why not.
  std::string probe_stream_mem_ops(MutArray flags) {
    check_flags(flags);
    nb::gil_scoped_release nogil;
    return hmoe::probe_stream_mem_ops(static_cast<uint32_t*>(flags.data()));
  }

  // From now on the stream's CPU work goes through `flags` (zeroed here) and the poller thread.
  // device_mapped: the words are pinned and the stream reaches them (else only a thread of the
  // caller's, playing the GPU's part, can: tests).
  void start_polling(MutArray flags, bool device_mapped) {
    if (polling_) fail("start_polling was called twice");
    if (layers_.empty()) fail("add the layers before start_polling");
    check_flags(flags);
    flags_ = static_cast<uint32_t*>(flags.data());
    if (device_mapped) flags_dev_ = hmoe::host_device_pointer(flags_);
    std::memset(flags_, 0, size_t(flag_words()) * 4);
    served_.assign(size_t(num_layers()) * max_tokens_, nullptr);
    for (int layer = 0; layer < num_layers(); ++layer)
      for (int T = 1; T <= max_tokens_; ++T) served_[size_t(layer) * max_tokens_ + T - 1] = job(layer, T);
    polling_ = true;
    const hmoe::MoeConfig& cfg = layers_[0]->moe->config();
    hmoe::FlagPoller::instance().pin(hmoe::shared_pool(cfg.threads, cfg.numa_nodes)->driver_cpu());
    hmoe::FlagPoller::instance().add(this);
  }

  // Expert deferral in one call per layer (HybridExperts.merged_deferral): `partner` (polling too) holds
  // the deferred part of this handoff's layer `layer`, as its layer `partner_layer`: the same packed experts,
  // its own staging ids, weights and output (x is this layer's). The stream then stages both parts' rows,
  // clears both done words and writes only this layer's go word; the poller runs the two parts as one call
  // (MoeCall::deferred): this layer's done word is set as soon as its output is complete, the partner's
  // once the deferred output is too. That go word carries kMergedGo | T; a plain T still runs this part
  // alone (the partner's part then has a go of its own). Link before such work is enqueued.
  void link_deferred(int layer, Handoff& partner, int partner_layer) {
    checked(layer);
    partner.checked(partner_layer);
    if (&partner == this) fail("link_deferred: the deferred part needs a handoff of its own");
    if (!polling_ || !partner.polling_) fail("link_deferred needs both handoffs polling (start_polling)");
    if (partner.max_tokens_ != max_tokens_)
      fail("link_deferred: max_tokens differ (" + std::to_string(max_tokens_) + " vs " +
           std::to_string(partner.max_tokens_) + ")");
    const Layer &a = *layers_[layer], &b = *partner.layers_[partner_layer];
    const auto wa = a.moe->buffers(), wb = b.moe->buffers();
    if (a.E != b.E || a.H != b.H || a.base.x_bf16 != b.base.x_bf16 || wa.size() != wb.size() ||
        wa[0].data != wb[0].data)
      fail("link_deferred: partner layer " + std::to_string(partner_layer) + " does not compute with layer " +
           std::to_string(layer) + "'s packed experts and dtype");
    links_.resize(num_layers());
    links_[layer] = {&partner, partner_layer};
  }

  // Called by the poller thread only: serve every layer whose go word is set.
  bool poll() override {
    bool served = false;
    const int64_t look = hmoe::trace_now_ns();
    for (int layer = 0; layer < num_layers(); ++layer) {
      const uint32_t go = hmoe::load_flag(&flags_[go_word(layer)]);
      if (go == 0) continue;
      hmoe::store_flag(&flags_[go_word(layer)], 0);
      const int64_t seen = hmoe::trace_now_ns();
      const uint32_t T = go & ~kMergedGo;
      const bool merged = (go & kMergedGo) != 0;
      const Link link = merged && layer < int(links_.size()) ? links_[layer] : Link{};
      int64_t ready = 0;  // merged: when the own output was complete (the engine sets done then)
      if (T == 0 || T > uint32_t(max_tokens_)) {
        record("layer " + std::to_string(layer) + ": the stream asked for " + std::to_string(T) + " tokens");
      } else if (Job* j = served_[size_t(layer) * max_tokens_ + T - 1]; merged && !link.partner) {
        record("layer " + std::to_string(layer) + ": a merged go, but no deferred part is linked (link_deferred)");
        std::memset(j->call.out, 0, j->l->out_row_bytes * T);
      } else if (link.partner) {
        serve_linked(j, link.partner->served_[size_t(link.layer) * max_tokens_ + T - 1], ready);
      } else {
        serve(j);
      }
      const int64_t done = hmoe::trace_now_ns();
      if (!ready) {
        ready = done;
        hmoe::store_flag(&flags_[done_word(layer)], 1);
      }
      note_layer(layer, look, seen, ready);
      if (link.partner) {
        hmoe::store_flag(&link.partner->flags_[link.partner->done_word(link.layer)], 1);
        link.partner->note_layer(link.layer, ready, ready, done, /*late=*/0);  // its CPU work: after the own part
      }
      served = true;
    }
    last_look_ns_ = hmoe::trace_now_ns();
    return served;
  }

  // Trace (moe_trace.h) the next `calls` calls of a layer, as the pipeline runs them (the poller's
  // or CUDA's thread), and take the records (CpuExperts.take_trace's dicts; call_ns is set too).
  void trace(int layer, int calls) {
    if (calls < 0) fail("trace takes a number of calls >= 0, got " + std::to_string(calls));
    layers_[checked(layer)]->moe->trace(calls);
  }
  nb::list take_trace(int layer) { return trace_records(layers_[checked(layer)]->moe->take_trace()); }

  int checked(int layer) const {
    if (layer < 0 || layer >= num_layers())
      fail("layer index " + std::to_string(layer) + " out of range for " + std::to_string(num_layers()) + " layers");
    return layer;
  }

  // Polling mode: what the poller saw since the last call (then zeroed), as {name: int}; see
  // Anatomy. The CPU work's own time inside a running pipeline, apart from the GPU's and the
  // handoff's.
  nb::dict take_stats() {
    Anatomy a;
    {
      std::lock_guard<std::mutex> lk(stats_mu_);
      std::swap(a, stats_);
    }
    nb::dict d;
    d["layers"] = a.layers;
    d["cpu_ns"] = a.cpu_ns;
    d["late_ns"] = a.late_ns;
    d["steps"] = a.steps;
    d["first_cpu_ns"] = a.first_cpu_ns;
    d["first_late_ns"] = a.first_late_ns;
    d["gaps"] = a.gaps;
    d["between_ns"] = a.between_ns;
    d["late_max_ns"] = a.late_max_ns;
    d["slow_lates"] = a.slow_lates;
    d["cpu_max_ns"] = a.cpu_max_ns;
    return d;
  }

  std::string mode() const { return polling_ ? "stream_mem_ops" : "host_function"; }

  // Read by the CPU work of every later call (set it between steps).
  bool trim_padding_ = false;
  // A knob of every layer's MoeLayer schedule (CpuExperts.set_schedule's names; set it between steps), so that
  // benchmarks can compare schedules in the running pipeline; schedule() reads the first layer's.
  static constexpr const char* kKnobs[] = {"item_blocks", "item_prefetch", "tail_split", "gate_up_tail",
                                           "balanced_items", "combine_in_run", "early_start", "paired",
                                           "padded_counters"};
  void set_schedule(const std::string& name, int value) {
    if (std::find(std::begin(kKnobs), std::end(kKnobs), name) == std::end(kKnobs))
      fail("unknown schedule knob '" + name + "'");
    if (value < 0) fail(name + " must be >= 0, got " + std::to_string(value));
    for (auto& l : layers_) {
      hmoe::MoeLayer& m = *l->moe;
      if (name == "item_blocks") m.set_item_blocks(value);
      else if (name == "item_prefetch") m.set_item_prefetch(value);
      else if (name == "tail_split") m.set_tail_split(value);
      else if (name == "gate_up_tail") m.set_gate_up_tail(value);
      else if (name == "balanced_items") m.set_balanced_items(value);
      else if (name == "combine_in_run") m.set_combine_in_run(value);
      else if (name == "early_start") m.set_early_start(value);
      else if (name == "paired") m.set_paired(value);
      else m.set_padded_counters(value);
    }
  }
  nb::dict schedule() const {
    if (layers_.empty()) fail("the handoff has no layer yet");
    const hmoe::MoeLayer& m = *layers_[0]->moe;
    nb::dict d;
    d["item_blocks"] = m.item_blocks();
    d["item_prefetch"] = m.item_prefetch();
    d["tail_split"] = m.tail_split();
    d["gate_up_tail"] = m.gate_up_tail();
    d["balanced_items"] = m.balanced_items();
    d["combine_in_run"] = m.combine_in_run();
    d["early_start"] = m.early_start();
    d["paired"] = m.paired();
    d["padded_counters"] = m.padded_counters();
    return d;
  }

  // The first failure a host function recorded since the last call (then cleared).
  std::optional<std::string> take_error() {
    std::lock_guard<std::mutex> lk(error_mu_);
    std::optional<std::string> e = std::move(error_);
    error_.reset();
    return e;
  }

  int num_layers() const { return int(layers_.size()); }
  int max_tokens() const { return max_tokens_; }
  int top_k() const { return top_k_; }

 private:
  Job* job(int layer, int T) {
    checked(layer);
    if (T < 1 || T > max_tokens_)
      fail("T must be between 1 and max_tokens (" + std::to_string(max_tokens_) + "), got " + std::to_string(T));
    auto& slot = jobs_[{layer, T}];
    if (!slot) {
      slot = std::make_unique<Job>();
      slot->owner = this;
      slot->layer = layer;
      slot->l = layers_[layer].get();
      slot->call = slot->l->base;
      slot->call.T = T;
    }
    return slot.get();
  }

  static void launch(uintptr_t stream, hmoe::CudaHostFn fn, Job* j) { hmoe::launch_host_func(stream, fn, j); }

  // Books one served layer: `look` is when this poll began, `seen` when it found the layer's go,
  // `done` when the layer's work ended (just before done was written). A step is a run of
  // layers in increasing order (a decode step serves its layers 0..n-1 once each), so a layer
  // not above the previous one starts a new step.
  // late: how late the go may have been seen, if known otherwise (a linked deferred part has no go).
  void note_layer(int layer, int64_t look, int64_t seen, int64_t done, int64_t late = -1) {
    const bool first = layer <= last_layer_;
    // The go was written after the poller's previous look at the flags, so it waited at most
    // this long to be seen (a poller napping between looks shows here).
    if (late < 0) late = last_look_ns_ ? look - last_look_ns_ : 0;
    std::lock_guard<std::mutex> lk(stats_mu_);
    Anatomy& a = stats_;
    a.layers += 1;
    a.cpu_ns += done - seen;
    a.late_ns += late;
    a.late_max_ns = std::max(a.late_max_ns, late);
    a.slow_lates += late > kSlowLateNs;
    a.cpu_max_ns = std::max(a.cpu_max_ns, done - seen);
    if (first || last_layer_ < 0) {
      a.steps += 1;
      a.first_cpu_ns += done - seen;
      a.first_late_ns += late;
    } else {
      a.gaps += 1;
      a.between_ns += seen - last_done_ns_;
    }
    last_layer_ = layer;
    last_done_ns_ = done;
  }

  void check_flags(const MutArray& flags) const {
    if (!in_host_memory(flags)) fail("flag words must be in host memory");
    if (flags.ndim() != 1 || flags.dtype().bits != 32 || flags.dtype().code == uint8_t(nb::dlpack::dtype_code::Float))
      fail("flag words must be a 1-d array of 32-bit integers");
    if (flags.shape(0) > 1 && flags.stride(0) != 1) fail("flag words must be contiguous");
    if (int64_t(flags.shape(0)) < flag_words())
      fail("flag words: " + std::to_string(flag_words()) + " needed for " + std::to_string(num_layers()) +
           " layers, got " + std::to_string(flags.shape(0)));
    if (reinterpret_cast<uintptr_t>(flags.data()) % 64) fail("flag words must start on a 64-byte boundary");
  }

  uint64_t flag_addr(int word) const {
    if (!flags_dev_) fail("the flag words are not device-mapped (start_polling with device_mapped=False)");
    return flags_dev_ + uint64_t(word) * 4;
  }

  void record(const std::string& msg) {
    std::lock_guard<std::mutex> lk(error_mu_);
    if (!error_) error_ = msg;
  }

  // A failure of job j's layer, for take_error().
  static void record_failure(Job& j, const std::string& what) {
    j.owner->record("layer " + std::to_string(j.layer) + ": " + what);
  }

  static int64_t id_at(const hmoe::MoeCall& c, int i) {
    return c.ids64 ? static_cast<const int64_t*>(c.ids)[i] : static_cast<const int32_t*>(c.ids)[i];
  }

  // The ids were written by the GPU: one out of range would make the engine index out of bounds.
  static bool ids_in_range(Job& j) {
    const int n = j.call.T * j.call.K;
    for (int i = 0; i < n; ++i) {
      const int64_t id = id_at(j.call, i);
      if (id < 0 || id >= j.l->E) {
        record_failure(j, "topk_ids[" + std::to_string(i / j.call.K) + ", " + std::to_string(i % j.call.K) +
                              "] = " + std::to_string(id) + " is out of range for " + std::to_string(j.l->E) +
                              " experts; its output was zeroed");
        return false;
      }
    }
    return true;
  }

  // The call to run: with trim_padding and one token, without its trailing slots of weight 0
  // (the padding of a row whose other experts are on the GPU: it repeats one of the row's own
  // experts, and adds 0 x its output). K 0: nothing to run, the output is zero.
  static hmoe::MoeCall trimmed(const Job& j) {
    hmoe::MoeCall c = j.call;
    if (j.owner->trim_padding_ && c.T == 1)
      while (c.K > 0 && c.weights[c.K - 1] == 0.0f) --c.K;
    return c;
  }

  // Polling mode: the whole layer on the calling thread; on failure the output is zeroed.
  static void serve(Job* p) noexcept {
    Job& j = *p;
    const hmoe::MoeCall c = trimmed(j);
    if (c.K > 0 && ids_in_range(j)) {
      try {
        j.l->moe->run(c);
        return;
      } catch (const std::exception& e) {
        record_failure(j, e.what());
      }
    }
    std::memset(j.call.out, 0, j.l->out_row_bytes * j.call.T);
  }

  // Polling mode, a linked layer (link_deferred): the own part (job o, this handoff's) and the deferred part
  // (job d, the partner's, same T) as one call. o's done word is set inside the call once o's output is
  // complete (ready_ns then says when); left 0 if it was not (a failure: the caller sets it). Both outputs
  // are zeroed on failure (out2 only after ready: the GPU may read out already).
  void serve_linked(Job* o, Job* d, int64_t& ready_ns) noexcept {
    const hmoe::MoeCall co = trimmed(*o), cd = trimmed(*d);
    const size_t row = o->l->out_row_bytes * co.T;
    if (!ids_in_range(*o) || !ids_in_range(*d) || co.K + cd.K == 0) {
      std::memset(o->call.out, 0, row);
      std::memset(d->call.out, 0, row);
      return;
    }
    // Each token's own slots, then its deferred ones (int64, as the staging of either may be int32).
    const int T = co.T, K = co.K + cd.K;
    merged_ids_.resize(size_t(T) * K);
    merged_w_.resize(size_t(T) * K);
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const hmoe::MoeCall& c = k < co.K ? co : cd;
        const int i = t * c.K + (k < co.K ? k : k - co.K);
        merged_ids_[size_t(t) * K + k] = id_at(c, i);
        merged_w_[size_t(t) * K + k] = c.weights[i];
      }
    hmoe::MoeCall m = co;
    m.K = K;
    m.deferred = cd.K;
    m.ids = merged_ids_.data();
    m.ids64 = true;
    m.weights = merged_w_.data();
    m.out2 = d->call.out;
    m.out_ready = &flags_[done_word(o->layer)];
    m.out_ready_ns = &ready_ns;
    if (cd.K == 0) std::memset(d->call.out, 0, row);  // no deferred slot left to compute: out2 sums nothing
    try {
      o->l->moe->run(m);
      return;
    } catch (const std::exception& e) {
      record_failure(*o, e.what());
    }
    if (!ready_ns) std::memset(o->call.out, 0, row);
    std::memset(d->call.out, 0, row);
  }

  static void submit_fn(void* p) noexcept {
    Job& j = *static_cast<Job*>(p);
    j.started = false;
    const hmoe::MoeCall c = trimmed(j);
    if (c.K == 0 || !ids_in_range(j)) return;
    try {
      j.ticket = j.l->moe->submit(c);
      j.started = true;
    } catch (const std::exception& e) {
      record_failure(j, e.what());
    }
  }

  static void wait_fn(void* p) noexcept {
    Job& j = *static_cast<Job*>(p);
    if (j.started) {
      j.started = false;
      try {
        j.l->moe->wait(j.ticket);
        return;
      } catch (const std::exception& e) {
        record_failure(j, e.what());
      }
    }
    std::memset(j.call.out, 0, j.l->out_row_bytes * j.call.T);
  }

  static void forward_fn(void* p) noexcept {
    submit_fn(p);
    wait_fn(p);
  }

  int max_tokens_, top_k_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::map<std::pair<int, int>, std::unique_ptr<Job>> jobs_;
  // Polling mode: the flag words (host address; device address, 0 if not mapped) and the packs
  // the poller serves, by layer * max_tokens + T - 1.
  bool polling_ = false;
  uint32_t* flags_ = nullptr;
  uint64_t flags_dev_ = 0;
  std::vector<Job*> served_;
  // link_deferred: per layer the partner handoff and its layer holding the deferred part (none: nullptr).
  struct Link {
    Handoff* partner = nullptr;
    int layer = -1;
  };
  std::vector<Link> links_;
  // serve_linked's merged rows, [T, K own + K deferred] (the poller's thread, or run()'s, never both at once).
  std::vector<int64_t> merged_ids_;
  std::vector<float> merged_w_;
  // What the poller saw of the steps it served, summed (nanoseconds of the steady clock).
  struct Anatomy {
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
  static constexpr int64_t kSlowLateNs = 20'000;
  std::mutex stats_mu_;
  Anatomy stats_;
  // The poller's own bookkeeping (only its thread touches these).
  int last_layer_ = -1;
  int64_t last_done_ns_ = 0, last_look_ns_ = 0;
  std::mutex error_mu_;
  std::optional<std::string> error_;
};

}  // namespace

void register_cuda_host(nb::module_& m) {
  m.def("load_cuda_runtime", [](const std::vector<std::string>& candidates) {
    return hmoe::load_cuda_runtime(candidates).path;
  }, "candidates"_a, "Load libcudart (dlopen) for host functions; returns the path or name loaded.");
  m.def("load_cuda_driver", []() { return hmoe::load_cuda_driver().path; },
        "Load libcuda (dlopen) for stream memory operations; returns the name loaded.");
  m.def("flag_poller_napping", []() { return hmoe::FlagPoller::instance().napping(); },
        "Whether the thread that answers the stream's flag words is idle past its spin window.");
  m.def("cuda_runtime_path", []() -> std::optional<std::string> {
    const hmoe::CudaRuntime* rt = hmoe::cuda_runtime();
    return rt ? std::optional<std::string>(rt->path) : std::nullopt;
  }, "The libcudart loaded by load_cuda_runtime, or None.");

  nb::class_<Handoff>(m, "CudaHandoff",
                      "Native host functions that run CPU expert layers in CUDA stream order "
                      "(see csrc/cuda_host_bindings.cpp).")
      .def(nb::init<int, int>(), "max_tokens"_a, "top_k"_a)
      .def("add_layer", &Handoff::add_layer, "E"_a, "H"_a, "I"_a, "format"_a, "group_size"_a, "zero_points"_a,
           "threads"_a, "isa"_a, "numa_nodes"_a, "buffers"_a, "x"_a, "ids"_a, "weights"_a, "out"_a,
           nb::keep_alive<1, 11>(), nb::keep_alive<1, 12>(), nb::keep_alive<1, 13>(), nb::keep_alive<1, 14>(),
           nb::keep_alive<1, 15>())
      .def("enqueue_submit", &Handoff::enqueue_submit, "stream"_a, "layer"_a, "T"_a)
      .def("enqueue_wait", &Handoff::enqueue_wait, "stream"_a, "layer"_a, "T"_a)
      .def("enqueue_forward", &Handoff::enqueue_forward, "stream"_a, "layer"_a, "T"_a)
      .def("run", &Handoff::run, "layers"_a, "T"_a)
      .def("link_deferred", &Handoff::link_deferred, "layer"_a, "partner"_a, "partner_layer"_a,
           nb::keep_alive<1, 3>())
      .def("probe_stream_mem_ops", &Handoff::probe_stream_mem_ops, "flags"_a)
      .def("help_until", &Handoff::help_until, "event"_a,
           "Work in the layers' pool as one more worker until the CUDA event (cudaEvent_t) completes.")
      .def("start_polling", &Handoff::start_polling, "flags"_a, "device_mapped"_a, nb::keep_alive<1, 2>())
      .def("go_word", [](const Handoff& h, int layer) { return h.go_word(h.checked(layer)); }, "layer"_a)
      .def("done_word", [](const Handoff& h, int layer) { return h.done_word(h.checked(layer)); }, "layer"_a)
      .def_prop_ro("flag_words", &Handoff::flag_words)
      .def_ro_static("merged_go", &Handoff::kMergedGo, "A go word's flag: run the linked deferred part along.")
      .def_prop_ro("mode", &Handoff::mode)
      .def_rw("trim_padding", &Handoff::trim_padding_,
              "One token: leave out its trailing slots of weight 0 (padding) instead of computing them.")
      .def("set_schedule", &Handoff::set_schedule, "name"_a, "value"_a,
           "One schedule knob (CpuExperts.set_schedule's names) of every layer.")
      .def("schedule", &Handoff::schedule, "The first layer's schedule knobs.")
      .def("take_stats", &Handoff::take_stats)
      .def("trace", &Handoff::trace, "layer"_a, "calls"_a)
      .def("take_trace", &Handoff::take_trace, "layer"_a)
      .def("take_error", &Handoff::take_error)
      .def_prop_ro("num_layers", &Handoff::num_layers)
      .def_prop_ro("max_tokens", &Handoff::max_tokens)
      .def_prop_ro("top_k", &Handoff::top_k);
}
