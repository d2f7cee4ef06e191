#pragma once
// The CUDA runtime, loaded with dlopen at run time: no CUDA toolkit at build time, and the
// module imports on machines without one. Only what the CPU/GPU handoff needs:
// cudaLaunchHostFunc, which puts a host function on a stream (under stream capture: a host node
// of the graph, run on every replay by CUDA's own thread, in stream order).
#include <cstdint>
#include <string>
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
// name. Later calls return the runtime loaded first. Throws std::runtime_error that lists what
// was tried and why each failed.
const CudaRuntime& load_cuda_runtime(const std::vector<std::string>& candidates);

// The loaded runtime, or nullptr before load_cuda_runtime succeeded.
const CudaRuntime* cuda_runtime();

// cudaLaunchHostFunc(stream, fn, data) on the loaded runtime; throws std::runtime_error with
// CUDA's message if the runtime is not loaded or the launch fails.
void launch_host_func(uintptr_t stream, CudaHostFn fn, void* data);

}  // namespace hmoe
