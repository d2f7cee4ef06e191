// The Python module hybridmoe._native. Arrays cross this boundary as nb::ndarray views
// (DLPack: torch tensors and numpy arrays go in directly); shape, dtype, contiguity and device
// are checked here and raw pointers exist only below the checks. Integers cross as int64_t and are
// range-checked here (binding_args.h). Bad input raises ValueError, one line naming the argument.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_args.h"
#include "moe/moe_layer.h"
#include "moe/pack_codes.h"
#include "runtime/cpu_features.h"
#include "runtime/pool_help_check.h"
#include "runtime/read_bandwidth.h"
#include "runtime/thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

nb::list trace_records(std::vector<hmoe::TraceCall> calls);  // below

namespace {

using Array = nb::ndarray<nb::ro>;
using MutArray = nb::ndarray<>;
using namespace hmoe::args;

// A numpy array that owns `v` (freed with the array).
template <class T>
nb::ndarray<nb::numpy, T> owned_array(std::vector<T>* v, std::initializer_list<size_t> shape) {
  nb::capsule owner(v, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(v->data(), shape.size(), shape.begin(), owner);
}

std::string dtype_name(nb::dlpack::dtype d) {
  const char* kind[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  return std::string(d.code < 7 ? kind[d.code] : "?") + std::to_string(d.bits);
}

template <class A>
std::string shape_of(const A& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// Checks device, rank, exact shape (-1: any) and C-contiguity. The shape is an initializer list,
// not a vector: four checks per forward() would otherwise allocate four times.
template <class A>
void check_array(const A& a, const char* what, std::initializer_list<int64_t> shape_list) {
  const int64_t* shape = shape_list.begin();
  if (a.device_type() != nb::device::cpu::value)
    fail(std::string(what) + " must be a CPU tensor (got one on another device); copy it with .cpu() first");
  if (a.ndim() != shape_list.size())
    fail(std::string(what) + " must have " + std::to_string(shape_list.size()) + " dimensions, got shape " +
         shape_of(a));
  for (size_t i = 0; i < shape_list.size(); ++i)
    if (shape[i] >= 0 && int64_t(a.shape(i)) != shape[i]) {
      std::string want = "[";
      for (size_t j = 0; j < shape_list.size(); ++j)
        want += (j ? ", " : "") + (shape[j] < 0 ? std::string("*") : std::to_string(shape[j]));
      fail(std::string(what) + " has shape " + shape_of(a) + ", expected " + want + "]");
    }
  int64_t stride = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != stride)
      fail(std::string(what) + " must be contiguous; call .contiguous() first");
    stride *= int64_t(a.shape(i));
  }
}

void check_dtype(const nb::dlpack::dtype& got, const nb::dlpack::dtype& want, const char* what) {
  if (got != want) fail(std::string(what) + " must be " + dtype_name(want) + ", got " + dtype_name(got));
}

// check_array, then float32.
template <class A>
void check_f32(const A& a, const char* what, std::initializer_list<int64_t> shape) {
  check_array(a, what, shape);
  check_dtype(a.dtype(), nb::dtype<float>(), what);
}

// The read-bandwidth probes' thread count: past kMaxThreads refused here, below 1 by the probe's own check.
int probe_threads(int64_t threads) {
  if (threads > kMaxThreads)
    fail("threads must be at most " + std::to_string(kMaxThreads) + ", got " + std::to_string(threads));
  return int(std::max<int64_t>(threads, 0));
}

class Engine {
 public:
  Engine(int64_t E, int64_t H, int64_t I, const std::string& format, int64_t group_size, bool zero_points,
         int64_t threads, const std::string& isa, int64_t numa_nodes, bool adopt)
      : Engine(moe_config(E, H, I, format, group_size, zero_points, threads, isa, numa_nodes), adopt) {}
  // The pool first (the layer takes the same shared one): a pool whose threads the system refuses
  // fails before the layer maps its buffers.
  Engine(const hmoe::MoeConfig& cfg, bool adopt)
      : pool_(hmoe::shared_pool(cfg.threads, cfg.numa_nodes)), layer_(std::make_unique<hmoe::MoeLayer>(cfg, adopt)) {}

  const hmoe::MoeConfig& cfg() const { return layer_->config(); }

  // One expert's float32 matrices: gate and up [I, H], down [H, I].
  template <class A>
  void check_expert_matrices(int64_t e, const A& gate, const A& up, const A& down) const {
    check_expert(e);
    const auto& c = cfg();
    check_f32(gate, "gate", {c.I, c.H});
    check_f32(up, "up", {c.I, c.H});
    check_f32(down, "down", {c.H, c.I});
  }

  void pack_expert(int64_t e, Array gate, Array up, Array down) {
    check_expert_matrices(e, gate, up, down);
    nb::gil_scoped_release nogil;
    layer_->pack_expert(int(e), static_cast<const float*>(gate.data()), static_cast<const float*>(up.data()),
                        static_cast<const float*>(down.data()));
  }

  // mats: codes uint8 [N, K], scales and (with zero points) zeros fp32 [N, K / group], of gate, up and down in
  // turn: 9 arrays for a layer with zero points, 6 for one without.
  void pack_expert_codes(int64_t e, std::vector<Array> mats) {
    check_expert(e);
    const auto& c = cfg();
    const int per = c.zero_points ? 3 : 2;
    if (int(mats.size()) != 3 * per)
      fail(c.zero_points ? "pack_expert_codes takes 9 arrays (codes, scales, zeros of gate, up, down)"
                         : "pack_expert_codes takes 6 arrays (codes, scales of gate, up, down) without zero points");
    hmoe::CodesMatrix m[3];
    for (int i = 0; i < 3; ++i) {
      const int64_t N = i < 2 ? c.I : c.H, K = i < 2 ? c.H : c.I;
      const std::string name = i == 0 ? "gate" : i == 1 ? "up" : "down";
      check_array(mats[per * i], (name + " codes").c_str(), {N, K});
      check_dtype(mats[per * i].dtype(), nb::dtype<uint8_t>(), (name + " codes").c_str());
      for (int j = 1; j < per; ++j) {
        const std::string what = name + (j == 1 ? " scales" : " zeros");
        check_array(mats[per * i + j], what.c_str(), {N, K / c.group});
        check_dtype(mats[per * i + j].dtype(), nb::dtype<float>(), what.c_str());
      }
      m[i] = {static_cast<const uint8_t*>(mats[per * i].data()), static_cast<const float*>(mats[per * i + 1].data()),
              c.zero_points ? static_cast<const float*>(mats[per * i + 2].data()) : nullptr};
    }
    nb::gil_scoped_release nogil;
    hmoe::pack_expert_codes(*layer_, int(e), m);
  }

  // mats: codes uint8 [N, K] (float8_e4m3fn bits) and scales fp32 [ceil(N / 128), ceil(K / 128)], of gate, up
  // and down in turn.
  void pack_expert_fp8(int64_t e, std::vector<Array> mats) {
    check_expert(e);
    const auto& c = cfg();
    if (mats.size() != 6) fail("pack_expert_fp8 takes 6 arrays (codes and scales of gate, up, down)");
    hmoe::Fp8Codes m[3];
    for (int i = 0; i < 3; ++i) {
      const int64_t N = i < 2 ? c.I : c.H, K = i < 2 ? c.H : c.I, G = hmoe::kFp8GroupK;
      const std::string name = i == 0 ? "gate" : i == 1 ? "up" : "down";
      check_array(mats[2 * i], (name + " codes").c_str(), {N, K});
      check_dtype(mats[2 * i].dtype(), nb::dtype<uint8_t>(), (name + " codes").c_str());
      check_array(mats[2 * i + 1], (name + " scales").c_str(), {(N + G - 1) / G, (K + G - 1) / G});
      check_dtype(mats[2 * i + 1].dtype(), nb::dtype<float>(), (name + " scales").c_str());
      m[i] = {static_cast<const uint8_t*>(mats[2 * i].data()), static_cast<const float*>(mats[2 * i + 1].data())};
    }
    nb::gil_scoped_release nogil;
    layer_->pack_expert_fp8(int(e), m);
  }

  // mats: codes uint8 [N, K / 2] (two e2m1 codes a byte, the even k's in the low nibble) and scales uint8
  // [N, K / 32] (e8m0), of gate, up and down in turn.
  void pack_expert_mxfp4(int64_t e, std::vector<Array> mats) {
    check_expert(e);
    const auto& c = cfg();
    if (mats.size() != 6) fail("pack_expert_mxfp4 takes 6 arrays (codes and scales of gate, up, down)");
    hmoe::Mxfp4Codes m[3];
    for (int i = 0; i < 3; ++i) {
      const int64_t N = i < 2 ? c.I : c.H, K = i < 2 ? c.H : c.I;
      const std::string name = i == 0 ? "gate" : i == 1 ? "up" : "down";
      check_array(mats[2 * i], (name + " codes").c_str(), {N, K / 2});
      check_dtype(mats[2 * i].dtype(), nb::dtype<uint8_t>(), (name + " codes").c_str());
      check_array(mats[2 * i + 1], (name + " scales").c_str(), {N, K / hmoe::kMxfp4GroupK});
      check_dtype(mats[2 * i + 1].dtype(), nb::dtype<uint8_t>(), (name + " scales").c_str());
      m[i] = {static_cast<const uint8_t*>(mats[2 * i].data()), static_cast<const uint8_t*>(mats[2 * i + 1].data())};
    }
    nb::gil_scoped_release nogil;
    layer_->pack_expert_mxfp4(int(e), m);
  }

  // kind "silu" (alpha and limit unused) or "clamped_swiglu"; between calls.
  void set_glu(const std::string& kind, double alpha, double limit) {
    if (kind != "silu" && kind != "clamped_swiglu")
      fail("unknown expert activation '" + kind + "'; choose silu or clamped_swiglu");
    layer_->set_glu(kind == "silu" ? hmoe::GluKind::silu : hmoe::GluKind::clamped_swiglu, float(alpha), float(limit));
  }

  // fp32 gate and up biases [E, I], down [E, H]; copied, between calls.
  void set_biases(Array gate, Array up, Array down) {
    const auto& c = cfg();
    check_f32(gate, "gate_bias", {c.E, c.I});
    check_f32(up, "up_bias", {c.E, c.I});
    check_f32(down, "down_bias", {c.E, c.H});
    layer_->set_biases(static_cast<const float*>(gate.data()), static_cast<const float*>(up.data()),
                       static_cast<const float*>(down.data()));
  }

  void unpack_expert(int64_t e, MutArray gate, MutArray up, MutArray down) {
    check_expert_matrices(e, gate, up, down);
    layer_->unpack_expert(int(e), static_cast<float*>(gate.data()), static_cast<float*>(up.data()),
                          static_cast<float*>(down.data()));
  }

  nb::dict buffers(nb::handle self) {
    nb::dict out;
    for (const auto& b : layer_->buffers()) {
      if (b.is_float) {
        size_t shape[1] = {b.bytes / 4};
        out[b.name.c_str()] = nb::ndarray<nb::numpy, float>(b.data, 1, shape, self);
      } else {
        size_t shape[1] = {b.bytes};
        out[b.name.c_str()] = nb::ndarray<nb::numpy, uint8_t>(b.data, 1, shape, self);
      }
    }
    return out;
  }

  void set_buffer(const std::string& name, MutArray a) {
    check_array(a, ("packed buffer '" + name + "'").c_str(), {-1});
    layer_->set_buffer(name, a.data(), a.nbytes());
  }

  uint64_t submit(Array x, Array ids, Array weights, MutArray out) { return layer_->submit(make_call(x, ids, weights, out)); }

  void run(Array x, Array ids, Array weights, MutArray out) {
    const hmoe::MoeCall call = make_call(x, ids, weights, out);
    nb::gil_scoped_release nogil;
    layer_->run(call);
  }

  // run() / submit() with each token's last `deferred` slots summed into out2 instead of out (MoeCall::deferred).
  void run_deferred(Array x, Array ids, Array weights, int64_t deferred, MutArray out, MutArray out2) {
    const hmoe::MoeCall call = deferred_call(x, ids, weights, deferred, out, out2);
    nb::gil_scoped_release nogil;
    layer_->run(call);
  }
  uint64_t submit_deferred(Array x, Array ids, Array weights, int64_t deferred, MutArray out, MutArray out2) {
    return layer_->submit(deferred_call(x, ids, weights, deferred, out, out2));
  }

  // The gradients of x (into grad_x, x's dtype) and of the routing weights (into grad_weights, fp32 [T, K]) given
  // grad_out [T, H] (fp32 or bf16); x, ids and weights checked as a forward call's (MoeLayer::backward).
  void backward(Array x, Array ids, Array weights, Array grad_out, MutArray grad_x, MutArray grad_weights,
                int64_t chunk_tokens) {
    const hmoe::MoeCall fwd = make_call(x, ids, weights, grad_x);
    check_array(grad_out, "grad_out", {fwd.T, cfg().H});
    if (grad_out.dtype() != kBf16 && grad_out.dtype() != nb::dtype<float>())
      fail("grad_out must be bfloat16 or float32, got " + dtype_name(grad_out.dtype()));
    check_f32(grad_weights, "grad_weights", {fwd.T, fwd.K});
    hmoe::MoeBackwardCall call;
    call.x = fwd.x;
    call.x_bf16 = fwd.x_bf16;
    call.T = fwd.T;
    call.K = fwd.K;
    call.ids = fwd.ids;
    call.ids64 = fwd.ids64;
    call.weights = fwd.weights;
    call.grad_out = grad_out.data();
    call.grad_out_bf16 = grad_out.dtype() == kBf16;
    call.grad_x = grad_x.data();
    call.grad_weights = static_cast<float*>(grad_weights.data());
    call.chunk_tokens = int_arg(chunk_tokens, "chunk_tokens", 0, INT32_MAX);
    nb::gil_scoped_release nogil;
    layer_->backward(call);
  }

  hmoe::MoeCall deferred_call(Array& x, Array& ids, Array& weights, int64_t deferred, MutArray& out,
                              MutArray& out2) {
    hmoe::MoeCall call = make_call(x, ids, weights, out);
    if (deferred < 0 || deferred > call.K)
      fail("deferred must be between 0 and the " + std::to_string(call.K) + " slots per token, got " +
           std::to_string(deferred));
    check_array(out2, "out2", {call.T, cfg().H});
    check_dtype(out2.dtype(), x.dtype(), "out2");
    call.deferred = int(deferred);
    call.out2 = out2.data();
    if (deferred == 0) std::memset(out2.data(), 0, out2.nbytes());  // no deferred slot: out2 sums nothing
    return call;
  }

  hmoe::MoeCall make_call(Array& x, Array& ids, Array& weights, MutArray& out) {
    const auto& c = cfg();
    check_array(x, "x", {-1, c.H});
    const bool bf16 = x.dtype() == kBf16;
    if (!bf16 && x.dtype() != nb::dtype<float>())
      fail("x must be bfloat16 or float32, got " + dtype_name(x.dtype()));
    const int64_t T = x.shape(0);
    check_array(ids, "topk_ids", {T, -1});
    const int64_t K = ids.shape(1);
    if (K < 1 || K > c.E)
      fail("topk_ids must have between 1 and " + std::to_string(c.E) + " columns, got " + std::to_string(K));
    const bool ids64 = ids.dtype() == nb::dtype<int64_t>();
    if (!ids64 && ids.dtype() != nb::dtype<int32_t>())
      fail("topk_ids must be int32 or int64, got " + dtype_name(ids.dtype()));
    check_array(weights, "topk_weights", {T, K});
    check_dtype(weights.dtype(), nb::dtype<float>(), "topk_weights");
    check_array(out, "out", {T, c.H});
    check_dtype(out.dtype(), x.dtype(), "out");
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t id = ids64 ? static_cast<const int64_t*>(ids.data())[t * K + k]
                                 : static_cast<const int32_t*>(ids.data())[t * K + k];
        if (id < 0 || id >= c.E)
          fail("topk_ids[" + std::to_string(t) + ", " + std::to_string(k) + "] = " + std::to_string(id) +
               " is out of range for " + std::to_string(c.E) + " experts");
        // A slot of weight 0 may repeat an expert (padding: it adds nothing; the hybrid split pads so).
        const float* w = static_cast<const float*>(weights.data()) + t * K;
        for (int64_t k2 = 0; k2 < k && w[k] != 0.0f; ++k2) {
          const int64_t other = ids64 ? static_cast<const int64_t*>(ids.data())[t * K + k2]
                                      : static_cast<const int32_t*>(ids.data())[t * K + k2];
          if (other == id && w[k2] != 0.0f)
            fail("token " + std::to_string(t) + " lists expert " + std::to_string(id) +
                 " twice in topk_ids; each token's experts must be distinct (but in slots of weight 0)");
        }
      }
    hmoe::MoeCall call;
    call.x = x.data();
    call.x_bf16 = bf16;
    call.T = int(T);
    call.K = int(K);
    call.ids = ids.data();
    call.ids64 = ids64;
    call.weights = static_cast<const float*>(weights.data());
    call.out = out.data();
    return call;
  }

  void wait(uint64_t ticket) {
    nb::gil_scoped_release nogil;
    layer_->wait(ticket);
  }

  void prewake() { layer_->prewake(); }

  // MoeLayer::prefetch of the experts listed in `experts` (int32 [n]); returns the bytes fetched.
  size_t prefetch(Array experts) {
    check_array(experts, "experts", {-1});
    check_dtype(experts.dtype(), nb::dtype<int32_t>(), "experts");
    const int n = int(experts.shape(0));
    const int* ids = static_cast<const int*>(experts.data());
    for (int i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= cfg().E)
        fail("experts[" + std::to_string(i) + "] = " + std::to_string(ids[i]) + " is out of range for " +
             std::to_string(cfg().E) + " experts");
    nb::gil_scoped_release nogil;
    return layer_->prefetch(ids, n);
  }

  hmoe::MoeLayer& layer() { return *layer_; }
  const hmoe::MoeLayer& layer() const { return *layer_; }

  void trace(int64_t calls) {
    if (calls < 0) fail("trace takes a number of calls >= 0, got " + std::to_string(calls));
    layer_->trace(int_arg(calls, "calls", 0, INT32_MAX));
  }

  nb::list take_trace() { return trace_records(layer_->take_trace()); }

 private:
  void check_expert(int64_t e) const {
    if (e < 0 || e >= cfg().E)
      fail("expert index " + std::to_string(e) + " out of range for " + std::to_string(cfg().E) + " experts");
  }
  std::shared_ptr<hmoe::ThreadPool> pool_;
  std::unique_ptr<hmoe::MoeLayer> layer_;
};

}  // namespace

