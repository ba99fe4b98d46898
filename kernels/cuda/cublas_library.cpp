// kernels/cuda/cublas_library.cpp — cuBLAS opened on first use (see cublas_library.h).
#include "kernels/cuda/cublas_library.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace tally::kernels::cuda::detail {
namespace {

// gemm_ex's type is written out (cublas_library.h): it must be the exported overload's exactly.
// Unevaluated, so it references no symbol of the unlinked library.
static_assert(sizeof(static_cast<decltype(CublasLibrary::gemm_ex)>(&::cublasGemmEx)) > 0,
              "CublasLibrary::gemm_ex is not the type of cuBLAS's exported cublasGemmEx");

#define TALLY_CUBLAS_STRINGIFY_(x) #x
#define TALLY_CUBLAS_STRINGIFY(x) TALLY_CUBLAS_STRINGIFY_(x)

struct Loaded {
  CublasLibrary api{};
  std::string error;  // empty when api is complete
};

template <typename F>
bool resolve(void* handle, const char* name, F& fn, std::string& error) {
  dlerror();
  void* p = dlsym(handle, name);
  if (p == nullptr) {
    const char* why = dlerror();
    error = fmt::format("{} has no entry point {} ({})", cublas_soname(), name, why ? why : "null symbol");
    return false;
  }
  fn = reinterpret_cast<F>(p);
  return true;
}

Loaded load() {
  Loaded l;
  // RTLD_LOCAL: cuBLAS's symbols stay out of the global namespace; RTLD_NOW: a library that
  // cannot be bound fails here, with a message, not at some later call.
  void* handle = dlopen(cublas_soname(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    l.error = fmt::format("cannot load cuBLAS: {} ({}); the CUDA device needs the cuBLAS of CUDA {} on the "
                          "library path (LD_LIBRARY_PATH or the system's)",
                          cublas_soname(), why ? why : "unknown reason", CUBLAS_VER_MAJOR);
    return l;
  }
  CublasLibrary& a = l.api;
  // The names are the macros' expansions: cublasCreate is cublasCreate_v2, and so on.
  const bool ok = resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasCreate), a.create, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasSetStream), a.set_stream, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasSetMathMode), a.set_math_mode, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasSetPointerMode), a.set_pointer_mode, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasSetWorkspace), a.set_workspace, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasGemmEx), a.gemm_ex, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasGetProperty), a.get_property, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasGetStatusName), a.get_status_name, l.error) &&
                  resolve(handle, TALLY_CUBLAS_STRINGIFY(cublasGetStatusString), a.get_status_string, l.error);
  if (!ok) return l;
  int major = -1;
  if (a.get_property(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS || major != CUBLAS_VER_MAJOR)
    l.error = fmt::format("{} reports major version {}, tally was built with cuBLAS {}", cublas_soname(), major,
                          CUBLAS_VER_MAJOR);
  // The handle is kept open for the life of the process: the entry points point into it.
  return l;
}

}  // namespace

const char* cublas_soname() { return "libcublas.so." TALLY_CUBLAS_STRINGIFY(CUBLAS_VER_MAJOR); }

const CublasLibrary& cublas_library() {
  static const Loaded loaded = load();  // thread-safe, once
  if (!loaded.error.empty()) throw Error(loaded.error);
  return loaded.api;
}

}  // namespace tally::kernels::cuda::detail
