#include "runtime/cuda_host.h"

#include <dlfcn.h>

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hmoe {
namespace {

std::mutex load_mu;
std::atomic<const CudaRuntime*> loaded{nullptr};

// Resolves the two symbols from one opened library; on failure closes it and says why.
bool resolve(void* lib, CudaRuntime& rt, std::string& why) {
  rt.launch_host_func = reinterpret_cast<decltype(rt.launch_host_func)>(dlsym(lib, "cudaLaunchHostFunc"));
  rt.error_string = reinterpret_cast<decltype(rt.error_string)>(dlsym(lib, "cudaGetErrorString"));
  if (rt.launch_host_func && rt.error_string) return true;
  why = "no cudaLaunchHostFunc/cudaGetErrorString in it";
  dlclose(lib);
  return false;
}

}  // namespace

const CudaRuntime& load_cuda_runtime(const std::vector<std::string>& candidates) {
  std::lock_guard<std::mutex> lk(load_mu);
  if (const CudaRuntime* rt = loaded.load()) return *rt;
  std::vector<std::string> names = candidates;
  for (const char* soname : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) names.push_back(soname);
  std::string tried;
  for (const auto& name : names) {
    std::string why;
    // RTLD_NOLOAD first: the runtime torch already uses, if it is mapped under this name.
    void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      const char* err = dlerror();
      why = err ? err : "not found";
    } else {
      auto* rt = new CudaRuntime;  // lives as long as the process: host nodes may call into it
      if (resolve(lib, *rt, why)) {
        rt->path = name;
        loaded.store(rt);
        return *rt;
      }
      delete rt;
    }
    tried += "\n  " + name + ": " + why;
  }
  throw std::runtime_error("could not load the CUDA runtime (libcudart); tried:" + tried);
}

const CudaRuntime* cuda_runtime() { return loaded.load(); }

void launch_host_func(uintptr_t stream, CudaHostFn fn, void* data) {
  const CudaRuntime* rt = loaded.load();
  if (!rt) throw std::runtime_error("the CUDA runtime is not loaded; call load_cuda_runtime first");
  const int err = rt->launch_host_func(reinterpret_cast<void*>(stream), fn, data);
  if (err != 0)
    throw std::runtime_error(std::string("cudaLaunchHostFunc failed: ") + rt->error_string(err) + " (error " +
                             std::to_string(err) + ")");
}


namespace {

constexpr int kNotReady = 600;               // CUDA_ERROR_NOT_READY
constexpr int kAttrCanMapHostMemory = 19;    // CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
constexpr int kAttrUnifiedAddressing = 41;   // CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
constexpr unsigned kWaitEq = 0x1;            // CU_STREAM_WAIT_VALUE_EQ
constexpr unsigned kStreamNonBlocking = 0x1; // CU_STREAM_NON_BLOCKING
constexpr int kCaptureRelaxed = 2;           // CU_STREAM_CAPTURE_MODE_RELAXED

std::mutex driver_mu;
std::atomic<const CudaDriver*> driver{nullptr};

// cuGetProcAddress_v2(symbol, &fn, cudaVersion, flags, &status): the driver's own lookup by API
// name and version, for a driver that does not export a versioned name we ask dlsym for.
using GetProcAddress = int (*)(const char*, void**, int, uint64_t, int*);

template <class F>
bool sym(void* lib, GetProcAddress lookup, const char* name, F& f, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f && lookup) {
    std::string api = name;  // "cuStreamWriteValue32_v2" is API "cuStreamWriteValue32" of CUDA 12
    if (api.size() > 3 && api.compare(api.size() - 3, 3, "_v2") == 0) api.resize(api.size() - 3);
    void* p = nullptr;
    int status = 0;
    if (lookup(api.c_str(), &p, 12000, 0, &status) == 0 && p) f = reinterpret_cast<F>(p);
  }
  if (!f) missing += std::string(missing.empty() ? "" : ", ") + name;
  return f != nullptr;
}

std::string driver_message(const CudaDriver& d, int err) {
  const char* s = nullptr;
  if (d.get_error_string(err, &s) != 0 || !s) s = "unknown error";
  return std::string(s) + " (CUresult " + std::to_string(err) + ")";
}

