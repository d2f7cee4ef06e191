// hybridmoe._native.CudaHandoff: the CPU expert work of MoE layers ordered on a CUDA stream as
// native host functions (no Python, no GIL on the CUDA thread that runs them).
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
// stream order on CUDA's thread (or one after the other in run()).
struct Job {
  Handoff* owner;
  int layer;
  Layer* l;
  hmoe::MoeCall call;
  uint64_t ticket = 0;
  bool started = false;
};

class Handoff {
 public:
  Handoff(int max_tokens, int top_k) : max_tokens_(max_tokens), top_k_(top_k) {
    if (max_tokens < 1) fail("max_tokens must be >= 1, got " + std::to_string(max_tokens));
    if (top_k < 1) fail("top_k must be >= 1, got " + std::to_string(top_k));
  }

  ~Handoff() {
    // A submitted job still reads the staging buffers: let it finish before they go.
    for (auto& [key, job] : jobs_)
      if (job->started) try { job->l->moe->wait(job->ticket); } catch (...) {}
  }

  int add_layer(int E, int H, int I, const std::string& format, int group_size, bool zero_points, int threads,
                const std::string& isa, int numa_nodes, nb::dict buffers, MutArray x, MutArray ids,
                MutArray weights, MutArray out) {
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

  void enqueue_submit(uintptr_t stream, int layer, int T) { launch(stream, &submit_fn, job(layer, T)); }
  void enqueue_wait(uintptr_t stream, int layer, int T) { launch(stream, &wait_fn, job(layer, T)); }
  void enqueue_forward(uintptr_t stream, int layer, int T) { launch(stream, &forward_fn, job(layer, T)); }

  // The same host functions, called here in order (no CUDA): the CPU half of a step.
  void run(const std::vector<int>& layers, int T) {
    std::vector<Job*> jobs;
    for (int layer : layers) jobs.push_back(job(layer, T));
    nb::gil_scoped_release nogil;
    for (Job* j : jobs) forward_fn(j);
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
    if (layer < 0 || layer >= num_layers())
      fail("layer index " + std::to_string(layer) + " out of range for " + std::to_string(num_layers()) + " layers");
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

  void record(const std::string& msg) {
    std::lock_guard<std::mutex> lk(error_mu_);
    if (!error_) error_ = msg;
  }

  static int64_t id_at(const hmoe::MoeCall& c, int i) {
    return c.ids64 ? static_cast<const int64_t*>(c.ids)[i] : static_cast<const int32_t*>(c.ids)[i];
  }

  static void submit_fn(void* p) noexcept {
    Job& j = *static_cast<Job*>(p);
    j.started = false;
    const int n = j.call.T * j.call.K;
    for (int i = 0; i < n; ++i) {
      const int64_t id = id_at(j.call, i);
      if (id < 0 || id >= j.l->E) {
        j.owner->record("layer " + std::to_string(j.layer) + ": topk_ids[" + std::to_string(i / j.call.K) + ", " +
                        std::to_string(i % j.call.K) + "] = " + std::to_string(id) + " is out of range for " +
                        std::to_string(j.l->E) + " experts; its output was zeroed");
        return;
      }
    }
    try {
      j.ticket = j.l->moe->submit(j.call);
      j.started = true;
    } catch (const std::exception& e) {
      j.owner->record("layer " + std::to_string(j.layer) + ": " + e.what());
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
        j.owner->record("layer " + std::to_string(j.layer) + ": " + e.what());
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
  std::mutex error_mu_;
  std::optional<std::string> error_;
};

}  // namespace

void register_cuda_host(nb::module_& m) {
  m.def("load_cuda_runtime", [](const std::vector<std::string>& candidates) {
    return hmoe::load_cuda_runtime(candidates).path;
  }, "candidates"_a, "Load libcudart (dlopen) for host functions; returns the path or name loaded.");
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
      .def("take_error", &Handoff::take_error)
      .def_prop_ro("num_layers", &Handoff::num_layers)
      .def_prop_ro("max_tokens", &Handoff::max_tokens)
      .def_prop_ro("top_k", &Handoff::top_k);
}
