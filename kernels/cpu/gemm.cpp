// kernels/cpu/gemm.cpp — row-major GEMM on OpenBLAS (cblas_sgemm / cblas_dgemm).
// C (M, N) = alpha * op(A) * op(B) + beta * C; beta == 0 never reads C.
// bf16 inputs (OpenBLAS has no bf16 GEMM in Debian's build): A and B widened to float32 in the
// workspace (exact), multiplied by sgemm (float32 products and sums), C rounded once if bf16.
#include <cblas.h>

#include <type_traits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/instantiate.h"

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

// rows x cols of a row-major matrix with leading dimension ld, widened into a dense float block.
void widen(i64 rows, i64 cols, const bf16* x, i64 ld, float* y) {
#pragma omp parallel for schedule(static) if (rows * cols > (i64{1} << 15))
  for (i64 r = 0; r < rows; ++r)
    for (i64 c = 0; c < cols; ++c) y[r * cols + c] = float(x[r * ld + c]);
}

}  // namespace

template <class T>
std::size_t gemm_workspace_bytes(std::size_t /*budget*/, i64 M, i64 N, i64 K) {
  if constexpr (std::is_same_v<T, bf16>) return sizeof(float) * static_cast<std::size_t>(M * K + K * N + M * N);
  return 0;
}

template <class T, class TC>
void gemm(bool trans_a, bool trans_b, i64 M, i64 N, i64 K, P<T> alpha,
          const T* A,  // (M, K) with leading dim lda, or (K, M) if trans_a
          i64 lda,
          const T* B,  // (K, N) with leading dim ldb, or (N, K) if trans_b
          i64 ldb, P<T> beta,
          TC* C,  // (M, N) with leading dim ldc
          i64 ldc, void* workspace, std::size_t /*workspace_bytes*/) {
  using S = P<T>;
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == S(0)) {
    // op(A) * op(B) contributes nothing: C = beta * C, without reading C when beta == 0.
    // (Done here because cblas rejects lda = 0 for K = 0 and may read A, B for alpha = 0.)
    for (i64 i = 0; i < M; ++i) {
      TC* c = C + i * ldc;
      if (beta == S(0)) {
        for (i64 j = 0; j < N; ++j) c[j] = TC(0);
      } else if (beta != S(1)) {
        for (i64 j = 0; j < N; ++j) c[j] = TC(S(c[j]) * beta);
      }
    }
    return;
  }
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, bf16>) {
    float* a = static_cast<float*>(workspace);  // op(A) as stored, dense
    float* b = a + M * K;
    float* c = b + K * N;
    const i64 a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    const i64 b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    widen(a_rows, a_cols, A, lda, a);
    widen(b_rows, b_cols, B, ldb, b);
    if constexpr (std::is_same_v<TC, float>) {
      blas_gemm(ta, tb, M, N, K, alpha, a, a_cols, b, b_cols, beta, C, ldc);
    } else {
      if (beta != 0.f) widen(M, N, C, ldc, c);
      blas_gemm(ta, tb, M, N, K, alpha, a, a_cols, b, b_cols, beta, c, N);
      for (i64 i = 0; i < M; ++i)
        for (i64 j = 0; j < N; ++j) C[i * ldc + j] = bf16(c[i * N + j]);
    }
  } else {
    blas_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

template std::size_t gemm_workspace_bytes<float>(std::size_t, i64, i64, i64);
template std::size_t gemm_workspace_bytes<double>(std::size_t, i64, i64, i64);
template std::size_t gemm_workspace_bytes<bf16>(std::size_t, i64, i64, i64);
TALLY_INSTANTIATE_GEMM(float, float)
TALLY_INSTANTIATE_GEMM(double, double)
TALLY_INSTANTIATE_GEMM(bf16, bf16)
TALLY_INSTANTIATE_GEMM(bf16, float)

}  // namespace tally::kernels::cpu
