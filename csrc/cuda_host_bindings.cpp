// hybridmoe._native.CudaHandoff: the typed boundary of hmoe::CudaHandoff (csrc/runtime/cuda_handoff.h),
// and the CUDA library loaders of csrc/runtime/cuda_host.h. Arrays are checked here (host memory,
// shape, dtype, contiguity) and cross as raw pointers; integers from the Python side cross as int64_t
// and are range-checked here (binding_args.h); the GIL is released around the calls that compute or wait.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "binding_args.h"
#include "runtime/cuda_handoff.h"
#include "runtime/cuda_host.h"
#include "runtime/thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

nb::list trace_records(std::vector<hmoe::TraceCall> calls);  // csrc/bindings.cpp

namespace {

using MutArray = nb::ndarray<>;
using hmoe::CudaHandoff;
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

// The staging buffers of a layer of hidden size H.
hmoe::HandoffStaging staging_of(const CudaHandoff& h, int H, MutArray& x, MutArray& ids, MutArray& weights,
                                MutArray& out) {
  check_staging(x, "hidden staging", h.max_tokens(), H);
  const bool bf16 = x.dtype() == kBf16;
  if (!bf16 && x.dtype() != nb::dtype<float>()) fail("hidden staging must be bfloat16 or float32");
  check_staging(ids, "topk_ids staging", h.max_tokens(), h.top_k());
  const bool ids64 = ids.dtype() == nb::dtype<int64_t>();
  if (!ids64 && ids.dtype() != nb::dtype<int32_t>()) fail("topk_ids staging must be int32 or int64");
  check_staging(weights, "topk_weights staging", h.max_tokens(), h.top_k());
  if (weights.dtype() != nb::dtype<float>()) fail("topk_weights staging must be float32");
  check_staging(out, "output staging", h.max_tokens(), H);
  if (out.dtype() != x.dtype()) fail("output staging must have the hidden staging's dtype");
  return {x.data(), bf16, ids.data(), ids64, static_cast<const float*>(weights.data()), out.data()};
}

// {name: array} of packed buffers in host memory.
std::vector<hmoe::PackedBuffer> packed_buffers(const nb::dict& buffers) {
  std::vector<hmoe::PackedBuffer> out;
  for (auto [name, arr] : buffers) {
    auto a = nb::cast<MutArray>(arr);
    if (!in_host_memory(a)) fail("packed buffers must be in host memory");
    out.push_back({nb::cast<std::string>(name), a.data(), a.nbytes(), false});
  }
  return out;
}

int add_layer(CudaHandoff& h, int64_t E, int64_t H, int64_t I, const std::string& format, int64_t group_size,
              bool zero_points, int64_t threads, const std::string& isa, int64_t numa_nodes, nb::dict buffers,
              MutArray x, MutArray ids, MutArray weights, MutArray out) {
  const hmoe::MoeConfig cfg = moe_config(E, H, I, format, group_size, zero_points, threads, isa, numa_nodes);
  const hmoe::HandoffStaging staging = staging_of(h, cfg.H, x, ids, weights, out);
  // The layer's pool first (its MoeLayer takes the same shared one): a pool whose threads the system
  // refuses fails before the layer is added.
  const auto pool = hmoe::shared_pool(cfg.threads, cfg.numa_nodes);
  return h.add_layer(cfg, packed_buffers(buffers), staging);
}

// 1-d, 32-bit integers, contiguous, at least flag_words() of them, from a 64-byte boundary.
uint32_t* checked_flags(const CudaHandoff& h, MutArray& flags) {
  if (!in_host_memory(flags)) fail("flag words must be in host memory");
  if (flags.ndim() != 1 || flags.dtype().bits != 32 || flags.dtype().code == uint8_t(nb::dlpack::dtype_code::Float))
    fail("flag words must be a 1-d array of 32-bit integers");
  if (flags.shape(0) > 1 && flags.stride(0) != 1) fail("flag words must be contiguous");
  if (int64_t(flags.shape(0)) < h.flag_words())
    fail("flag words: " + std::to_string(h.flag_words()) + " needed for " + std::to_string(h.num_layers()) +
         " layers, got " + std::to_string(flags.shape(0)));
  if (reinterpret_cast<uintptr_t>(flags.data()) % 64) fail("flag words must start on a 64-byte boundary");
  return static_cast<uint32_t*>(flags.data());
}

nb::dict stats_dict(const hmoe::HandoffStats& a) {
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

void run(CudaHandoff& h, const std::vector<int>& layers, int64_t T) {
  if (T < 1 || T > h.max_tokens())
    fail("T must be between 1 and max_tokens (" + std::to_string(h.max_tokens()) + "), got " + std::to_string(T));
  const CudaHandoff::RunList jobs = h.prepare_run(layers, int(T));
  nb::gil_scoped_release nogil;
  h.run(jobs);
}

void help_until(CudaHandoff& h, uintptr_t event) {
  nb::gil_scoped_release nogil;
  h.help_until(event);
}

std::string probe_stream_mem_ops(const CudaHandoff& h, MutArray flags) {
  uint32_t* words = checked_flags(h, flags);
  nb::gil_scoped_release nogil;
  return hmoe::probe_stream_mem_ops(words);
}

void start_polling(CudaHandoff& h, MutArray flags, bool device_mapped) {
  h.start_polling(checked_flags(h, flags), device_mapped);
}

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

  nb::class_<CudaHandoff>(m, "CudaHandoff",
                          "Native host functions that run CPU expert layers in CUDA stream order "
                          "(see csrc/runtime/cuda_handoff.h).")
      .def("__init__", [](CudaHandoff* self, int64_t max_tokens, int64_t top_k) {
        new (self) CudaHandoff(int_arg(max_tokens, "max_tokens", 1, INT32_MAX), int_arg(top_k, "top_k", 1, INT32_MAX));
      }, "max_tokens"_a, "top_k"_a)
      .def("add_layer", &add_layer, "E"_a, "H"_a, "I"_a, "format"_a, "group_size"_a, "zero_points"_a,
           "threads"_a, "isa"_a, "numa_nodes"_a, "buffers"_a, "x"_a, "ids"_a, "weights"_a, "out"_a,
           nb::keep_alive<1, 11>(), nb::keep_alive<1, 12>(), nb::keep_alive<1, 13>(), nb::keep_alive<1, 14>(),
           nb::keep_alive<1, 15>())
      .def("enqueue_submit", &CudaHandoff::enqueue_submit, "stream"_a, "layer"_a, "T"_a)
      .def("enqueue_wait", &CudaHandoff::enqueue_wait, "stream"_a, "layer"_a, "T"_a)
      .def("enqueue_forward", &CudaHandoff::enqueue_forward, "stream"_a, "layer"_a, "T"_a)
      .def("run", &run, "layers"_a, "T"_a,
           "What the stream's CPU work does, in order and without CUDA (GIL released).")
      .def("link_deferred", &CudaHandoff::link_deferred, "layer"_a, "partner"_a, "partner_layer"_a,
           nb::keep_alive<1, 3>())
      .def("probe_stream_mem_ops", &probe_stream_mem_ops, "flags"_a)
      .def("help_until", &help_until, "event"_a,
           "Work in the layers' pool as one more worker until the CUDA event (cudaEvent_t) completes.")
      .def("start_polling", &start_polling, "flags"_a, "device_mapped"_a, nb::keep_alive<1, 2>())
      .def("go_word", &CudaHandoff::go_word, "layer"_a)
      .def("done_word", &CudaHandoff::done_word, "layer"_a)
      .def_prop_ro("flag_words", &CudaHandoff::flag_words)
      .def_ro_static("merged_go", &CudaHandoff::kMergedGo, "A go word's flag: run the linked deferred part along.")
      .def_prop_ro("mode", &CudaHandoff::mode)
      .def_prop_rw("trim_padding", &CudaHandoff::trim_padding, &CudaHandoff::set_trim_padding,
                   "One token: leave out its trailing slots of weight 0 (padding) instead of computing them.")
      .def_prop_rw("tuning", [](const CudaHandoff& h) { return h.tuning(); },
                   [](CudaHandoff& h, const hmoe::MoeTuning& t) { h.set_tuning(checked_tuning(t)); },
                   "Every layer's MoeTuning (reads the first layer's).")
      .def("take_stats", [](CudaHandoff& h) { return stats_dict(h.take_stats()); })
      .def("trace", &CudaHandoff::trace, "layer"_a, "calls"_a)
      .def("take_trace", [](CudaHandoff& h, int layer) { return trace_records(h.take_trace(layer)); }, "layer"_a)
      .def("take_error", &CudaHandoff::take_error)
      .def_prop_ro("num_layers", &CudaHandoff::num_layers)
      .def_prop_ro("max_tokens", &CudaHandoff::max_tokens)
      .def_prop_ro("top_k", &CudaHandoff::top_k);
}