// The traced calls (moe_trace.h) as dicts: phase times (ns, time.monotonic_ns's clock),
// items int64 [n, 11] (worker, down, expert, slice, b0, b1, start, end, wait, convert, deferred),
// join_ns int64 [threads] and slept uint8 [threads]. Also CudaHandoff.take_trace's.
nb::list trace_records(std::vector<hmoe::TraceCall> calls) {
  nb::list out;
  for (hmoe::TraceCall& t : calls) {
    nb::dict d;
    d["T"] = t.T;
    d["K"] = t.K;
    d["A"] = t.A;
    d["call_ns"] = t.call_ns;
    d["entry_ns"] = t.entry_ns;
    d["grouped_ns"] = t.grouped_ns;
    d["acts_ns"] = t.acts_ns;
    d["items_ns"] = t.items_ns;
    d["gemm_end_ns"] = t.gemm_end_ns;
    d["end_ns"] = t.end_ns;
    d["ready_ns"] = t.ready_ns;
    auto* items = new std::vector<int64_t>();
    for (const hmoe::TraceItem& it : t.items)
      items->insert(items->end(), {it.worker, it.down, it.expert, it.slice, it.b0, it.b1, it.start_ns, it.end_ns,
                                   it.wait_ns, it.convert_ns, it.deferred});
    d["items"] = owned_array(items, {t.items.size(), 11});
    d["join_ns"] = owned_array(new std::vector<int64_t>(t.join_ns), {t.join_ns.size()});
    d["slept"] = owned_array(new std::vector<uint8_t>(t.slept), {t.slept.size()});
    out.append(d);
  }
  return out;
}

