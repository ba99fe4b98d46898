// kernels/cuda/cuda_kernels.h — the CUDA kernels, one section per op family, with the same names
// and signatures as kernels/cpu/cpu_kernels.h, so that an op body written once as
// `kk::relu_forward<T>(n, x, y)` compiles with `kk` naming either namespace (core/dispatch.h).
//
// A plain C++ header: no CUDA types, declared in every build (core/dispatch.h reaches it only
// in a build with the CUDA backend). Every function is a template on T explicitly instantiated
// for float and, for the ops of a mixed-precision step, bf16 (the loss, the optimizers and the
// norm moments are float only); the memory-only functions (fill, copy, strided_copy, convert) take
// more types, listed in their files. As on the CPU, `template <class T> using P = compute_t<T>`
// is the type of the scalars, parameters and statistics beside T's activations (float for bf16,
// kernels/common.h): each signature is its CPU twin's. The bf16 kernels load bf16, compute in
// float32 (or in double where the float32 kernel does) and round once per element stored.
//
// Conventions (see kernels/common.h for layout, `beta` and workspaces):
//   * Pointers are device pointers of the *current* device (kernels/cuda/context.h: use_device),
//     except the shape/stride arrays of strided_copy, which are host arrays.
//   * Every kernel is enqueued on the current device's compute stream and returns without waiting
//     (the host thread runs ahead). The only exceptions are the functions that return a value
//     computed on the device: sum_all and cross_entropy_forward wait for the compute stream
//     before returning, and conv2d_workspace_bytes may run cuDNN's heuristics (host-side) once
//     per shape.
//   * Errors (a failing launch, a cuBLAS/cuDNN status) throw tally::Error naming the call,
//     file:line and the status string. Launches are checked with cudaGetLastError; a fault
//     inside a kernel surfaces at the next synchronizing call.
//   * Reductions are deterministic: fixed launch shapes and fixed summation trees, no float
//     atomics, so repeated runs give bitwise identical results.
//   * Sizes are i64 and indexing is 64-bit wherever an index can pass 2^31; the cuBLAS and cuDNN
//     calls take int sizes and throw a clear error beyond them.
#pragma once
#include <string>

#include "kernels/common.h"  // Conv2dShape, Pool2dShape

