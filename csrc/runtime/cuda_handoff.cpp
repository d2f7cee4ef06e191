#include "runtime/cuda_handoff.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace hmoe {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t id_at(const MoeCall& c, int i) {
  return c.ids64 ? static_cast<const int64_t*>(c.ids)[i] : static_cast<const int32_t*>(c.ids)[i];
}

}  // namespace

// The argument pack of one (layer, T). ticket/started pass from submit to wait, which run in
// stream order on CUDA's thread (or one after the other in run()). In polling mode every pack
// exists from start_polling on (the poller reads them while Python may look them up).
struct CudaHandoff::Job {
  CudaHandoff* owner;
  int layer;
  Layer* l;
  MoeCall call;
  uint64_t ticket = 0;
  bool started = false;
};

CudaHandoff::CudaHandoff(int max_tokens, int top_k) : max_tokens_(max_tokens), top_k_(top_k) {
  if (max_tokens < 1) fail("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  if (top_k < 1) fail("top_k must be >= 1, got " + std::to_string(top_k));
}

CudaHandoff::~CudaHandoff() {
  if (polling_) FlagPoller::instance().remove(this);  // waits out a poll in progress
  // A submitted job still reads the staging buffers: let it finish before they go.
  for (auto& [key, job] : jobs_)
    if (job->started) try { job->l->moe->wait(job->ticket); } catch (...) {}
}

int CudaHandoff::add_layer(const MoeConfig& cfg, const std::vector<PackedBuffer>& buffers,
                           const HandoffStaging& staging) {
  if (polling_) fail("layers must be added before start_polling");
  if (top_k_ > cfg.E)
    fail("top_k " + std::to_string(top_k_) + " exceeds the layer's " + std::to_string(cfg.E) + " experts");
  auto l = std::make_unique<Layer>();
  l->moe = std::make_unique<MoeLayer>(cfg, /*adopt=*/true);
  for (const PackedBuffer& b : buffers) l->moe->set_buffer(b.name, b.data, b.bytes);
  const auto expected = l->moe->buffers();
  for (const auto& b : expected)
    if (!b.data) fail("packed buffer '" + b.name + "' is missing");
  if (buffers.size() != expected.size()) fail("packed buffers name one buffer twice");

  l->E = cfg.E;
  l->H = cfg.H;
  l->out_row_bytes = size_t(cfg.H) * (staging.x_bf16 ? 2 : 4);
  l->base.x = staging.x;
  l->base.x_bf16 = staging.x_bf16;
  l->base.K = top_k_;
  l->base.ids = staging.ids;
  l->base.ids64 = staging.ids64;
  l->base.weights = staging.weights;
  l->base.out = staging.out;
  layers_.push_back(std::move(l));
  return int(layers_.size()) - 1;
}

void CudaHandoff::enqueue_submit(uintptr_t stream, int layer, int T) {
  Job* j = job(layer, T);
  if (polling_) {
    stream_write_value32(stream, flag_addr(done_index(layer)), 0);
    stream_write_value32(stream, flag_addr(go_index(layer)), uint32_t(T));
  } else {
    launch_host_func(stream, &submit_fn, j);
  }
}

void CudaHandoff::enqueue_wait(uintptr_t stream, int layer, int T) {
  Job* j = job(layer, T);
  if (polling_) {
    stream_wait_value32(stream, flag_addr(done_index(layer)), 1);
  } else {
    launch_host_func(stream, &wait_fn, j);
  }
}

void CudaHandoff::enqueue_forward(uintptr_t stream, int layer, int T) {
  if (polling_) {
    enqueue_submit(stream, layer, T);
    enqueue_wait(stream, layer, T);
  } else {
    launch_host_func(stream, &forward_fn, job(layer, T));
  }
}

CudaHandoff::RunList CudaHandoff::prepare_run(const std::vector<int>& layers, int T) {
  RunList jobs;
  for (int layer : layers) {
    const CudaHandoff* partner = layer >= 0 && layer < int(links_.size()) ? links_[layer].partner : nullptr;
    jobs.emplace_back(job(layer, T), partner ? links_[layer].partner->job(links_[layer].layer, T) : nullptr);
  }
  return jobs;
}

void CudaHandoff::run(const RunList& jobs) {
  for (auto [j, d] : jobs) {
    int64_t ready = 0;
    if (d) serve_linked(j, d, ready);
    else polling_ ? serve(j) : forward_fn(j);
  }
}

void CudaHandoff::help_until(uintptr_t event) {
  if (layers_.empty()) fail("help_until needs a layer");
  layers_[0]->moe->pool().help([event] { return event_done(event); });
}

void CudaHandoff::start_polling(uint32_t* flags, bool device_mapped) {
  if (polling_) fail("start_polling was called twice");
  if (layers_.empty()) fail("add the layers before start_polling");
  flags_ = flags;
  if (device_mapped) flags_dev_ = host_device_pointer(flags_);
  std::memset(flags_, 0, size_t(flag_words()) * 4);
  served_.assign(size_t(num_layers()) * max_tokens_, nullptr);
  for (int layer = 0; layer < num_layers(); ++layer)
    for (int T = 1; T <= max_tokens_; ++T) served_[size_t(layer) * max_tokens_ + T - 1] = job(layer, T);
  polling_ = true;
  const MoeConfig& cfg = layers_[0]->moe->config();
  FlagPoller::instance().pin(shared_pool(cfg.threads, cfg.numa_nodes)->driver_cpu());
  FlagPoller::instance().add(this);
}

void CudaHandoff::link_deferred(int layer, CudaHandoff& partner, int partner_layer) {
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

bool CudaHandoff::poll() {
  bool served_any = false;
  const int64_t look = trace_now_ns();
  for (int layer = 0; layer < num_layers(); ++layer) {
    const uint32_t go = load_flag(&flags_[go_index(layer)]);
    if (go == 0) continue;
    store_flag(&flags_[go_index(layer)], 0);
    serve_go(layer, go, look);
    served_any = true;
  }
  last_look_ns_ = trace_now_ns();
  return served_any;
}

// One go word's work: the layer's T rows (a merged go: with its linked deferred part), then its
// done word (unless the merged call set it already) and the partner's.
void CudaHandoff::serve_go(int layer, uint32_t go, int64_t look) {
  const int64_t seen = trace_now_ns();
  const uint32_t T = go & ~kMergedGo;
  const bool merged = (go & kMergedGo) != 0;
  const Link link = merged && layer < int(links_.size()) ? links_[layer] : Link{};
  int64_t ready = 0;  // merged: when the own output was complete (the engine sets done then)
  if (T == 0 || T > uint32_t(max_tokens_)) {
    record("layer " + std::to_string(layer) + ": the stream asked for " + std::to_string(T) + " tokens");
  } else if (Job* j = served(layer, T); merged && !link.partner) {
    record("layer " + std::to_string(layer) + ": a merged go, but no deferred part is linked (link_deferred)");
    std::memset(j->call.out, 0, j->l->out_row_bytes * T);
  } else if (link.partner) {
    serve_linked(j, link.partner->served(link.layer, T), ready);
  } else {
    serve(j);
  }
  const int64_t done = trace_now_ns();
  if (!ready) {
    ready = done;
    store_flag(&flags_[done_index(layer)], 1);
  }
  note_layer(layer, look, seen, ready);
  if (link.partner) {
    store_flag(&link.partner->flags_[done_index(link.layer)], 1);
    link.partner->note_layer(link.layer, ready, ready, done, /*late=*/0);  // its CPU work: after the own part
  }
}

void CudaHandoff::trace(int layer, int calls) {
  if (calls < 0) fail("trace takes a number of calls >= 0, got " + std::to_string(calls));
  layers_[checked(layer)]->moe->trace(calls);
}

std::vector<TraceCall> CudaHandoff::take_trace(int layer) { return layers_[checked(layer)]->moe->take_trace(); }

int CudaHandoff::checked(int layer) const {
  if (layer < 0 || layer >= num_layers())
    fail("layer index " + std::to_string(layer) + " out of range for " + std::to_string(num_layers()) + " layers");
  return layer;
}

HandoffStats CudaHandoff::take_stats() {
  HandoffStats a;
  std::lock_guard<std::mutex> lk(stats_mu_);
  std::swap(a, stats_);
  return a;
}

void CudaHandoff::set_tuning(const MoeTuning& t) {
  for (auto& l : layers_) l->moe->set_tuning(t);
}

const MoeTuning& CudaHandoff::tuning() const {
  if (layers_.empty()) fail("the handoff has no layer yet");
  return layers_[0]->moe->tuning();
}

std::optional<std::string> CudaHandoff::take_error() {
  std::lock_guard<std::mutex> lk(error_mu_);
  std::optional<std::string> e = std::move(error_);
  error_.reset();
  return e;
}

CudaHandoff::Job* CudaHandoff::job(int layer, int T) {
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

// Books one served layer: `look` is when this poll began, `seen` when it found the layer's go,
// `done` when the layer's work ended (just before done was written). A step is a run of
// layers in increasing order (a decode step serves its layers 0..n-1 once each), so a layer
// not above the previous one starts a new step.
// late: how late the go may have been seen, if known otherwise (a linked deferred part has no go).
void CudaHandoff::note_layer(int layer, int64_t look, int64_t seen, int64_t done, int64_t late) {
  const bool first = layer <= last_layer_;
  // The go was written after the poller's previous look at the flags, so it waited at most
  // this long to be seen (a poller napping between looks shows here).
  if (late < 0) late = last_look_ns_ ? look - last_look_ns_ : 0;
  std::lock_guard<std::mutex> lk(stats_mu_);
  HandoffStats& a = stats_;
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

uint64_t CudaHandoff::flag_addr(int word) const {
  if (!flags_dev_) fail("the flag words are not device-mapped (start_polling with device_mapped=False)");
  return flags_dev_ + uint64_t(word) * 4;
}

void CudaHandoff::record(const std::string& msg) {
  std::lock_guard<std::mutex> lk(error_mu_);
  if (!error_) error_ = msg;
}

// A failure of job j's layer, for take_error().
void CudaHandoff::record_failure(Job& j, const std::string& what) {
  j.owner->record("layer " + std::to_string(j.layer) + ": " + what);
}

// The ids were written by the GPU: one out of range would make the engine index out of bounds.
bool CudaHandoff::ids_in_range(Job& j) {
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

// The call to run: with trim_padding and one token, without its trailing slots of weight 0.
// K 0: nothing to run, the output is zero.
MoeCall CudaHandoff::trimmed(const Job& j) {
  MoeCall c = j.call;
  if (j.owner->trim_padding_ && c.T == 1)
    while (c.K > 0 && c.weights[c.K - 1] == 0.0f) --c.K;
  return c;
}

// Polling mode: the whole layer on the calling thread; on failure the output is zeroed.
void CudaHandoff::serve(Job* p) noexcept {
  Job& j = *p;
  const MoeCall c = trimmed(j);
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

// Each token's own slots (co), then its deferred ones (cd), in one call whose ids are int64 (the
// staging of either may be int32); out2 is cd's output.
MoeCall CudaHandoff::merged_call(const MoeCall& co, const MoeCall& cd) {
  const int T = co.T, K = co.K + cd.K;
  merged_ids_.resize(size_t(T) * K);
  merged_w_.resize(size_t(T) * K);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const MoeCall& c = k < co.K ? co : cd;
      const int i = t * c.K + (k < co.K ? k : k - co.K);
      merged_ids_[size_t(t) * K + k] = id_at(c, i);
      merged_w_[size_t(t) * K + k] = c.weights[i];
    }
  MoeCall m = co;
  m.K = K;
  m.deferred = cd.K;
  m.ids = merged_ids_.data();
  m.ids64 = true;
  m.weights = merged_w_.data();
  m.out2 = cd.out;
  return m;
}

// Polling mode, a linked layer (link_deferred): the own part (job o, this handoff's) and the deferred part
// (job d, the partner's, same T) as one call. o's done word is set inside the call once o's output is
// complete (ready_ns then says when); left 0 if it was not (a failure: the caller sets it). Both outputs
// are zeroed on failure (out2 only after ready: the GPU may read out already).
void CudaHandoff::serve_linked(Job* o, Job* d, int64_t& ready_ns) noexcept {
  const MoeCall co = trimmed(*o), cd = trimmed(*d);
  const size_t row = o->l->out_row_bytes * co.T;
  if (!ids_in_range(*o) || !ids_in_range(*d) || co.K + cd.K == 0) {
    std::memset(o->call.out, 0, row);
    std::memset(d->call.out, 0, row);
    return;
  }
  MoeCall m = merged_call(co, cd);
  m.out_ready = &flags_[done_index(o->layer)];
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

void CudaHandoff::submit_fn(void* p) noexcept {
  Job& j = *static_cast<Job*>(p);
  j.started = false;
  const MoeCall c = trimmed(j);
  if (c.K == 0 || !ids_in_range(j)) return;
  try {
    j.ticket = j.l->moe->submit(c);
    j.started = true;
  } catch (const std::exception& e) {
    record_failure(j, e.what());
  }
}

void CudaHandoff::wait_fn(void* p) noexcept {
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

void CudaHandoff::forward_fn(void* p) noexcept {
  submit_fn(p);
  wait_fn(p);
}

}  // namespace hmoe