void register_cuda_host(nb::module_& m);  // csrc/cuda_host_bindings.cpp

NB_MODULE(_native, m) {
  m.doc() = "hybridmoe native CPU expert engine";
  m.def("cpu_features", [] {
    const auto& f = hmoe::cpu_features();
    return std::map<std::string, bool>{
        {"avx2", f.avx2 && f.fma},     {"avx512f", f.avx512f},         {"avx512bw", f.avx512bw},
        {"avx512vl", f.avx512vl},      {"avx512_bf16", f.avx512_bf16}, {"avx512_vnni", f.avx512_vnni},
        {"avx512_fp16", f.avx512_fp16}, {"amx_tile", f.amx_tile},       {"amx_bf16", f.amx_bf16},
        {"amx_int8", f.amx_int8}};
  }, "What this CPU supports (cpuid, and for AMX whether the OS enables tile state).");
  m.def("available_isas", &available_isas, "Kernel paths this CPU can run, slowest first.");
  m.def("numa_node_count", &hmoe::numa_node_count);
  m.def("allowed_cpu_count", [] { return int(hmoe::allowed_cpus().size()); },
        "CPUs this process may run on (its affinity mask).");
  m.attr("max_threads") = kMaxThreads;
  m.def("read_bandwidth", [](size_t nbytes, int64_t threads, int passes, int rounds, bool prefetch) {
    const int n = probe_threads(threads);
    nb::gil_scoped_release nogil;
    return hmoe::read_bandwidth(nbytes, n, passes, rounds, prefetch);
  }, "nbytes"_a, "threads"_a, "passes"_a = 5, "rounds"_a = 3, "prefetch"_a = false,
        "Host read bytes/s on the engine's pool (csrc/runtime/read_bandwidth.h).");
  m.def("read_bandwidth_by_worker", [](size_t nbytes, int64_t threads, int passes) {
    const int n = probe_threads(threads);
    nb::gil_scoped_release nogil;
    return hmoe::read_bandwidth_by_worker(nbytes, n, passes);
  }, "nbytes"_a, "threads"_a, "passes"_a = 3,
        "Bytes/s of each pool worker while reading, all threads at once (csrc/runtime/read_bandwidth.h).");
  m.def("read_bandwidth_isa", &hmoe::read_bandwidth_isa, "The load width read_bandwidth uses here.");
  m.def("_pool_help_check", [](int64_t threads, int runs, int items, bool wait_for_helper) {
    if (threads < 1 || runs < 1 || items < 1) fail("threads, runs and items must be >= 1");
    const int n = int_arg(threads, "threads", 1, kMaxThreads);
    nb::gil_scoped_release nogil;
    return hmoe::pool_help_check(n, runs, items, wait_for_helper);
  }, "threads"_a, "runs"_a, "items"_a, "wait_for_helper"_a,
        "Tests only: ThreadPool::help against a pool's runs (csrc/runtime/pool_help_check.h).");

  nb::class_<hmoe::MoeTuning>(m, "MoeTuning",
                              "How a call's GEMM work is cut and prefetched (hybridmoe.experts.tuning.EngineTuning).")
      .def(nb::init<>())
      .def_rw("item_blocks", &hmoe::MoeTuning::item_blocks)
      .def_rw("item_prefetch", &hmoe::MoeTuning::item_prefetch)
      .def_rw("kernel_prefetch_l1", &hmoe::MoeTuning::kernel_prefetch_l1)
      .def_rw("kernel_prefetch_l2", &hmoe::MoeTuning::kernel_prefetch_l2)
      .def_rw("early_start", &hmoe::MoeTuning::early_start)
      .def_rw("padded_counters", &hmoe::MoeTuning::padded_counters)
      .def_rw("tail_split", &hmoe::MoeTuning::tail_split)
      .def_rw("gate_up_tail", &hmoe::MoeTuning::gate_up_tail)
      .def_rw("balanced_items", &hmoe::MoeTuning::balanced_items)
      .def_rw("combine_in_run", &hmoe::MoeTuning::combine_in_run)
      .def_rw("prefetch_touch", &hmoe::MoeTuning::prefetch_touch);

  nb::class_<Engine>(m, "MoeEngine", "Packed routed experts of one MoE layer (see csrc/moe/moe_layer.h).")
      .def(nb::init<int64_t, int64_t, int64_t, const std::string&, int64_t, bool, int64_t, const std::string&, int64_t,
                    bool>(),
           "E"_a, "H"_a, "I"_a, "format"_a, "group_size"_a, "zero_points"_a, "threads"_a, "isa"_a,
           "numa_nodes"_a, "adopt"_a)
      .def("pack_expert", &Engine::pack_expert, "e"_a, "gate"_a, "up"_a, "down"_a)
      .def("pack_expert_codes", &Engine::pack_expert_codes, "e"_a, "mats"_a)
      .def("pack_expert_fp8", &Engine::pack_expert_fp8, "e"_a, "mats"_a)
      .def("pack_expert_mxfp4", &Engine::pack_expert_mxfp4, "e"_a, "mats"_a)
      .def("unpack_expert", &Engine::unpack_expert, "e"_a, "gate"_a, "up"_a, "down"_a)
      .def("set_glu", &Engine::set_glu, "kind"_a, "alpha"_a, "limit"_a,
           "What h is: 'silu' (silu(g) * u) or 'clamped_swiglu' (gpt-oss's, with alpha and limit).")
      .def("set_biases", &Engine::set_biases, "gate"_a, "up"_a, "down"_a,
           "The experts' biases: fp32 gate and up [E, I], down [E, H] (copied).")
      .def_prop_ro("has_biases", [](const Engine& e) { return e.layer().has_biases(); })
      .def("buffers", [](nb::handle self) { return nb::cast<Engine&>(self).buffers(self); },
           "Packed buffers by name, as numpy views that keep this engine alive.")
      .def("set_buffer", &Engine::set_buffer, "name"_a, "array"_a)
      .def("submit", &Engine::submit, "x"_a, "topk_ids"_a, "topk_weights"_a, "out"_a)
      .def("wait", &Engine::wait, "ticket"_a)
      .def("prewake", &Engine::prewake, "Wake sleeping workers ahead of a call (no-op while they spin).")
      .def("prefetch", &Engine::prefetch, "experts"_a, "Read these experts' packed weights into the caches.")
      .def("trace", &Engine::trace, "calls"_a, "Record the next `calls` forwards (see take_trace).")
      .def_prop_rw("tuning", [](const Engine& e) { return e.layer().tuning(); },
                   [](Engine& e, const hmoe::MoeTuning& t) { e.layer().set_tuning(checked_tuning(t)); },
                   "The MoeTuning of later calls.")
      .def("take_trace", &Engine::take_trace, "The records of the traced calls since the last take (moe_trace.h).")
      .def("run", &Engine::run, "x"_a, "topk_ids"_a, "topk_weights"_a, "out"_a,
           "submit + wait on the calling thread (GIL released), without the driver thread.")
      .def("run_deferred", &Engine::run_deferred, "x"_a, "topk_ids"_a, "topk_weights"_a, "deferred"_a, "out"_a,
           "out2"_a, "run() with each token's last `deferred` slots summed into out2 instead of out.")
      .def("backward", &Engine::backward, "x"_a, "topk_ids"_a, "topk_weights"_a, "grad_out"_a, "grad_x"_a,
           "grad_weights"_a, "chunk_tokens"_a,
           "The gradients of x and of the routing weights through the frozen experts, given the output's.")
      .def("submit_deferred", &Engine::submit_deferred, "x"_a, "topk_ids"_a, "topk_weights"_a, "deferred"_a,
           "out"_a, "out2"_a, "submit() with each token's last `deferred` slots summed into out2 instead of out.")
      .def_prop_ro("isa", [](const Engine& e) { return std::string(kIsaNames[int(e.cfg().isa)]); })
      .def_prop_ro("format", [](const Engine& e) { return std::string(kFormatNames[int(e.cfg().format)]); })
      .def_prop_ro("threads", [](const Engine& e) { return e.cfg().threads; })
      .def_prop_ro("numa_nodes", [](const Engine& e) { return e.cfg().numa_nodes; })
      .def_prop_ro("group_size", [](const Engine& e) { return e.cfg().group; })
      .def_prop_ro("zero_points", [](const Engine& e) { return e.cfg().zero_points; })
      .def_prop_ro("shape", [](const Engine& e) {
        return std::vector<int>{e.cfg().E, e.cfg().H, e.cfg().I};
      });
  register_cuda_host(m);
}
