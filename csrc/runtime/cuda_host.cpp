#include "runtime/cuda_host.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <stdexcept>

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

}  // namespace hmoe
