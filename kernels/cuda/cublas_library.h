// kernels/cuda/cublas_library.h — cuBLAS, loaded when the first CUDA context is made.
// Internal to the CUDA backend (included by check.h).
//
// Why not linked: loading libcublas.so pulls in libcublasLt, whose load alone makes 210 MB of a
// process resident (its static initialisation touches 80 MB of zeroed data and 60 MB of code,
// measured on an empty program linked against it). A CUDA build of tally that plans, runs on the
// CPU or prints its help never calls cuBLAS, and should not pay for it. So cuBLAS is opened with
// dlopen on first use — the soname of the major version the headers declare, found as the
// dynamic linker finds any library (LD_LIBRARY_PATH, the executable's run path, the system's
// cache) — and its entry points are resolved once, by their exported names (the _v2 names the
// macros of cublas_v2.h expand to). A missing library or entry point is a tally::Error naming
// the library and dlerror()'s reason when a CUDA context is first made, not a failure to start.
#pragma once
#include <cublas_v2.h>

namespace tally::kernels::cuda::detail {

// The cuBLAS functions tally calls, each with the type the header declares for it.
struct CublasLibrary {
  decltype(&::cublasCreate_v2) create;
  decltype(&::cublasSetStream_v2) set_stream;
  decltype(&::cublasSetMathMode) set_math_mode;
  decltype(&::cublasSetPointerMode_v2) set_pointer_mode;
  decltype(&::cublasSetWorkspace_v2) set_workspace;
  // The exported cublasGemmEx, taking a cublasComputeType_t (C++ also sees an inline overload
  // taking a cudaDataType, which the library does not export).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  decltype(&::cublasGetProperty) get_property;
  decltype(&::cublasGetStatusName) get_status_name;
  decltype(&::cublasGetStatusString) get_status_string;
};

// Opens libcublas.so.<CUBLAS_VER_MAJOR> on the first call (thread-safe) and returns its entry
// points; throws tally::Error, on this call and every later one, when it cannot be opened, an
// entry point is missing or the library's major version is not the headers'.
const CublasLibrary& cublas_library();

// The library's name as dlopen is given it ("libcublas.so.13").
const char* cublas_soname();

}  // namespace tally::kernels::cuda::detail
