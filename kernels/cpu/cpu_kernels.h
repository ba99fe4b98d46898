// kernels/cpu/cpu_kernels.h — the CPU reference kernels, one section per op family.
//
// Every function is a template on T (float, double, and bf16 for the ops of a mixed-precision
// step), explicitly instantiated in the matching .cpp file (gemm.cpp, conv.cpp, norm.cpp,
// pool.cpp, loss.cpp, elementwise.cpp, optim.cpp). `template <class T> using P = compute_t<T>`
// below is the type of the scalars, parameters and statistics beside T's activations (float for
// bf16, kernels/common.h). The bf16 kernels compute in float32 and round once per element stored.
// See kernels/common.h for the layout, `beta` and workspace conventions.
// These are the reference every CUDA kernel is tested against: clarity and exactness first,
// then speed (OpenBLAS for GEMM, OpenMP over channels/batch where it pays on a few cores).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "kernels/common.h"

namespace tally::kernels::cpu {

template <class T>
using P = compute_t<T>;

// ---------------------------------------------------------------------------------------------
// gemm.cpp — row-major GEMM on OpenBLAS (cblas_sgemm / cblas_dgemm).
// C (M, N) = alpha * op(A) * op(B) + beta * C, op(A) is (M, K), op(B) is (K, N).
// A is (M, K) with leading dimension lda if !trans_a, else (K, M); likewise B.
// beta == 0 never reads C. C is T, or float for bf16 inputs (a weight gradient accumulated into
// its float32 buffer). Workspace: none for float and double (the CUDA twin's cuBLAS scratch is
// why the arguments exist); for bf16 the float32 copies of A, B (and C when C is bf16) that
// sgemm multiplies — float32 math, one rounding of C.
template <class T>
std::size_t gemm_workspace_bytes(std::size_t budget, i64 M, i64 N, i64 K);
template <class T, class TC = T>
void gemm(bool trans_a, bool trans_b, i64 M, i64 N, i64 K, P<T> alpha, const T* A, i64 lda,
          const T* B, i64 ldb, P<T> beta, TC* C, i64 ldc, void* workspace = nullptr,
          std::size_t workspace_bytes = 0);

// ---------------------------------------------------------------------------------------------
// profile.cpp — per-op host time (`tally train --profile` on the CPU; core/profiler.h): with
// profiling on, an OpTimer around each op's kernels (core/dispatch.h) adds its time to a table per
// op name, forward and backward apart; profile_report() prints it, largest first (format_profile:
// the table both backends print). The same functions as the CUDA backend's profiler.
struct ProfileRow {
  std::int64_t calls = 0;
  double ms = 0;
};
void set_profiling(bool on);
bool profiling();
class OpTimer {
 public:
  OpTimer(const char* op, bool backward);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  const char* op_ = nullptr;
  bool backward_ = false;
  std::chrono::steady_clock::time_point start_{};
};
// Host times are in the table as soon as an op returns: nothing to collect (the CUDA twin reads
// its events here).
inline void profile_collect() {}
std::string profile_report(const std::string& title);
void profile_reset();
std::string format_profile(const std::string& title, const std::string& what,
                           const std::map<std::string, ProfileRow>& table);

// ---------------------------------------------------------------------------------------------
// conv.cpp — 2-D convolution (cross-correlation, as PyTorch), NCHW: float32 and bf16 on oneDNN
// where the build has it and oneDNN takes the shape (the default; bf16 needs AVX-512), else
// im2col + GEMM (the reference). The weights, bias and their gradients are P<T> (float32 for a
// bf16 convolution: the master weights, rounded to bf16 as the convolution reads them; weight
// and bias gradients computed and accumulated in float32). A bf16 convolution that oneDNN cannot
// run converts chunks of samples to float32 in its workspace and runs the float32 convolution on
// them, with the weights rounded to bf16 — the same products, float32 sums.
enum class ConvAlgorithm { reference, onednn };
// The float32 algorithm of every later call (onednn falls back to reference in a build without
// oneDNN). Change it only between steps: a plan's dry run and its real step must see the same.
void set_conv_algorithm(ConvAlgorithm a);
ConvAlgorithm conv_algorithm();
bool have_onednn();
// Whether a float32 (or, with bf16_activations, a bf16) call of `pass` on shape `s` runs on
// oneDNN now (the algorithm is onednn and oneDNN takes the shape and type), rather than on the
// reference (float32) or the widened float32 fallback (bf16).
bool conv2d_on_onednn(const Conv2dShape& s, ConvPass pass, bool bf16_activations = false);
// Whether the three passes of `s` (taken as channels_last) all run channels-last here: on oneDNN
// (its direct convolutions read and write NHWC without reordering), with no bias. Otherwise core/
// runs the convolution on row-major tensors.
template <class T>
bool conv2d_takes_channels_last(Conv2dShape s);
// The most workspace one oneDNN pass may take under a memory budget (Conv2dShape's
// workspace_limit, set by core/ from the arena's budget): budget / 32, at least 64 MiB. A pass
// over it runs over chunks of samples (conv_onednn.cpp).
std::size_t conv_workspace_limit(std::size_t budget);
// Scratch bytes the conv2d_* kernel of `pass` needs. Reference: one image's im2col columns, or 0
// where the convolution is a plain GEMM (1x1, stride 1, no padding), the same for every pass.
// oneDNN: its layout buffers and scratchpad for this shape and pass, at the current OpenMP
// thread count (the planner's dry runs and the real steps run at the same count).
template <class T>
std::size_t conv2d_workspace_bytes(const Conv2dShape& s, ConvPass pass);
// y (N, K, P, Q) = conv(x (N, C, H, W), w (K, C/g, R, S)) + bias (K) ; bias may be null.
template <class T>
void conv2d_forward(const Conv2dShape& s, const T* x, const P<T>* w, const P<T>* bias, T* y,
                    void* workspace);
// dx (N, C, H, W) (=|+=) conv_transpose(dy (N, K, P, Q), w).
template <class T>
void conv2d_backward_data(const Conv2dShape& s, const T* dy, const P<T>* w, T* dx, P<T> beta,
                          void* workspace);
// dw (K, C/g, R, S) (=|+=) sum_n dy_n * im2col(x_n)^T — GEMM with beta = 1 after the first
// image, so the persistent gradient buffer is the accumulator.
template <class T>
void conv2d_backward_filter(const Conv2dShape& s, const T* x, const T* dy, P<T>* dw, P<T> beta,
                            void* workspace);
// db (K) (=|+=) sum over n, p, q of dy.
template <class T>
void conv2d_backward_bias(const Conv2dShape& s, const T* dy, P<T>* db, P<T> beta);

// ---------------------------------------------------------------------------------------------
// elementwise.cpp — n elements unless said otherwise.
// Bytes into, out of and within CPU memory: the twins of the CUDA backend's host transfers, so
// that core/ moves data by one dispatch whatever the device (all three are memcpy here).
void copy_from_host(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);
void copy_bytes(void* dst, const void* src, std::size_t bytes);
template <class T> void fill(i64 n, T value, T* y);
template <class T> void copy(i64 n, const T* x, T* y);
// y = a + alpha * b (alpha = 1 for residual add, -1 for subtraction)
template <class T> void add(i64 n, const T* a, const T* b, P<T> alpha, T* y);
// y (=|+=) alpha * x   (scale forward, and the backward of add/scale)
template <class T> void axpby(i64 n, P<T> alpha, const T* x, P<T> beta, T* y);
// y = a * b elementwise
template <class T> void mul(i64 n, const T* a, const T* b, T* y);
// da (=|+=) dy * b
template <class T> void mul_backward(i64 n, const T* dy, const T* b, T* da, P<T> beta);
template <class T> void relu_forward(i64 n, const T* x, T* y);
// dx (=|+=) dy * (y > 0), y the forward output
template <class T> void relu_backward(i64 n, const T* dy, const T* y, T* dx, P<T> beta);
// Gather a strided view into a dense buffer: y[i0..] = x[sum_k i_k * strides[k]], row-major
// over `shape` (ndim <= 8); strides in elements, may be 0 (broadcast).
template <class T>
void strided_copy(int ndim, const i64* shape, const i64* strides, const T* x, T* y);
// Rows: x (rows, cols). y (rows, cols) = x + bias (cols) broadcast over rows.
template <class T> void add_bias_rows(i64 rows, i64 cols, const T* x, const P<T>* bias, T* y);
// db (cols) (=|+=) sum over rows of dy (rows, cols)
template <class T> void sum_rows(i64 rows, i64 cols, const T* dy, P<T>* db, P<T> beta);
// Full reductions (accumulated in double).
template <class T> T sum_all(i64 n, const T* x);
// y[0] = factor * sum of x (accumulated in double), written where y lives: no value reaches the
// host (the CUDA twin never waits).
template <class T> void sum_to(i64 n, const T* x, P<T> factor, T* y);
// y (n) (=|+=) factor * s[0]: a scalar's gradient spread over a tensor, read where it lives.
template <class T> void broadcast_scalar(i64 n, const T* s, P<T> factor, T* y, P<T> beta);
// y (n) = a[0] * b[0].
template <class T> void fill_product(i64 n, const T* a, const T* b, T* y);
// Convert between element types (float <-> double), n elements.
template <class S, class D> void convert(i64 n, const S* x, D* y);

// ---------------------------------------------------------------------------------------------
// norm.cpp — batch norm and group norm over x (N, C, HW) with PyTorch's semantics.
// Batch norm, training: per channel c, mean and biased variance over (N, HW);
//   y = (x - mean) * invstd * gamma + beta_ ; invstd = 1 / sqrt(var + eps).
//   save_mean (C), save_invstd (C) are written for the backward.
//   If running_mean / running_var are non-null they are updated in place:
//     running_mean = (1 - momentum) * running_mean + momentum * mean
//     running_var  = (1 - momentum) * running_var  + momentum * var * M / (M - 1),  M = N*HW
//   gamma / beta_ may be null (affine = false: gamma = 1, beta = 0).
//   `workspace` (batch_norm_workspace_bytes, 0 on the CPU) holds the CUDA twin's per-block
//   partial sums; the CPU ignores it.
std::size_t batch_norm_workspace_bytes(i64 N, i64 C, i64 HW, bool channels_last = false);
// The channels-last batch norms run an AVX-512 copy of their loops where the CPU has AVX-512
// (the same bits as the baseline copy: the same loops, no contraction). TALLY_CPU_ISA=baseline in
// the environment, or set_avx512_kernels(false), runs the baseline copy; the setter returns
// whether the AVX-512 copy runs now (false where the CPU or the compiler lacks it).
bool set_avx512_kernels(bool on);
bool avx512_kernels();
// `act` fuses the residual add and the ReLU after it (kernels/common.h): y = relu(bn(x) + residual)
// in the same pass over x that normalizes.
template <class T>
void batch_norm_forward_train(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_,
                              P<T> eps, P<T> momentum, P<T>* running_mean, P<T>* running_var, T* y,
                              P<T>* save_mean, P<T>* save_invstd, void* workspace = nullptr,
                              NormAct<T> act = {});
// Eval mode: y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta_.
template <class T>
void batch_norm_forward_eval(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_,
                             const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* y);
// Training-mode backward. dx (=|+=) with beta_dx; dgamma, dbeta (C) (=|+=) with beta_param;
// any of dx, dgamma, dbeta may be null (not needed). `act`: the fused forward's ReLU (dy masked
// by y > 0 first) and the residual's gradient, written in the pass that sums dy.
template <class T>
void batch_norm_backward(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma,
                         const P<T>* save_mean, const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma,
                         P<T>* dbeta, P<T> beta_param, void* workspace = nullptr, NormActGrad<T> act = {});
// Eval-mode backward (statistics are constants): dx = dy * gamma * invstd_running.
template <class T>
void batch_norm_backward_eval(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma,
                              const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* dx,
                              P<T> beta_dx, P<T>* dgamma, P<T>* dbeta, P<T> beta_param, void* workspace = nullptr);
// Group norm: G groups of C/G channels; statistics per (n, g) over (C/G, HW), biased var.
// gamma / beta_ are per channel (C), may be null. save_mean, save_invstd are (N, G).
// Micro-batch moments (MBP): sum (C) += M * mean, sum_sq (C) += M * (var + mean^2) with
// var = 1 / invstd^2 - eps from a training forward's saved statistics, M = N * HW. Double sums.
template <class T>
void batch_norm_accumulate_moments(i64 C, i64 M, T eps, const T* save_mean, const T* save_invstd, double* sum,
                                   double* sum_sq);
// The running statistics from `count` elements' moments, as one batch of them would update them:
// mean = sum / count, var = sum_sq / count - mean^2 (biased); running_mean = (1 - momentum)
// running_mean + momentum mean; running_var likewise with var * count / (count - 1).
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
// pool.cpp — NCHW pooling, PyTorch semantics (floor mode).
// y (N, C, P, Q); argmax (N, C, P, Q) = index h*W + w of the max inside the input plane.
// Padding counts as -inf. NaN propagates (a NaN input wins, as in PyTorch).
template <class T>
void max_pool2d_forward(const Pool2dShape& s, const T* x, T* y, std::int32_t* argmax);
// dx (N, C, H, W) (=|+=) scatter of dy through argmax.
template <class T>
void max_pool2d_backward(const Pool2dShape& s, const T* dy, const std::int32_t* argmax, T* dx,
                         P<T> beta);
// Average pooling; count_include_pad = true divides by kh*kw (PyTorch default), else by the
// number of in-bounds elements.
template <class T>
void avg_pool2d_forward(const Pool2dShape& s, bool count_include_pad, const T* x, T* y);
template <class T>
void avg_pool2d_backward(const Pool2dShape& s, bool count_include_pad, const T* dy, T* dx,
                         P<T> beta);
// Adaptive average pooling to (OH, OW): window for output i is
// [floor(i*H/OH), ceil((i+1)*H/OH)) as in PyTorch. OH = OW = 1 is global average pooling.
template <class T>
void adaptive_avg_pool2d_forward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW, const T* x, T* y);
template <class T>
void adaptive_avg_pool2d_backward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW, const T* dy, T* dx,
                                  P<T> beta);