namespace tally::kernels::cuda {

template <class T>
using P = compute_t<T>;

// ---------------------------------------------------------------------------------------------
// gemm.cu — row-major GEMM on cuBLAS (cublasGemmEx on the column-major transpose).
// C (M, N) = alpha * op(A) * op(B) + beta * C, as the CPU gemm; beta == 0 never reads C.
// `workspace` is cuBLAS's scratch for this call: gemm_workspace_bytes(budget) bytes carved from
// the arena (category workspace) and set with cublasSetWorkspace just before the call; cuBLAS
// never allocates on its own. cuBLAS may fail without one (CUBLAS_STATUS_ALLOC_FAILED), so a
// null workspace or one under kGemmMinWorkspace bytes is an error. float32 math, no TF32 unless
// set_allow_tf32(true) (float32 operands only: bf16 operands are multiplied exactly and summed in
// float32, CUBLAS_COMPUTE_32F, whatever the switch).
inline constexpr std::size_t kGemmMinWorkspace = std::size_t(1) << 20;
// The workspace of every GEMM under a memory budget (an arena's budget()): budget / 16, at least
// kGemmMinWorkspace, at most cuBLAS's recommendation for the current device (32 MiB on Hopper and
// newer, 4 MiB before), in 256-byte units.
std::size_t gemm_workspace_bytes(std::size_t budget);
// The same for a product of (M, K) by (K, N) of T: the form core/ asks (the CPU twin's workspace
// depends on the shape and type); cuBLAS's does not.
template <class T>
std::size_t gemm_workspace_bytes(std::size_t budget, i64 /*M*/, i64 /*N*/, i64 /*K*/) {
  return gemm_workspace_bytes(budget);
}
// C is T, or float for bf16 inputs (a weight gradient accumulated into its float32 buffer; a
// product summed with a bias in float32): gemm<float>, gemm<bf16> and gemm<bf16, float>.
template <class T, class TC = T>
void gemm(bool trans_a, bool trans_b, i64 M, i64 N, i64 K, P<T> alpha, const T* A, i64 lda,
          const T* B, i64 ldb, P<T> beta, TC* C, i64 ldc, void* workspace = nullptr,
          std::size_t workspace_bytes = 0);
// The most workspace one convolution pass may take under a memory budget (Conv2dShape's
// workspace_limit, set by core/ from the arena's budget()): budget / 8, at most 1 GiB.
std::size_t conv_workspace_limit(std::size_t budget);

// ---------------------------------------------------------------------------------------------
// conv.cu — 2-D convolution on cuDNN (legacy convolution API; docs/gpu.md says why).
// The algorithms of forward, backward data and backward filter are chosen once per shape (its
// workspace_limit included, and per TF32 / determinism setting) from cuDNN's heuristics, cached,
// and reused: conv2d_workspace_bytes(s, pass) is the workspace of that pass's cached choice (at
// most s.workspace_limit), the same number in a dry run and a real run. Each conv2d_* call below
// takes at least its pass's workspace.
// bf16: x, y, dx, dy are bf16 (cuDNN's bf16 convolutions, products summed in float32); the float32
// master weights are rounded to a bf16 copy in the pass's workspace before the call, and the
// weight gradient is written by cuDNN in bf16 into the workspace, then added into the float32 dw.
// So a bf16 pass's workspace is cuDNN's plus that bf16 weight (or weight-gradient) buffer, in
// 256-byte aligned parts; plans are cached per dtype.
template <class T>
std::size_t conv2d_workspace_bytes(const Conv2dShape& s, ConvPass pass);
// The cached plan of a shape in words: each pass's algorithm, workspace and the candidates seen
// (float or bf16: a plan per data type).
template <class T = float>
std::string conv2d_plan_description(const Conv2dShape& s);
// The CUDA convolutions run on row-major (NCHW) tensors: never (core/ converts a channels-last input).
template <class T>
bool conv2d_takes_channels_last(const Conv2dShape&) {
  return false;
}
// Prints every new plan's description to stderr (also switched on by TALLY_LOG_CONV=1).
void set_log_conv_algorithms(bool on);
// The cuDNN API the convolutions go through (kernels/cuda/conv.cu): legacy (cudnnConvolution*),
// graph (the backend API of cudnn_graph.h: one operation graph per pass, engines from heuristics
// mode A, then the fallback mode, under the same rules) or automatic, the default: the graph API
// for bf16 and the legacy API for float32 — on an H100 (2026-11-26, ResNet-50 batch 256) bf16
// trained 10x faster through the graph API (1,202 against 117 images/s), float32 as fast through
// either (692 / 693) and TF32 3% faster through the legacy one (1,406 / 1,358).
// TALLY_CUDNN_CONV_API=legacy|graph|auto in the environment selects it at start (another value:
// a warning, and auto). Change it only between steps: a plan's dry run and its real step must
// choose alike.
enum class CudnnConvApi { automatic, legacy, graph };
void set_cudnn_conv_api(CudnnConvApi api);
CudnnConvApi cudnn_conv_api();
// y (N, K, P, Q) = conv(x (N, C, H, W), w (K, C/g, R, S)) + bias (K) ; bias may be null.
// bf16 with a bias: the bias is added to the output cuDNN has rounded to bf16, and the sum is
// rounded again (the CPU sums in float32 first and rounds once).
template <class T>
void conv2d_forward(const Conv2dShape& s, const T* x, const P<T>* w, const P<T>* bias, T* y,
                    void* workspace);
// dx (N, C, H, W) (=|+=) conv_transpose(dy (N, K, P, Q), w).
template <class T>
void conv2d_backward_data(const Conv2dShape& s, const T* dy, const P<T>* w, T* dx, P<T> beta,
                          void* workspace);
// dw (K, C/g, R, S) (=|+=) correlation of x and dy: float32 cuDNN writes with beta = 1 straight
// into the persistent gradient buffer; bf16 forms it in bf16 in the workspace and adds it.
template <class T>
void conv2d_backward_filter(const Conv2dShape& s, const T* x, const T* dy, P<T>* dw, P<T> beta,
                            void* workspace);
// db (K) (=|+=) sum over n, p, q of dy (a deterministic reduction kernel, not cuDNN).
template <class T>
void conv2d_backward_bias(const Conv2dShape& s, const T* dy, P<T>* db, P<T> beta);

// ---------------------------------------------------------------------------------------------
// context.cpp — bytes between host memory and the current device, or within it, enqueued on the
// compute stream after every kernel before them. copy_from_host and copy_to_host return once the
// copy is done (the host buffer may be reused or read at once), copy_bytes without waiting.
void copy_from_host(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);
void copy_bytes(void* dst, const void* src, std::size_t bytes);

// ---------------------------------------------------------------------------------------------
// elementwise.cu — n elements unless said otherwise; same formulas as the CPU.
template <class T> void fill(i64 n, T value, T* y);
template <class T> void copy(i64 n, const T* x, T* y);
template <class T> void add(i64 n, const T* a, const T* b, P<T> alpha, T* y);
template <class T> void axpby(i64 n, P<T> alpha, const T* x, P<T> beta, T* y);
template <class T> void mul(i64 n, const T* a, const T* b, T* y);
template <class T> void mul_backward(i64 n, const T* dy, const T* b, T* da, P<T> beta);
template <class T> void relu_forward(i64 n, const T* x, T* y);
template <class T> void relu_backward(i64 n, const T* dy, const T* y, T* dx, P<T> beta);
// shape and strides are HOST arrays of ndim <= 8 entries (passed to the kernel by value).
template <class T>
void strided_copy(int ndim, const i64* shape, const i64* strides, const T* x, T* y);
template <class T> void add_bias_rows(i64 rows, i64 cols, const T* x, const P<T>* bias, T* y);
template <class T> void sum_rows(i64 rows, i64 cols, const T* dy, P<T>* db, P<T> beta);
// Accumulated in double, as the CPU. Waits for the compute stream and returns the value.
template <class T> T sum_all(i64 n, const T* x);
// Device-side twins of the CPU's: nothing waits.
template <class T> void sum_to(i64 n, const T* x, P<T> factor, T* y);
template <class T> void broadcast_scalar(i64 n, const T* s, P<T> factor, T* y, P<T> beta);
template <class T> void fill_product(i64 n, const T* a, const T* b, T* y);
template <class S, class D> void convert(i64 n, const S* x, D* y);

// ---------------------------------------------------------------------------------------------
// norm.cu — batch norm and group norm over x (N, C, HW), PyTorch semantics as the CPU, sums and
// per-element formulas in double. Batch norm: partial sums over several blocks per channel (its
// workspace: batch_norm_workspace_bytes), a per-channel finalize, an elementwise pass; group
// norm: one block per (n, group). bf16: the same double sums and formulas on widened values, the
// statistics and parameter gradients float32, each bf16 output rounded once. The fused residual
// add and ReLU (NormAct, NormActGrad: kernels/common.h) ride on the normalizing pass and on the
// backward's partial sums and dx pass, as on the CPU.
std::size_t batch_norm_workspace_bytes(i64 N, i64 C, i64 HW, bool channels_last = false);
template <class T>
void batch_norm_forward_train(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_,
                              P<T> eps, P<T> momentum, P<T>* running_mean, P<T>* running_var, T* y,
                              P<T>* save_mean, P<T>* save_invstd, void* workspace = nullptr, NormAct<T> act = {});
template <class T>
void batch_norm_forward_eval(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_,
                             const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* y);
template <class T>
void batch_norm_backward(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma,
                         const P<T>* save_mean, const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma,
                         P<T>* dbeta, P<T> beta_param, void* workspace = nullptr, NormActGrad<T> act = {});
template <class T>
void batch_norm_backward_eval(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma,
                              const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* dx,
                              P<T> beta_dx, P<T>* dgamma, P<T>* dbeta, P<T> beta_param, void* workspace = nullptr);
template <class T>
void batch_norm_accumulate_moments(i64 C, i64 M, T eps, const T* save_mean, const T* save_invstd, double* sum,
                                   double* sum_sq);
template <class T>
void batch_norm_apply_moments(i64 C, i64 count, T momentum, const double* sum, const double* sum_sq, T* running_mean,
                              T* running_var);
template <class T>
void group_norm_forward(i64 N, i64 C, i64 HW, i64 G, const T* x, const P<T>* gamma, const P<T>* beta_,
                        P<T> eps, T* y, P<T>* save_mean, P<T>* save_invstd, NormAct<T> act = {});
template <class T>
void group_norm_backward(i64 N, i64 C, i64 HW, i64 G, const T* dy, const T* x, const P<T>* gamma,
                         const P<T>* save_mean, const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma,
                         P<T>* dbeta, P<T> beta_param, NormActGrad<T> act = {});

// ---------------------------------------------------------------------------------------------
// pool.cu — NCHW pooling, PyTorch semantics (floor mode), as the CPU. The backward kernels
// gather (one thread per input element, summing its windows in the CPU's order) instead of
// scattering, so overlapping windows need no atomics. bf16: each gradient summed in float32 in the
// CPU's order and rounded once, as the CPU's float32 plane does.
template <class T>
void max_pool2d_forward(const Pool2dShape& s, const T* x, T* y, std::int32_t* argmax);
template <class T>
void max_pool2d_backward(const Pool2dShape& s, const T* dy, const std::int32_t* argmax, T* dx,
                         P<T> beta);
template <class T>
void avg_pool2d_forward(const Pool2dShape& s, bool count_include_pad, const T* x, T* y);
template <class T>
void avg_pool2d_backward(const Pool2dShape& s, bool count_include_pad, const T* dy, T* dx,
                         P<T> beta);
template <class T>
void adaptive_avg_pool2d_forward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW, const T* x, T* y);
template <class T>
void adaptive_avg_pool2d_backward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW, const T* dy, T* dx,
                                  P<T> beta);

