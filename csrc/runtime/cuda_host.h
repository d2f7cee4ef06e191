#pragma once
// CUDA, loaded with dlopen at run time: no CUDA toolkit at build time, and the module imports on
// machines without one. Only what the CPU/GPU handoff needs, in two flavours:
//
// - the runtime (libcudart): cudaLaunchHostFunc, which puts a host function on a stream (under
//   stream capture: a host node of the graph, run on every replay by CUDA's own thread);
// - the driver (libcuda): stream memory operations. The stream writes a word of pinned,
//   device-mapped host memory (cuStreamWriteValue32) and waits for a word to take a value
//   (cuStreamWaitValue32); a thread of ours (FlagPoller) watches and answers those words. No
//   CUDA thread sits in the middle, which is what a host node costs (~40 us per layer).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hmoe {

using CudaHostFn = void (*)(void*);

struct CudaRuntime {
  std::string path;  // the library loaded
  int (*launch_host_func)(void* stream, CudaHostFn fn, void* data) = nullptr;
  const char* (*error_string)(int err) = nullptr;
};

// Loads the runtime once and returns it: each of `candidates` in order (full paths first: the
// libcudart torch already mapped, or the one beside it), then libcudart.so.13, .so.12 and .so by
// name. Later calls return the runtime loaded first. Throws std::runtime_error that lists each
// name it attempted and why that one failed.
const CudaRuntime& load_cuda_runtime(const std::vector<std::string>& candidates);

// The loaded runtime, or nullptr before load_cuda_runtime succeeded.
const CudaRuntime* cuda_runtime();

// cudaLaunchHostFunc(stream, fn, data) on the loaded runtime; throws std::runtime_error with
// CUDA's message if the runtime is not loaded or the launch fails.
void launch_host_func(uintptr_t stream, CudaHostFn fn, void* data);

// The driver entry points of the stream-memory-op handoff (CUresult is an int; CUdevice an int;
// CUdeviceptr a uint64_t; streams, graphs and executable graphs opaque pointers).
struct CudaDriver {
  std::string path;
  int version = 0;  // cuDriverGetVersion, e.g. 13000
  int (*get_error_string)(int, const char**) = nullptr;
  int (*ctx_get_device)(int*) = nullptr;
  int (*device_get_attribute)(int*, int, int) = nullptr;
  int (*mem_host_get_device_pointer)(uint64_t*, void*, unsigned) = nullptr;
  int (*stream_write_value32)(void*, uint64_t, uint32_t, unsigned) = nullptr;
  int (*stream_wait_value32)(void*, uint64_t, uint32_t, unsigned) = nullptr;
  int (*stream_create)(void**, unsigned) = nullptr;
  int (*stream_destroy)(void*) = nullptr;
  int (*stream_query)(void*) = nullptr;
  int (*event_query)(void*) = nullptr;
  int (*stream_begin_capture)(void*, int) = nullptr;
  int (*stream_end_capture)(void*, void**) = nullptr;
  int (*graph_instantiate)(void**, void*, unsigned long long) = nullptr;
  int (*graph_launch)(void*, void*) = nullptr;
  int (*graph_exec_destroy)(void*) = nullptr;
  int (*graph_destroy)(void*) = nullptr;
};

// Loads libcuda.so.1 once (the one the runtime already mapped, if any) and resolves the entry
// points above; throws std::runtime_error saying what is missing.
const CudaDriver& load_cuda_driver();

// The device address of a word of pinned host memory (cuMemHostGetDevicePointer, in the current
// context); throws std::runtime_error if it is not device-mapped.
uint64_t host_device_pointer(void* host);

// On `stream`: write `value` to the device-mapped word at `addr` (after every earlier operation
// of the stream, with a memory barrier: what they wrote is visible first) / wait until it equals
// `value`. Throw std::runtime_error with the driver's message.
void stream_write_value32(uintptr_t stream, uint64_t addr, uint32_t value);
void stream_wait_value32(uintptr_t stream, uint64_t addr, uint32_t value);

// Whether the work before the CUDA event `event` (a cudaEvent_t / CUevent) is done: true also when
// the query fails (the caller's own wait on the event then reports the error).
bool event_done(uintptr_t event);

// Whether the current device can run the stream-memory-op handoff on the pinned word `word`: it
// maps host memory, a stream waits for a value our thread writes there (eagerly), and a
// captured graph of a write and a wait replays. Returns "" if so, else why not (one line).
std::string probe_stream_mem_ops(uint32_t* word);

// Words of pinned host memory that the GPU writes and a thread of ours reads, or the other way
// round: loads acquire and stores release (the data written before a flag is seen with it).
inline uint32_t load_flag(const uint32_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
inline void store_flag(uint32_t* w, uint32_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

// One thread for the whole process that calls poll() on every registered channel in turn: a
// channel looks at its flag words, serves what it finds and says whether it did. After work it
// spins (pause, a yield every ~50 us) for kSpin, as long as the engine pool's longest spin
// window, so the layers of a decode step (one every tens to hundreds of microseconds) find it
// awake; idle longer, it naps 50 us at a time, and after 100 ms idle 1 ms at a time, so an idle
// server costs next to nothing (the first layer after a long idle waits at most one nap). With no
// channel it sleeps. It does not keep the pool's workers awake past their own window. Its CPU is
// shared with nothing during decode steps (the step's own thread runs pinned off the pool's CPUs:
// HybridExperts.decode_thread) but the CPU expert pools' driver threads (each pool's first CPU),
// which spin at most kDriverSpinNs (thread_pool.cpp) after their last job and then sleep.
class FlagChannel {
 public:
  virtual ~FlagChannel() = default;
  virtual bool poll() = 0;
};

class FlagPoller {
 public:
  static constexpr int64_t kSpinNs = 2'000'000;
  static constexpr int64_t kShortNapNs = 50'000;
  static constexpr int64_t kLongNapAfterNs = 100'000'000;
  static constexpr int64_t kLongNapNs = 1'000'000;

  static FlagPoller& instance();
  // After add returns, the poller calls c->poll(); after remove returns, it never will again.
  void add(FlagChannel* c);
  void remove(FlagChannel* c);
  // Run the poller on `cpu` from now on (-1: anywhere). The CPU of the engine pool's driver
  // thread is the one to pick: the poller runs the layers in its place (the driver then sleeps),
  // and every other CPU has a pinned worker of its own.
  void pin(int cpu) { cpu_.store(cpu); }
  // Whether the poller is napping (idle past its spin window) right now.
  bool napping() const { return napping_.load(); }

 private:
  FlagPoller() = default;  // lives as long as the process (instance() never deletes it)
  void main();

  std::mutex mu_;  // held while channels_ is scanned, so remove() waits out a poll in progress
  std::condition_variable cv_;
  std::vector<FlagChannel*> channels_;
  std::thread thread_;
  std::atomic<bool> napping_{false};
  std::atomic<int> cpu_{-1};
};

}  // namespace hmoe