// ---------------------------------------------------------------------------------------------
// loss.cpp — softmax cross-entropy over logits (N, C) with int64 targets (N), PyTorch's
// torch.nn.functional.cross_entropy semantics:
//   class_weight (C) may be null (all ones). A sample whose target == ignore_index has
//   loss 0 and weight 0. With label smoothing e, for a kept sample i with target t:
//     loss_i = (1 - e) * w[t] * (-log p_t) + (e / C) * sum_c w[c] * (-log p_c)
//   and sample_weight_i = w[t]  (the mean reduction divides sum_i loss_i by sum_i w[t_i]).
// Writes per-sample loss (N) and per-sample weight (N); returns nothing else. A target outside
// [0, C) that is not ignore_index is reported by returning its index (else -1): nothing throws
// from a kernel.
// check_targets = false: the caller has validated the targets (the MBP executor does, on the
// host, before they are uploaded); nothing is checked and -1 is returned.
template <class T>
i64 cross_entropy_forward(i64 N, i64 C, const T* logits, const i64* targets, const T* class_weight,
                          i64 ignore_index, T label_smoothing, T* loss, T* sample_weight,
                          bool check_targets = true);
// The reduction, where the values live: scale[0] = fixed_scale if fixed_scale > 0 (a divisor or
// the sum reduction), else 1 / sum_i sample_weight_i (the mean; 0/0 is NaN, as PyTorch);
// y[0] = scale[0] * sum_i loss_i. Sums in double.
template <class T>
void cross_entropy_reduce(i64 N, const T* loss, const T* sample_weight, T fixed_scale, T* y, T* scale);
// dlogits (N, C) (=|+=) d(sum_i scale_i * loss_i)/dlogits with scale_i = dloss[i]
// (dloss (N) is the upstream gradient of each per-sample loss; reductions fold into it).
template <class T>
void cross_entropy_backward(i64 N, i64 C, const T* logits, const i64* targets,
                            const T* class_weight, i64 ignore_index, T label_smoothing,
                            const T* dloss, T* dlogits, T beta);

// ---------------------------------------------------------------------------------------------
// optim.cpp — fused optimizer updates over n parameters (torch.optim semantics).
// SGD (torch.optim.SGD): g = grad + wd * p; if momentum != 0: buf = first ? g : momentum * buf +
// (1 - dampening) * g; g = nesterov ? g + momentum * buf : buf; p -= lr * g.
template <class T>
void sgd_update(i64 n, T* param, const T* grad, T* momentum_buf, T lr, T momentum, T dampening,
                T weight_decay, bool nesterov, bool first_step);
// AdamW (torch.optim.AdamW, amsgrad = false): p *= 1 - lr * wd; m = b1 m + (1-b1) g;
// v = b2 v + (1-b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps).
template <class T>
void adamw_update(i64 n, T* param, const T* grad, T* m, T* v, T lr, T beta1, T beta2, T eps,
                  T weight_decay, i64 step);

}  // namespace tally::kernels::cpu