// ---------------------------------------------------------------------------------------------
// loss.cu — softmax cross-entropy, same semantics as the CPU (class weights, ignore_index,
// label smoothing; log-sum-exp in double). With check_targets, cross_entropy_forward waits for
// the compute stream: it returns the index of the first target outside [0, C) that is not
// ignore_index (else -1), found on the host from a copy of the targets; without, it never waits.
template <class T>
i64 cross_entropy_forward(i64 N, i64 C, const T* logits, const i64* targets, const T* class_weight,
                          i64 ignore_index, T label_smoothing, T* loss, T* sample_weight,
                          bool check_targets = true);
template <class T>
void cross_entropy_reduce(i64 N, const T* loss, const T* sample_weight, T fixed_scale, T* y, T* scale);
template <class T>
void cross_entropy_backward(i64 N, i64 C, const T* logits, const i64* targets,
                            const T* class_weight, i64 ignore_index, T label_smoothing,
                            const T* dloss, T* dlogits, T beta);

// ---------------------------------------------------------------------------------------------
// optim.cu — fused optimizer updates, torch.optim semantics as the CPU (the scalar factors are
// formed on the host in double, as there).
template <class T>
void sgd_update(i64 n, T* param, const T* grad, T* momentum_buf, T lr, T momentum, T dampening,
                T weight_decay, bool nesterov, bool first_step);
template <class T>
void adamw_update(i64 n, T* param, const T* grad, T* m, T* v, T lr, T beta1, T beta2, T eps,
                  T weight_decay, i64 step);

}  // namespace tally::kernels::cuda