void check_driver(const CudaDriver& d, int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string(what) + " failed: " + driver_message(d, err));
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Waits for `stream` to drain, at most `timeout_ns`: a wait on a word nobody writes never ends.
bool drained(const CudaDriver& d, void* stream, int64_t timeout_ns, int& err) {
  const int64_t end = now_ns() + timeout_ns;
  for (;;) {
    err = d.stream_query(stream);
    if (err != kNotReady) return err == 0;
    if (now_ns() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

const CudaDriver& load_cuda_driver() {
  std::lock_guard<std::mutex> lk(driver_mu);
  if (const CudaDriver* d = driver.load()) return *d;
  const char* name = "libcuda.so.1";
  void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  if (!lib) lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    const char* err = dlerror();
    throw std::runtime_error(std::string("could not load the CUDA driver (libcuda.so.1): ") + (err ? err : "not found"));
  }
  auto* d = new CudaDriver;  // lives as long as the process, like the library
  std::string missing;
  const auto lookup = reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress_v2"));
  int (*driver_get_version)(int*) = nullptr;
  sym(lib, lookup, "cuDriverGetVersion", driver_get_version, missing);
  sym(lib, lookup, "cuGetErrorString", d->get_error_string, missing);
  sym(lib, lookup, "cuCtxGetDevice", d->ctx_get_device, missing);
  sym(lib, lookup, "cuDeviceGetAttribute", d->device_get_attribute, missing);
  sym(lib, lookup, "cuMemHostGetDevicePointer_v2", d->mem_host_get_device_pointer, missing);
  // The _v2 memory operations: enabled by default on every platform since CUDA 11.7 (the v1 ones
  // needed a kernel-module switch).
  sym(lib, lookup, "cuStreamWriteValue32_v2", d->stream_write_value32, missing);
  sym(lib, lookup, "cuStreamWaitValue32_v2", d->stream_wait_value32, missing);
  sym(lib, lookup, "cuStreamCreate", d->stream_create, missing);
  sym(lib, lookup, "cuStreamDestroy_v2", d->stream_destroy, missing);
  sym(lib, lookup, "cuStreamQuery", d->stream_query, missing);
  sym(lib, lookup, "cuEventQuery", d->event_query, missing);
  sym(lib, lookup, "cuStreamBeginCapture_v2", d->stream_begin_capture, missing);
  sym(lib, lookup, "cuStreamEndCapture", d->stream_end_capture, missing);
  sym(lib, lookup, "cuGraphInstantiateWithFlags", d->graph_instantiate, missing);
  sym(lib, lookup, "cuGraphLaunch", d->graph_launch, missing);
  sym(lib, lookup, "cuGraphExecDestroy", d->graph_exec_destroy, missing);
  sym(lib, lookup, "cuGraphDestroy", d->graph_destroy, missing);
  if (!missing.empty()) {
    delete d;
    throw std::runtime_error("the CUDA driver (libcuda.so.1) lacks " + missing + " (a driver for CUDA 11.7 or newer has them)");
  }
  driver_get_version(&d->version);
  d->path = name;
  driver.store(d);
  return *d;
}

uint64_t host_device_pointer(void* host) {
  const CudaDriver& d = load_cuda_driver();
  uint64_t dptr = 0;
  check_driver(d, d.mem_host_get_device_pointer(&dptr, host, 0), "cuMemHostGetDevicePointer (is the memory pinned?)");
  return dptr;
}

void stream_write_value32(uintptr_t stream, uint64_t addr, uint32_t value) {
  const CudaDriver& d = load_cuda_driver();
  check_driver(d, d.stream_write_value32(reinterpret_cast<void*>(stream), addr, value, 0), "cuStreamWriteValue32");
}

void stream_wait_value32(uintptr_t stream, uint64_t addr, uint32_t value) {
  const CudaDriver& d = load_cuda_driver();
  check_driver(d, d.stream_wait_value32(reinterpret_cast<void*>(stream), addr, value, kWaitEq), "cuStreamWaitValue32");
}

bool event_done(uintptr_t event) {
  const CudaDriver& d = load_cuda_driver();
  return d.event_query(reinterpret_cast<void*>(event)) != kNotReady;
}

std::string probe_stream_mem_ops(uint32_t* word) {
  const CudaDriver* dp;
  try {
    dp = &load_cuda_driver();
  } catch (const std::exception& e) {
    return e.what();
  }
  const CudaDriver& d = *dp;
  int dev = -1, can_map = 0, uva = 0;
  if (d.ctx_get_device(&dev) != 0) return "no CUDA context is current on this thread";
  d.device_get_attribute(&can_map, kAttrCanMapHostMemory, dev);
  d.device_get_attribute(&uva, kAttrUnifiedAddressing, dev);
  if (!can_map || !uva) return "device " + std::to_string(dev) + " cannot map host memory (or has no unified addressing)";
  uint64_t addr = 0;
  int err = d.mem_host_get_device_pointer(&addr, word, 0);
  if (err != 0) return "the flag words are not device-mapped: " + driver_message(d, err);

  void* stream = nullptr;
  if ((err = d.stream_create(&stream, kStreamNonBlocking)) != 0) return "cuStreamCreate: " + driver_message(d, err);
  std::string why;
  constexpr int64_t kTimeout = 2'000'000'000;
  // Eagerly: the stream waits for a value our thread writes, then answers with one of its own.
  store_flag(word, 0);
  if ((err = d.stream_wait_value32(stream, addr, 1, kWaitEq)) != 0 ||
      (err = d.stream_write_value32(stream, addr, 2, 0)) != 0) {
    why = "cuStreamWaitValue32/cuStreamWriteValue32 on host memory: " + driver_message(d, err);
  } else {
    store_flag(word, 1);
    if (!drained(d, stream, kTimeout, err))
      why = err == kNotReady ? "the stream did not see a host write within 2 s" : "the stream failed: " + driver_message(d, err);
    else if (load_flag(word) != 2)
      why = "the stream's write did not reach host memory";
  }
  // Captured in a graph (which is where the handoff lives): the same pair, replayed.
  void *graph = nullptr, *exec = nullptr;
  if (why.empty()) {
    if ((err = d.stream_begin_capture(stream, kCaptureRelaxed)) != 0) {
      why = "cuStreamBeginCapture: " + driver_message(d, err);
    } else {
      const int e1 = d.stream_wait_value32(stream, addr, 3, kWaitEq);
      const int e2 = d.stream_write_value32(stream, addr, 4, 0);
      const int e3 = d.stream_end_capture(stream, &graph);
      err = e1 ? e1 : e2 ? e2 : e3;
      if (err != 0) why = "stream memory operations are not capturable in a CUDA graph here: " + driver_message(d, err);
    }
  }
  if (why.empty() && (err = d.graph_instantiate(&exec, graph, 0)) != 0)
    why = "cuGraphInstantiate of a graph of stream memory operations: " + driver_message(d, err);
  for (int replay = 0; why.empty() && replay < 2; ++replay) {
    store_flag(word, 0);
    if ((err = d.graph_launch(exec, stream)) != 0) {
      why = "cuGraphLaunch: " + driver_message(d, err);
      break;
    }
    store_flag(word, 3);
    if (!drained(d, stream, kTimeout, err))
      why = err == kNotReady ? "a replayed wait did not see a host write within 2 s" : "a replay failed: " + driver_message(d, err);
    else if (load_flag(word) != 4)
      why = "a replayed write did not reach host memory";
  }
  if (exec) d.graph_exec_destroy(exec);
  if (graph) d.graph_destroy(graph);
  d.stream_destroy(stream);  // a stream stuck on a wait is released once it drains
  store_flag(word, 0);
  return why;
}

FlagPoller& FlagPoller::instance() {
  static FlagPoller* poller = new FlagPoller;  // never destroyed: its thread may outlive static destructors
  return *poller;
}

void FlagPoller::add(FlagChannel* c) {
  std::lock_guard<std::mutex> lk(mu_);
  channels_.push_back(c);
  if (!thread_.joinable()) thread_ = std::thread([this] { main(); });
  cv_.notify_all();
}

void FlagPoller::remove(FlagChannel* c) {
  std::lock_guard<std::mutex> lk(mu_);
  channels_.erase(std::remove(channels_.begin(), channels_.end(), c), channels_.end());
}

void FlagPoller::main() {
  // Naps of tens of microseconds need a tight timer: the default slack (50 us) would double them.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  int64_t last_work = now_ns(), next_yield = last_work + 50'000;
  int on_cpu = -1;
  for (uint32_t i = 0;; ++i) {  // (unsigned: it wraps after 2^32 passes)
    if (const int want = cpu_.load(std::memory_order_relaxed); want != on_cpu) {
      cpu_set_t set;
      CPU_ZERO(&set);
      if (want >= 0) {
        CPU_SET(want, &set);
      } else {
        for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
      }
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      on_cpu = want;
    }
    bool served = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (channels_.empty()) {
        napping_ = true;
        cv_.wait(lk, [this] { return !channels_.empty(); });
        napping_ = false;
        last_work = now_ns();
      }
      for (FlagChannel* c : channels_) served |= c->poll();
    }
    if (served) {
      last_work = now_ns();
      continue;
    }
#if defined(__x86_64__)
    _mm_pause();
#endif
    if ((i & 31) != 31) continue;
    const int64_t t = now_ns(), idle = t - last_work;
    if (idle < kSpinNs) {
      if (t > next_yield) {
        sched_yield();  // a thread sharing this core (Python, a CUDA thread) is never starved long
        next_yield = t + 50'000;
      }
      continue;
    }
    napping_ = true;
    std::this_thread::sleep_for(std::chrono::nanoseconds(idle < kLongNapAfterNs ? kShortNapNs : kLongNapNs));
    napping_ = false;
    // One look after a nap, then the clock again (not the 32 looks between clock reads of the spin): a go that
    // comes while napping waits for the next look, and one look per nap is all an idle poller needs.
    i = (i | 31u) - 1;  // the next pass has (i & 31) == 31
  }
}

}  // namespace hmoe
