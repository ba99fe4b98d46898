// kernels/cuda/gemm.cu — row-major GEMM on cuBLAS; the CUDA twin of kernels/cpu/gemm.cpp.
// C (M, N) = alpha * op(A) * op(B) + beta * C; beta == 0 never reads C.
//
// cuBLAS is column-major. A row-major (M, N) matrix with leading dimension ldc is, read
// column-major, its transpose (N, M) with the same leading dimension. So
//   C^T (N, M) = op(B)^T (N, K) * op(A)^T (K, M)
// is one column-major GEMM on the same pointers with the operands swapped: cuBLAS's "A" is our B
// (transposed iff trans_b), its "B" is our A (transposed iff trans_a), m = N, n = M.
//
// Precision: cublasGemmEx with CUBLAS_COMPUTE_32F (plain float32) unless set_allow_tf32(true),
// which asks for CUBLAS_COMPUTE_32F_FAST_TF32. The compute type is given per call, so neither the
// handle's math mode nor another library's setting can turn TF32 on behind tally's back.
// bf16 (gemm<bf16> and gemm<bf16, float>): A and B are CUDA_R_16BF, C CUDA_R_16BF or CUDA_R_32F,
// always CUBLAS_COMPUTE_32F (bf16 products are exact in float32 and summed there; TF32 concerns
// float32 operands only), alpha and beta float; a bf16 C is rounded once, after beta * C is added.
// Workspace: cublasSetWorkspace before each call with the arena block the op carved for it (or
// none), so cuBLAS never uses memory outside the arena and a block freed after the call is never
// referenced again.
#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/instantiate.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {

// C (M, N) = beta * C, never reading C when beta == 0: the K == 0 / alpha == 0 case, which
// cuBLAS would reject (lda = 0) or might still read A and B for.
template <class TC>
__global__ void scale_matrix_kernel(i64 M, i64 N, float beta, TC* C, i64 ldc) {
  TALLY_GRID_LOOP(i, M * N) {
    TC* c = C + (i / N) * ldc + i % N;
    *c = beta == 0.f ? TC(0) : static_cast<TC>(beta * static_cast<float>(*c));
  }
}

// cuBLAS's name of an element type.
template <class T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, bf16>) return CUDA_R_16BF;
  else return CUDA_R_32F;
}

int to_int(i64 v, const char* what) {
  if (v < 0 || v > INT_MAX)
    detail::fail(std::string("gemm: ") + what + " = " + std::to_string(v) +
                 " does not fit cuBLAS's 32-bit int (split the product)");
  return static_cast<int>(v);
}

}  // namespace

template <class T, class TC>
void gemm(bool trans_a, bool trans_b, i64 M, i64 N, i64 K, P<T> alpha,
          const T* A,  // (M, K) with leading dim lda, or (K, M) if trans_a
          i64 lda,
          const T* B,  // (K, N) with leading dim ldb, or (N, K) if trans_b
          i64 ldb, P<T> beta,
          TC* C,  // (M, N) with leading dim ldc
          i64 ldc, void* workspace, std::size_t workspace_bytes) {
  static_assert(std::is_same_v<P<T>, float>, "cuBLAS GEMMs take float32 scalars (compute type 32F)");
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.f) {
    if (beta != 1.f) {
      scale_matrix_kernel<<<detail::grid_for(M * N), detail::kThreads, 0, detail::stream()>>>(M, N, beta, C, ldc);
      TALLY_LAUNCH_CHECK("gemm.scale_matrix");
    }
    return;
  }
  if (workspace == nullptr || workspace_bytes < kGemmMinWorkspace)
    detail::fail("gemm on CUDA: cuBLAS needs a workspace of at least " + std::to_string(kGemmMinWorkspace) +
                 " bytes from the arena, found " + (workspace ? std::to_string(workspace_bytes) + " bytes" : "none"));
  const int m = to_int(N, "N"), n = to_int(M, "M"), k = to_int(K, "K");
  const int lda_ = to_int(lda, "lda"), ldb_ = to_int(ldb, "ldb"), ldc_ = to_int(ldc, "ldc");
  cublasHandle_t h = detail::cublas();
  const detail::CublasLibrary& blas = detail::cublas_library();
  TALLY_CUBLAS_CHECK(blas.set_workspace(h, workspace, workspace_bytes));
  const bool tf32 = std::is_same_v<T, float> && allow_tf32();
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  TALLY_CUBLAS_CHECK(blas.gemm_ex(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                                  &alpha, B, cuda_type<T>(), ldb_, A, cuda_type<T>(), lda_, &beta, C, cuda_type<TC>(),
                                  ldc_, compute, CUBLAS_GEMM_DEFAULT));
}

TALLY_INSTANTIATE_GEMM(float, float)
TALLY_INSTANTIATE_GEMM(bf16, bf16)
TALLY_INSTANTIATE_GEMM(bf16, float)

std::size_t gemm_workspace_bytes(std::size_t budget) {
  int major = 0;
  if (const DescribedDevice* d = described_device()) {  // a plan without the GPU
    major = d->compute_major;
  } else {
    int dev = 0;
    TALLY_CUDA_CHECK(cudaGetDevice(&dev));
    TALLY_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  }
  const std::size_t recommended = std::size_t(major >= 9 ? 32 : 4) << 20;  // cuBLAS's documentation
  const std::size_t bytes = std::clamp(budget / 16, kGemmMinWorkspace, recommended);
  return bytes / 256 * 256;
}

std::size_t conv_workspace_limit(std::size_t budget) { return std::min(budget / 8, std::size_t(1) << 30); }

}  // namespace tally::kernels::cuda
