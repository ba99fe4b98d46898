// kernels/cpu/gemm.cpp — row-major GEMM on OpenBLAS (cblas_sgemm / cblas_dgemm).
// C (M, N) = alpha * op(A) * op(B) + beta * C; beta == 0 never reads C.
#include <cblas.h>

#include "kernels/cpu/cpu_kernels.h"

namespace tally::kernels::cpu {

namespace {

// Threads: tally parallelizes its CPU kernels with OpenMP. OpenBLAS's own pthreads pool competes
// with OpenMP's spinning workers for the same cores; on 2 cores a ResNet-20 step ran 7x slower
// (33 vs 249 images/s, measured with `tally train --steps 4 --batch-size 64`). The GEMMs here
// are per-image im2col products of modest size, so OpenBLAS runs single-threaded and the
// parallelism comes from OpenMP around it.
void single_threaded_blas() {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, i64 M, i64 N, i64 K, float alpha,
               const float* A, i64 lda, const float* B, i64 ldb, float beta, float* C, i64 ldc) {
  single_threaded_blas();
  cblas_sgemm(CblasRowMajor, ta, tb, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, i64 M, i64 N, i64 K, double alpha,
               const double* A, i64 lda, const double* B, i64 ldb, double beta, double* C,
               i64 ldc) {
  single_threaded_blas();
  cblas_dgemm(CblasRowMajor, ta, tb, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

}  // namespace

std::size_t gemm_workspace_bytes(std::size_t /*budget*/) { return 0; }

template <class T>
void gemm(bool trans_a, bool trans_b, i64 M, i64 N, i64 K, T alpha,
          const T* A,  // (M, K) with leading dim lda, or (K, M) if trans_a
          i64 lda,
          const T* B,  // (K, N) with leading dim ldb, or (N, K) if trans_b
          i64 ldb, T beta,
          T* C,  // (M, N) with leading dim ldc
          i64 ldc, void* /*workspace: none needed*/, std::size_t /*workspace_bytes*/) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == T(0)) {
    // op(A) * op(B) contributes nothing: C = beta * C, without reading C when beta == 0.
    // (Done here because cblas rejects lda = 0 for K = 0 and may read A, B for alpha = 0.)
    for (i64 i = 0; i < M; ++i) {
      T* c = C + i * ldc;
      if (beta == T(0)) {
        for (i64 j = 0; j < N; ++j) c[j] = T(0);
      } else if (beta != T(1)) {
        for (i64 j = 0; j < N; ++j) c[j] *= beta;
      }
    }
    return;
  }
  blas_gemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
            alpha, A, lda, B, ldb, beta, C, ldc);
}

template void gemm<float>(bool, bool, i64, i64, i64, float, const float*, i64, const float*, i64,
                          float, float*, i64, void*, std::size_t);
template void gemm<double>(bool, bool, i64, i64, i64, double, const double*, i64, const double*,
                           i64, double, double*, i64, void*, std::size_t);

}  // namespace tally::kernels::cpu
