// kernels/cuda/conv.cu — 2-D convolution on cuDNN, NCHW, float32 and bf16: forward, backward data
// and backward filter through cuDNN's legacy convolution API; bias (forward) and backward bias
// through small deterministic kernels of tally's own. The CUDA twin of kernels/cpu/conv.cpp.
//
// Plans (docs/gpu.md, "Convolutions"): the first call for a shape builds a Plan — the tensor,
// filter and convolution descriptors, and for each pass (forward, backward data, backward filter)
// the algorithm, math type and exact workspace size — and caches it under the shape (its
// workspace limit included), the switches that change the choice (TF32, determinism) and the
// device. Algorithms come from cuDNN's heuristics (cudnnGet*Algorithm_v7): host-side, no device
// memory, no timing runs, the same answer every time, so a dry run and the real run that follows
// choose — and allocate — identically. A pass takes the best-ranked candidate that
//   * the heuristics report as supported (status CUDNN_STATUS_SUCCESS),
//   * is deterministic when deterministic() is on,
//   * does not use tensor-op (TF32) math unless allow_tf32() is on,
//   * and, with the descriptor set to the math type it will run with, has a workspace size that
//     cuDNN reports without error and that is at most the shape's workspace_limit.
// The heuristics' own workspace estimate is not trusted: the size is asked again for the math
// type that runs. When no ranked candidate passes, every algorithm of the pass is tried in enum
// order under the same rules (cuDNN 9's heuristics list only some). If deterministic() is on and
// no deterministic algorithm fits, the search runs again without that rule, with a warning when
// the plan runs (as PyTorch, whose default is not deterministic, would run; the automatic API
// takes the graph API for such a shape instead, use_graph_api); none at all: a clear error.
// Each pass has its own workspace (conv2d_workspace_bytes(s, pass)). TALLY_LOG_CONV=1 in the
// environment (or set_log_conv_algorithms(true)) prints every plan's choice and candidates.
//
// bf16 (mixed precision: bf16 activations, float32 master weights): x, y, dx and dy are
// CUDNN_DATA_BFLOAT16 and the convolution's compute type is CUDNN_DATA_FLOAT (cuDNN's
// PSEUDO_BFLOAT16 configuration: bf16 products summed in float32). The TF32 rule does not apply
// (bf16 operands lose nothing on tensor cores), so a bf16 plan takes tensor-op algorithms; but not
// the FFT and Winograd algorithms, which transform bf16 data into a domain where it is rounded to
// bf16 again (a 5x5 backward data through WINOGRAD_NONFUSED was 7 bf16 ulps off the float32 sum
// on an H100, 2026-11-26; float32 keeps them: their error there is of float32 size). cuDNN
// takes the weights in the data's type: each forward and backward data first rounds the float32
// weights into a bf16 copy at the start of its workspace (the CPU's oneDNN rounds them as it
// reorders them). The backward filter has cuDNN write a bf16 weight gradient there, which a kernel
// then adds into the float32 dw (dw = g + beta * dw): the weight gradient passes through bf16
// once before its float32 accumulation, as under PyTorch's autocast (the CPU forms it in float32).
// A bf16 pass's workspace is that bf16 buffer, 256-byte aligned, then cuDNN's; plans are cached
// per dtype.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/instantiate.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {

// ---- CUDA kernels ------------------------------------------------------------------------------

// y (N, K, PQ) += bias (K), as the CPU adds the bias after the convolution. bf16: y as cuDNN rounded
// it plus the float32 bias, rounded again — two roundings where the CPU's widened route has one.
template <class T>
__global__ void add_channel_bias_kernel(i64 total, i64 K, i64 PQ, const compute_t<T>* __restrict__ bias,
                                        T* __restrict__ y) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, total) y[i] = static_cast<T>(M(y[i]) + bias[(i / PQ) % K]);
}

// db (K) (=|+=) sum over n and pq of dy (N, K, PQ): one block per channel; each thread sums its
// strided share in double (as the CPU), then the block tree. db is float32 beside bf16 dy.
template <class T>
__global__ void channel_sum_kernel(i64 N, i64 K, i64 PQ, const T* __restrict__ dy, compute_t<T>* __restrict__ db,
                                   compute_t<T> beta) {
  using S = compute_t<T>;
  const i64 M = N * PQ;
  TALLY_BLOCK_LOOP(k, K) {
    double acc = 0.0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const i64 n = m / PQ, j = m - n * PQ;
      acc += static_cast<double>(dy[(n * K + k) * PQ + j]);
    }
    acc = detail::block_sum(acc);
    if (threadIdx.x == 0) db[k] = beta == S(0) ? static_cast<S>(acc) : beta * db[k] + static_cast<S>(acc);
  }
}

// y (n elements) = beta * y, never reading y when beta == 0 (an empty pass's dx or dw).
template <class T>
__global__ void scale_kernel(i64 n, compute_t<T> beta, T* y) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, n) y[i] = beta == M(0) ? T(0) : static_cast<T>(beta * M(y[i]));
}

// dw (n) = g + beta * dw in float32: the bf16 weight gradient cuDNN wrote into the workspace, added
// into the float32 gradient buffer (beta == 0 never reads dw).
__global__ void add_weight_gradient_kernel(i64 n, const bf16* __restrict__ g, float beta, float* __restrict__ dw) {
  TALLY_GRID_LOOP(i, n) dw[i] = beta == 0.f ? float(g[i]) : beta * dw[i] + float(g[i]);
}

// Elements of the weight (K, C/g, R, S), and the bytes of its bf16 copy in a bf16 pass's workspace
// (256-byte aligned, so that cuDNN's part after it is aligned as the arena's blocks are).
i64 weight_count(const Conv2dShape& s) { return s.K * (s.C / s.groups) * s.R * s.S; }
std::size_t bf16_weight_bytes(const Conv2dShape& s) {
  const std::size_t bytes = static_cast<std::size_t>(weight_count(s)) * sizeof(bf16);
  return (bytes + 255) / 256 * 256;
}

template <class T>
constexpr bool is_bf16 = std::is_same_v<T, bf16>;

#if TALLY_HAVE_CUDNN

// ---- plans -------------------------------------------------------------------------------------

int to_int(i64 v, const char* what, const Conv2dShape& s) {
  if (v < 0 || v > INT_MAX)
    detail::fail(std::string("conv2d: ") + what + " = " + std::to_string(v) +
                 " does not fit cuDNN's 32-bit int (N " + std::to_string(s.N) + ", C " + std::to_string(s.C) +
                 ", H " + std::to_string(s.H) + ", W " + std::to_string(s.W) + "): split the batch");
  return static_cast<int>(v);
}

// A cuDNN descriptor that owns itself: created with the object, destroyed with it — also when
// building a plan throws half-way (an algorithm cuDNN cannot offer, a size beyond int).
template <class D, cudnnStatus_t (*Create)(D*), cudnnStatus_t (*Destroy)(D)>
class Descriptor {
 public:
  Descriptor() { TALLY_CUDNN_CHECK(Create(&d_)); }
  ~Descriptor() {
    if (d_) (void)Destroy(d_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  operator D() const { return d_; }

 private:
  D d_ = nullptr;
};
using TensorDescriptor = Descriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor>;
using FilterDescriptor = Descriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>;
using ConvDescriptor =
    Descriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor, cudnnDestroyConvolutionDescriptor>;

struct Plan {
  bool bf16 = false;  // the data type: bf16 (x, y, w in CUDNN_DATA_BFLOAT16) or float32
  TensorDescriptor x, y;
  FilterDescriptor w;
  // One convolution descriptor per pass: each carries the math type of its algorithm.
  ConvDescriptor fwd_conv, bwd_data_conv, bwd_filter_conv;
  cudnnConvolutionFwdAlgo_t fwd_algo{};
  cudnnConvolutionBwdDataAlgo_t bwd_data_algo{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter_algo{};
  std::size_t fwd_ws = 0, bwd_data_ws = 0, bwd_filter_ws = 0;
  std::string description;  // the choice and the candidates, for the log and for tests
  // With deterministic() on, the passes that found no deterministic algorithm within the limit and
  // took another: the warning, printed once when the plan first runs or is sized (legacy_plan),
  // not when it is only asked (the automatic API may take the graph API for the shape instead).
  std::string nondeterministic;
  mutable std::once_flag warned;
};

// Everything a plan depends on.
using PlanKey = std::tuple<int /*device*/, bool /*bf16*/, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64,
                           i64, i64, bool /*tf32*/, bool /*deterministic*/, std::size_t /*workspace limit*/,
                           bool /*channels last*/>;

PlanKey key_of(const Conv2dShape& s, bool bf16) {
  return {current_device(), bf16,       s.N,     s.C,     s.H,     s.W,     s.K,      s.R,
          s.S,              s.stride_h, s.stride_w, s.pad_h, s.pad_w, s.dil_h, s.dil_w, s.groups,
          allow_tf32(),     deterministic(), s.workspace_limit, s.channels_last};
}

bool is_tensor_op(cudnnMathType_t m) { return m == CUDNN_TENSOR_OP_MATH || m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION; }
// Whether a plan may run on tensor cores: float32 with TF32 allowed, or bf16 (exact products).
bool tensor_ops_allowed(bool bf16) { return bf16 || allow_tf32(); }
// The math type a descriptor runs with: where tensor ops are not allowed, FMA math ("default"
// math lets cuDNN use TF32 tensor cores on Ampere and newer).
cudnnMathType_t run_math(cudnnMathType_t m, bool bf16) { return tensor_ops_allowed(bf16) ? m : CUDNN_FMA_MATH; }

void set_conv_desc(cudnnConvolutionDescriptor_t d, const Conv2dShape& s, bool bf16) {
  TALLY_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d, to_int(s.pad_h, "pad_h", s), to_int(s.pad_w, "pad_w", s),
                                                    to_int(s.stride_h, "stride_h", s), to_int(s.stride_w, "stride_w", s),
                                                    to_int(s.dil_h, "dil_h", s), to_int(s.dil_w, "dil_w", s),
                                                    CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  TALLY_CUDNN_CHECK(cudnnSetConvolutionGroupCount(d, to_int(s.groups, "groups", s)));
  // Heuristics are asked with the math type the run may use.
  TALLY_CUDNN_CHECK(cudnnSetConvolutionMathType(d, tensor_ops_allowed(bf16) ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH));
}

std::string shape_text(const Conv2dShape& s) {
  return "input (" + std::to_string(s.N) + ", " + std::to_string(s.C) + ", " + std::to_string(s.H) + ", " +
         std::to_string(s.W) + "), weight (" + std::to_string(s.K) + ", " + std::to_string(s.C / s.groups) + ", " +
         std::to_string(s.R) + ", " + std::to_string(s.S) + "), stride " + std::to_string(s.stride_h) + "x" +
         std::to_string(s.stride_w) + ", padding " + std::to_string(s.pad_h) + "x" + std::to_string(s.pad_w) +
         ", dilation " + std::to_string(s.dil_h) + "x" + std::to_string(s.dil_w) + ", groups " + std::to_string(s.groups);
}

[[noreturn]] void no_algorithm(const char* pass, const Conv2dShape& s, bool bf16, const std::string& tried) {
  detail::fail(std::string("conv2d ") + pass + ": cuDNN offers no " + (bf16 ? "bf16 " : "") + "algorithm for " +
               shape_text(s) + " within a workspace limit of " + std::to_string(s.workspace_limit) + " bytes" +
               (deterministic() ? " that is deterministic" : "") + (tensor_ops_allowed(bf16) ? "" : " without TF32") +
               " (candidates: " + tried + "): raise the memory budget, or allow more");
}

// The parts of one pass that differ: its algorithm type, heuristics, workspace query, which of its
// algorithms are not deterministic (for the enum-order fallback, where cuDNN reports nothing) and
// which compute in a transformed domain (FFT, Winograd: refused for bf16, below).
struct FwdPass {
  using Algo = cudnnConvolutionFwdAlgo_t;
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  static constexpr const char* name = "forward";
  static constexpr int count = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static cudnnStatus_t heuristics(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t c, int* n, Perf* perf) {
    return cudnnGetConvolutionForwardAlgorithm_v7(h, p.x, p.w, c, p.y, count, n, perf);
  }
  static cudnnStatus_t size(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t c, Algo a, std::size_t* b) {
    return cudnnGetConvolutionForwardWorkspaceSize(h, p.x, p.w, c, p.y, a, b);
  }
  static bool nondeterministic(Algo) { return false; }
  static bool transformed(Algo a) {
    return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
           a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
  }
};
struct BwdDataPass {
  using Algo = cudnnConvolutionBwdDataAlgo_t;
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  static constexpr const char* name = "backward data";
  static constexpr int count = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static cudnnStatus_t heuristics(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t c, int* n, Perf* perf) {
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p.w, p.y, c, p.x, count, n, perf);
  }
  static cudnnStatus_t size(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t c, Algo a, std::size_t* b) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w, p.y, c, p.x, a, b);
  }
  static bool nondeterministic(Algo a) { return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0; }
  static bool transformed(Algo a) {
    return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
           a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
  }
};
struct BwdFilterPass {
  using Algo = cudnnConvolutionBwdFilterAlgo_t;
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  static constexpr const char* name = "backward filter";
  static constexpr int count = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static cudnnStatus_t heuristics(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t c, int* n, Perf* perf) {
    return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p.x, p.y, c, p.w, count, n, perf);
  }
  static cudnnStatus_t size(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t c, Algo a, std::size_t* b) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.x, p.y, c, p.w, a, b);
  }
  static bool nondeterministic(Algo a) {
    return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
  }
  static bool transformed(Algo a) {
    return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
           a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
  }
};

// Chooses the algorithm of one pass (rules at the top of this file), sets its math type on
// `conv` and returns it with its workspace size; appends what was tried to `log`.
template <class Pass>
bool choose_among(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t conv, const Conv2dShape& s,
                  bool require_deterministic, typename Pass::Algo* chosen, std::size_t* ws, std::string* log,
                  std::string* seen);

template <class Pass>
typename Pass::Algo choose(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t conv, const Conv2dShape& s,
                           std::size_t* ws, std::string* log, std::string* warning) {
  typename Pass::Algo algo{};
  std::string seen;
  if (choose_among<Pass>(h, p, conv, s, deterministic(), &algo, ws, log, &seen)) return algo;
  if (deterministic()) {
    // No deterministic algorithm fits: rather than stop a training run, take the best other one
    // (as PyTorch does by default) and say so once.
    std::string seen2;
    if (choose_among<Pass>(h, p, conv, s, false, &algo, ws, log, &seen2)) {
      *log += " -- NOT deterministic: no deterministic algorithm fits";
      *warning += "tally: warning: conv2d " + std::string(Pass::name) + " of " + shape_text(s) +
                  ": no deterministic cuDNN algorithm fits the workspace limit of " +
                  std::to_string(s.workspace_limit) + " bytes; using algorithm " +
                  std::to_string(static_cast<int>(algo)) + ", which is not deterministic\n";
      return algo;
    }
  }
  no_algorithm(Pass::name, s, p.bf16, seen);
}

template <class Pass>
bool choose_among(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t conv, const Conv2dShape& s,
                  bool require_deterministic, typename Pass::Algo* chosen, std::size_t* ws, std::string* log,
                  std::string* seen_out) {
  using Algo = typename Pass::Algo;
  typename Pass::Perf perf[Pass::count];
  int n = 0;
  TALLY_CUDNN_CHECK(Pass::heuristics(h, p, conv, &n, perf));
  bool tried[Pass::count] = {};
  std::string seen;
  // Sets the run's math type, asks the real size; true if the algorithm fits the limit.
  auto fits = [&](Algo a, cudnnMathType_t math, std::string* note) {
    TALLY_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, run_math(math, p.bf16)));
    std::size_t bytes = 0;
    const cudnnStatus_t st = Pass::size(h, p, conv, a, &bytes);
    if (st != CUDNN_STATUS_SUCCESS) {
      *note = std::string("size query: ") + cudnnGetErrorString(st);
      return false;
    }
    *note = std::to_string(bytes) + " B";
    if (bytes > s.workspace_limit) {
      *note += " > limit";
      return false;
    }
    *ws = bytes;
    return true;
  };
  for (int i = 0; i < n; ++i) {
    const auto& c = perf[i];
    if (static_cast<int>(c.algo) >= 0 && static_cast<int>(c.algo) < Pass::count) tried[static_cast<int>(c.algo)] = true;
    std::string note;
    bool ok = false;
    if (c.status != CUDNN_STATUS_SUCCESS) note = cudnnGetErrorString(c.status);
    else if (require_deterministic && c.determinism != CUDNN_DETERMINISTIC) note = "not deterministic";
    else if (!tensor_ops_allowed(p.bf16) && is_tensor_op(c.mathType)) note = "tensor-op math";
    else if (p.bf16 && Pass::transformed(c.algo)) note = "FFT/Winograd on bf16";
    else ok = fits(c.algo, c.mathType, &note);
    seen += (seen.empty() ? "" : ", ") + std::to_string(static_cast<int>(c.algo)) + " " + note;
    if (ok) {
      *log += std::string(Pass::name) + " algo " + std::to_string(static_cast<int>(c.algo)) + " (" +
              std::to_string(*ws) + " B, rank " + std::to_string(i) + "; candidates: " + seen + ")";
      *chosen = c.algo;
      return true;
    }
  }
  // Fallback: every algorithm the heuristics did not rank, in enum order.
  for (int a = 0; a < Pass::count; ++a) {
    if (tried[a]) continue;
    const Algo algo = static_cast<Algo>(a);
    std::string note;
    bool ok = false;
    if (require_deterministic && Pass::nondeterministic(algo)) note = "not deterministic";
    else if (p.bf16 && Pass::transformed(algo)) note = "FFT/Winograd on bf16";
    else ok = fits(algo, tensor_ops_allowed(p.bf16) ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH, &note);
    seen += (seen.empty() ? "" : ", ") + std::to_string(a) + " (unranked) " + note;
    if (ok) {
      *log += std::string(Pass::name) + " algo " + std::to_string(a) + " (" + std::to_string(*ws) +
              " B, unranked fallback; candidates: " + seen + ")";
      *chosen = algo;
      return true;
    }
  }
  *seen_out = seen;
  return false;
}

CudnnConvApi conv_api_from_env() {
  const char* v = std::getenv("TALLY_CUDNN_CONV_API");
  const std::string api = v != nullptr ? v : "";
  if (api == "graph") return CudnnConvApi::graph;
  if (api == "legacy") return CudnnConvApi::legacy;
  if (!api.empty() && api != "auto")
    std::fprintf(stderr, "tally: warning: TALLY_CUDNN_CONV_API=%s: expected legacy, graph or auto; using auto\n",
                 api.c_str());
  return CudnnConvApi::automatic;
}
std::atomic<CudnnConvApi> g_conv_api{conv_api_from_env()};
// Whether a shape's convolutions go through the graph API (defined with it, below).
bool use_graph_api(const Conv2dShape& s, bool bf16);

bool log_conv_from_env() {
  const char* v = std::getenv("TALLY_LOG_CONV");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}
std::atomic<bool> g_log_conv{log_conv_from_env()};

std::unique_ptr<Plan> make_plan(const Conv2dShape& s, bool bf16) {
  cudnnHandle_t h = detail::cudnn();
  auto p = std::make_unique<Plan>();
  p->bf16 = bf16;
  const cudnnDataType_t data = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  const int N = to_int(s.N, "N", s), C = to_int(s.C, "C", s), H = to_int(s.H, "H", s), W = to_int(s.W, "W", s);
  const int K = to_int(s.K, "K", s), Cg = to_int(s.C / s.groups, "C/groups", s), R = to_int(s.R, "R", s),
            S = to_int(s.S, "S", s), P = to_int(s.P(), "P", s), Q = to_int(s.Q(), "Q", s);
  to_int(s.N * s.C * s.H * s.W, "input elements", s);  // cuDNN's legacy API indexes with int
  to_int(s.N * s.K * s.P() * s.Q(), "output elements", s);
  // The legacy API sees channels-last activations only when called with them directly (core/ routes
  // them to the graph API): NHWC tensor descriptors, the weights as stored.
  const cudnnTensorFormat_t layout = s.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  TALLY_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, layout, data, N, C, H, W));
  TALLY_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, layout, data, N, K, P, Q));
  TALLY_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, data, CUDNN_TENSOR_NCHW, K, Cg, R, S));
  set_conv_desc(p->fwd_conv, s, bf16);
  set_conv_desc(p->bwd_data_conv, s, bf16);
  set_conv_desc(p->bwd_filter_conv, s, bf16);
  std::string log = std::string(bf16 ? "bf16 " : "") + "conv2d " + shape_text(s) + ", workspace limit " +
                    std::to_string(s.workspace_limit) +
                    (bf16 ? " B, bf16 products summed in float32" : allow_tf32() ? " B, TF32" : " B, no TF32") +
                    (deterministic() ? ", deterministic" : "") + ":\n  ";
  p->fwd_algo = choose<FwdPass>(h, *p, p->fwd_conv, s, &p->fwd_ws, &log, &p->nondeterministic);
  log += "\n  ";
  p->bwd_data_algo = choose<BwdDataPass>(h, *p, p->bwd_data_conv, s, &p->bwd_data_ws, &log, &p->nondeterministic);
  log += "\n  ";
  p->bwd_filter_algo =
      choose<BwdFilterPass>(h, *p, p->bwd_filter_conv, s, &p->bwd_filter_ws, &log, &p->nondeterministic);
  p->description = log;
  if (g_log_conv) std::fprintf(stderr, "%s\n", log.c_str());
  return p;
}

// The cached plan of a shape and data type (built on first use; plans live as long as the process).
const Plan& plan_for(const Conv2dShape& s, bool bf16) {
  static std::mutex mu;
  static auto* cache = new std::map<PlanKey, std::unique_ptr<Plan>>;  // never destroyed, as the handles
  const PlanKey key = key_of(s, bf16);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it == cache->end()) it = cache->emplace(key, make_plan(s, bf16)).first;
  return *it->second;
}

// The plan of a shape that is about to be sized or run through the legacy API: its warning, if it
// has one, printed once.
const Plan& legacy_plan(const Conv2dShape& s, bool bf16) {
  const Plan& p = plan_for(s, bf16);
  if (!p.nondeterministic.empty())
    std::call_once(p.warned, [&] { std::fputs(p.nondeterministic.c_str(), stderr); });
  return p;
}

// ---- the graph (backend) API ---------------------------------------------------------------------
// The same three passes through cudnn_graph.h (no frontend library): per pass and beta one
// operation graph holding one convolution node; its engine configurations come from heuristics
// mode A and then the fallback mode (host-side, the same list every time for a shape, device and
// cuDNN), and the first that
//   * has an engine whose index and numerical notes can be read (none is trusted unseen),
//   * is deterministic (no CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) when deterministic() is on,
//   * for float32 data, uses no tensor cores (TENSOR_CORE, DOWN_CONVERT_INPUTS: TF32) unless
//     allow_tf32() is on; never converts its inputs to a narrower type (DOWN_CONVERT_INPUTS, as
//     recent PyTorch: the type may be fp16, whose range ends at 65504); never sums in a narrower
//     type than float32 (REDUCED_PRECISION_REDUCTION); for bf16, no FFT or Winograd (as the legacy
//     path),
//   * finalizes into an execution plan whose workspace is at most the shape's workspace_limit
// is the pass's plan, cached for the process (a dry run chooses and sizes as the real step does).
// If no deterministic one fits, the first other one that does is taken with a warning (as the
// legacy path does). alpha = 1; beta is the op's own attribute, so a pass has a plan per beta
// (0: write, 1: accumulate), and its workspace is the larger of the two. bf16 as the legacy path:
// the bf16 weight copy (or weight gradient) at the start of the workspace.
// Selected with set_cudnn_conv_api(CudnnConvApi::graph) or TALLY_CUDNN_CONV_API=graph, and by
// default for bf16 (cuda_kernels.h: CudnnConvApi).

// One backend descriptor, owned.
class BackendDescriptor {
 public:
  explicit BackendDescriptor(cudnnBackendDescriptorType_t type) {
    TALLY_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_));
  }
  ~BackendDescriptor() {
    if (d_) (void)cudnnBackendDestroyDescriptor(d_);
  }
  BackendDescriptor(const BackendDescriptor&) = delete;
  BackendDescriptor& operator=(const BackendDescriptor&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }
  cudnnBackendDescriptor_t* address() { return &d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};
using Backend = std::unique_ptr<BackendDescriptor>;

Backend backend(cudnnBackendDescriptorType_t type) { return std::make_unique<BackendDescriptor>(type); }

void set_attr(const Backend& d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::int64_t n,
              const void* values) {
  TALLY_CUDNN_CHECK(cudnnBackendSetAttribute(d->get(), name, type, n, values));
}
void set_desc(const Backend& d, cudnnBackendAttributeName_t name, const Backend& value) {
  cudnnBackendDescriptor_t v = value->get();
  set_attr(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v);
}

// Unique ids of the operands in a variant pack.
constexpr std::int64_t kUidX = 'x', kUidW = 'w', kUidY = 'y';

// Dimensions (a, b, c, d) = (N, C, H, W) or (K, C, R, S), stored in that order, or with
// `channels_last` as (N, H, W, C): the strides say which (cuDNN's NHWC engines read the latter).
Backend tensor_desc(std::int64_t uid, cudnnDataType_t type, std::int64_t a, std::int64_t b, std::int64_t c,
                    std::int64_t d, bool channels_last = false) {
  auto t = backend(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const std::int64_t dims[4] = {a, b, c, d}, alignment = 16;
  const std::int64_t rows[4] = {b * c * d, c * d, d, 1}, nhwc[4] = {b * c * d, 1, d * b, b};
  const std::int64_t* strides = channels_last ? nhwc : rows;
  set_attr(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
  set_attr(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
  set_attr(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides);
  set_attr(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  set_attr(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  TALLY_CUDNN_CHECK(cudnnBackendFinalize(t->get()));
  return t;
}

Backend conv_desc(const Conv2dShape& s) {
  auto c = backend(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const std::int64_t dims = 2, pad[2] = {s.pad_h, s.pad_w}, stride[2] = {s.stride_h, s.stride_w},
                     dilation[2] = {s.dil_h, s.dil_w};
  // Symmetric padding, as PyTorch's cuDNN graph path sets it: cuDNN rounds the output size down
  // as PyTorch does. (A post-padding that made the sizes agree exactly went negative where the
  // last rows are not reached — a 1x1 stride-2 convolution of an even input — and cuDNN refused
  // the descriptor with CUDNN_STATUS_BAD_PARAM: every downsampling shortcut, on an H100.)
  const std::int64_t post[2] = {s.pad_h, s.pad_w};
  set_attr(c, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
  set_attr(c, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  set_attr(c, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims);
  set_attr(c, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  set_attr(c, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, post);
  set_attr(c, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride);
  set_attr(c, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dilation);
  TALLY_CUDNN_CHECK(cudnnBackendFinalize(c->get()));
  return c;
}

// One pass's chosen execution plan, with everything it was built from kept alive.
struct GraphPlan {
  std::vector<Backend> parts;  // tensors, convolution, operation, graph, heuristics, configurations
  Backend plan;
  std::size_t workspace = 0;
  std::int64_t engine = -1;  // cuDNN's global engine index
  std::int64_t rank = -1;    // its configuration's place in the heuristics' list
  bool tuned = false;        // taken from the tuning table
  std::string description;
};

// The engine of a configuration: its global index and numerical notes.
struct EngineInfo {
  std::int64_t index = -1;
  bool nondeterministic = false, tensor_core = false, transformed = false;  // transformed: FFT or Winograd
  bool down_convert = false;  // DOWN_CONVERT_INPUTS: inputs converted to a narrower type (possibly fp16's range)
  bool reduced_precision = false;  // REDUCED_PRECISION_REDUCTION: sums in a type narrower than the compute type
  bool known = false;  // its index and notes were read: an engine whose notes cannot be read breaks no rule unseen
};
EngineInfo engine_info(const Backend& config) {
  EngineInfo info;
  auto engine = backend(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  std::int64_t n = 0;
  if (cudnnBackendGetAttribute(config->get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                               engine->address()) != CUDNN_STATUS_SUCCESS)
    return info;
  if (cudnnBackendGetAttribute(engine->get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &info.index) !=
      CUDNN_STATUS_SUCCESS)
    return info;
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  std::int64_t count = 0;
  if (cudnnBackendGetAttribute(engine->get(), CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes) != CUDNN_STATUS_SUCCESS)
    return info;
  info.known = true;
  for (std::int64_t i = 0; i < count; ++i) {
    info.nondeterministic |= notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    info.tensor_core |= notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE || notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS;
    info.down_convert |= notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS;
    info.reduced_precision |= notes[i] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION;
    info.transformed |= notes[i] == CUDNN_NUMERICAL_NOTE_FFT || notes[i] == CUDNN_NUMERICAL_NOTE_WINOGRAD ||
                        notes[i] == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4 ||
                        notes[i] == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6 ||
                        notes[i] == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13;
  }
  return info;
}

const char* pass_name(ConvPass pass) {
  return pass == ConvPass::forward ? "forward" : pass == ConvPass::backward_data ? "backward data" : "backward filter";
}

// Where a graph plan is made for: the current device (its cuDNN handle), or a device described by
// its saved properties (cuDNN's device-properties descriptor, CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR),
// with no GPU touched — the heuristics and the plans' finalization read the description instead.
struct PlanTarget {
  cudnnHandle_t handle = nullptr;
  cudnnBackendDescriptor_t device_properties = nullptr;
};

// The operation graph of one pass and the engine configurations the heuristics list for it: mode
// A's, then the fallback mode's (cuDNN's own advice when A offers nothing usable: for float32
// without TF32 A can list tensor-core engines alone, as for the weight gradient of ResNet-50's 1x1
// stride-2 projections at batch 64 on an H100). A configuration's rank is its place in that list.
struct PassGraph {
  std::vector<Backend> parts;  // tensors, convolution, operation, graph, heuristics
  std::vector<Backend> configs;
  std::vector<const char*> mode;  // the heuristics mode that listed each configuration
};

PassGraph pass_graph(const Conv2dShape& s, bool bf16, ConvPass pass, float beta, const PlanTarget& target) {
  cudnnHandle_t h = target.handle;
  cudnnBackendDescriptor_t props = target.device_properties;
  PassGraph pg;
  const cudnnDataType_t data = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  // The weight gradient of a float32 pass is float32; of a bf16 pass, bf16 (added into float32 after).
  // Channels-last activations take the weights as they are stored, (K, C/g, R, S): cuDNN reorders
  // them inside its workspace, which the plan's workspace size includes.
  auto x = tensor_desc(kUidX, data, s.N, s.C, s.H, s.W, s.channels_last);
  auto w = tensor_desc(kUidW, data, s.K, s.C / s.groups, s.R, s.S);
  auto y = tensor_desc(kUidY, data, s.N, s.K, s.P(), s.Q(), s.channels_last);
  auto conv = conv_desc(s);
  // The pass's operation and the names of its attributes: x (or dx), w (or dw), y (or dy), the
  // convolution, alpha and beta.
  struct OpNames {
    cudnnBackendDescriptorType_t type;
    cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
  };
  static constexpr OpNames kNames[3] = {
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA},
  };
  static_assert(static_cast<int>(ConvPass::forward) == 0 && static_cast<int>(ConvPass::backward_data) == 1 &&
                static_cast<int>(ConvPass::backward_filter) == 2);
  const OpNames& names = kNames[static_cast<int>(pass)];
  const float alpha = 1.f;
  Backend op = backend(names.type);
  set_desc(op, names.x, x);
  set_desc(op, names.w, w);
  set_desc(op, names.y, y);
  set_desc(op, names.conv, conv);
  set_attr(op, names.alpha, CUDNN_TYPE_FLOAT, 1, &alpha);
  set_attr(op, names.beta, CUDNN_TYPE_FLOAT, 1, &beta);
  TALLY_CUDNN_CHECK(cudnnBackendFinalize(op->get()));
  auto graph = backend(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  set_desc(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, op);
  if (h) set_attr(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
  TALLY_CUDNN_CHECK(cudnnBackendFinalize(graph->get()));
  for (const auto& [mode, label] : {std::pair{CUDNN_HEUR_MODE_A, "mode A"}, std::pair{CUDNN_HEUR_MODE_FALLBACK, "fallback mode"}}) {
    auto heur = backend(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    set_desc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    set_attr(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (props) set_attr(heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &props);
    TALLY_CUDNN_CHECK(cudnnBackendFinalize(heur->get()));
    std::int64_t count = 0;
    TALLY_CUDNN_CHECK(cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                              0, &count, nullptr));
    std::vector<Backend> mine;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (std::int64_t i = 0; i < count; ++i) {
      mine.push_back(backend(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(mine.back()->get());
    }
    std::int64_t got = 0;
    if (count > 0)
      TALLY_CUDNN_CHECK(cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()));
    for (std::int64_t i = 0; i < got; ++i) {
      pg.configs.push_back(std::move(mine[static_cast<std::size_t>(i)]));
      pg.mode.push_back(label);
    }
    pg.parts.push_back(std::move(heur));
  }
  for (Backend* part : {&x, &w, &y, &conv, &op, &graph}) pg.parts.push_back(std::move(*part));
  return pg;
}

// One configuration of the list under the rules (file top): its finalized plan and workspace when
// usable (ok), else why not (note).
struct Tried {
  Backend plan;
  std::size_t workspace = 0;
  EngineInfo info;
  std::string note;
  bool ok = false;
};
Tried try_config(const PassGraph& pg, std::size_t i, bool bf16, bool require_deterministic, std::size_t limit,
                 const PlanTarget& target) {
  Tried t;
  t.info = engine_info(pg.configs[i]);
  if (!t.info.known) {
    t.note = "its engine or numerical notes unreadable";
  } else if (require_deterministic && t.info.nondeterministic) {
    t.note = "not deterministic";
  } else if (!tensor_ops_allowed(bf16) && t.info.tensor_core) {
    t.note = "tensor cores (TF32)";
  } else if (t.info.down_convert) {  // with TF32 or bf16 too (as recent PyTorch): the narrower type may be fp16
    t.note = "inputs down-converted";
  } else if (t.info.reduced_precision) {  // sums in float32, in every precision (docs/precision.md)
    t.note = "reduced-precision sums";
  } else if (bf16 && t.info.transformed) {
    t.note = "FFT/Winograd on bf16";
  } else {
    auto plan = backend(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    if (target.handle) set_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &target.handle);
    if (target.device_properties)
      set_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &target.device_properties);
    set_desc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, pg.configs[i]);
    const cudnnStatus_t st = cudnnBackendFinalize(plan->get());
    std::int64_t ws = 0, n = 0;
    if (st != CUDNN_STATUS_SUCCESS) {
      t.note = std::string("plan: ") + cudnnGetErrorString(st);
    } else if (cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                        &ws) != CUDNN_STATUS_SUCCESS || ws < 0) {
      t.note = "no workspace size";
    } else if (static_cast<std::size_t>(ws) > limit) {
      t.note = std::to_string(ws) + " B > limit";
    } else {
      t.note = std::to_string(ws) + " B";
      t.plan = std::move(plan);
      t.workspace = static_cast<std::size_t>(ws);
      t.ok = true;
    }
  }
  return t;
}

// ---- tuning: the table plans replay, and the record of the passes a dry run plans --------------

struct Tuning {
  std::mutex mu;
  std::map<std::string, TunedConvPass> table;
  std::atomic<std::uint64_t> generation{0};  // the table's version: graph plans are cached under it
  std::atomic<bool> recording{false};
  std::map<std::string, ConvPassKey> recorded;
};
Tuning& tuning() {
  static auto* t = new Tuning;  // never destroyed, as the plans
  return *t;
}

// The tuned choice of a pass — its rank and engine, and whether it is the within-workspace one —
// if the table has one.
struct TunedChoice {
  std::int64_t rank, engine;
  bool within;
};
std::optional<TunedChoice> tuned_choice(const std::string& key) {
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mu);
  const auto it = t.table.find(key);
  if (it == t.table.end()) return std::nullopt;
  const TunedConvPass& e = it->second;
  const bool within = e.use_within;
  const std::int64_t rank = within ? e.within_rank : e.rank, engine = within ? e.within_engine : e.engine;
  if (rank < 0) return std::nullopt;
  return TunedChoice{rank, engine, within};
}

// The pass's plan: the tuned configuration when the table has one that is usable here, else the
// first configuration of the list the rules allow within the limit. If no deterministic one fits,
// the first other one that does is taken with a warning (as the legacy path does).
std::unique_ptr<GraphPlan> make_graph_plan(const Conv2dShape& s, bool bf16, ConvPass pass, float beta,
                                           const PlanTarget& target, bool use_tuning = true) {
  PassGraph pg = pass_graph(s, bf16, pass, beta, target);
  auto g = std::make_unique<GraphPlan>();
  const auto got = pg.configs.size();
  std::string seen, tuned_note;
  auto take = [&](Tried& t, std::size_t i, const std::string& how) {
    g->plan = std::move(t.plan);
    g->workspace = t.workspace;
    g->engine = t.info.index;
    g->rank = static_cast<std::int64_t>(i);
    g->description = std::string(pass_name(pass)) + " (graph API, beta " + std::to_string(static_cast<int>(beta)) +
                     ") engine " + std::to_string(t.info.index) + " (" + std::to_string(g->workspace) + " B, rank " +
                     std::to_string(i) + " of heuristics " + pg.mode[i] + how + ")";
  };
  if (const auto tuned = use_tuning ? tuned_choice(conv2d_tuning_key(s, bf16, pass, beta)) : std::nullopt) {
    const auto [rank, engine, within] = *tuned;
    if (rank < static_cast<std::int64_t>(got)) {
      Tried t = try_config(pg, static_cast<std::size_t>(rank), bf16, deterministic(), s.workspace_limit, target);
      if (t.ok && t.info.index == engine) {
        take(t, static_cast<std::size_t>(rank),
             within ? "; tuned: the fastest measured within the heuristics' workspace" : "; tuned: the fastest measured");
        g->tuned = true;
      } else {
        tuned_note = "; tuned engine " + std::to_string(engine) + " at rank " + std::to_string(rank) + " not usable (" +
                     (t.info.index != engine ? "the heuristics list engine " + std::to_string(t.info.index) + " there"
                                             : t.note) + "): the heuristics' choice";
      }
    } else {
      tuned_note = "; tuned rank " + std::to_string(rank) + " beyond the heuristics' " + std::to_string(got) +
                   " configurations: the heuristics' choice";
    }
  }
  auto try_configs = [&](bool require_deterministic) -> bool {
    for (std::size_t i = 0; i < got; ++i) {
      Tried t = try_config(pg, i, bf16, require_deterministic, s.workspace_limit, target);
      seen += (seen.empty() ? "" : ", ") + std::string("engine ") + std::to_string(t.info.index) + " " + t.note;
      if (t.ok) {
        take(t, i, tuned_note + "; candidates: " + seen);
        return true;
      }
    }
    return false;
  };
  if (!g->plan && !try_configs(deterministic())) {
    if (!deterministic() || !try_configs(false)) no_algorithm(pass_name(pass), s, bf16, seen);
    g->description += " -- NOT deterministic: no deterministic engine fits";
    // Once a process: the pass is planned again for each tuning trial, probe and untuned timing.
    static std::mutex warned_mu;
    static auto* warned = new std::set<std::string>;  // never destroyed, as the plans
    const std::string warning = std::string("tally: warning: conv2d ") + pass_name(pass) + " of " + shape_text(s) +
                                " (graph API): no deterministic cuDNN engine fits the workspace limit of " +
                                std::to_string(s.workspace_limit) + " bytes; using one that is not deterministic\n";
    std::lock_guard<std::mutex> lock(warned_mu);
    if (warned->insert(warning).second) std::fputs(warning.c_str(), stderr);
  }
  g->parts = std::move(pg.parts);
  for (Backend& c : pg.configs) g->parts.push_back(std::move(c));
  if (g_log_conv) std::fprintf(stderr, "%s conv2d %s: %s\n", bf16 ? "bf16" : "float32", shape_text(s).c_str(),
                               g->description.c_str());
  return g;
}

// cuDNN's device-properties descriptor read from its saved description (a description cuDNN
// refuses: an Error naming cuDNN's reason).
Backend properties_descriptor(const std::string& device_properties) {
  auto props = backend(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR);
  const cudnnStatus_t set = cudnnBackendSetAttribute(props->get(), CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION,
                                                     CUDNN_TYPE_CHAR, static_cast<std::int64_t>(device_properties.size()),
                                                     device_properties.data());
  const cudnnStatus_t done = set == CUDNN_STATUS_SUCCESS ? cudnnBackendFinalize(props->get()) : set;
  if (done != CUDNN_STATUS_SUCCESS) {
    char why[1024] = "";
    cudnnGetLastErrorString(why, sizeof why);
    detail::fail(std::string("cuDNN ") + std::to_string(cudnnGetVersion()) + " refused the saved device properties: " +
                 cudnnGetErrorString(done) + (why[0] ? std::string(" (") + why + ")" : std::string()));
  }
  return props;
}

// Whom the graph plans of this moment are made for: the current device, or the described one
// (context.h: set_described_device), whose properties descriptor is made once per description.
PlanTarget current_target() {
  const DescribedDevice* d = described_device();
  if (!d) return {detail::cudnn(), nullptr};
  static std::mutex mu;
  static auto* made = new std::map<std::string, Backend>;  // never destroyed, as the plans made from them
  std::lock_guard<std::mutex> lock(mu);
  auto it = made->find(d->cudnn_properties);
  if (it == made->end()) it = made->emplace(d->cudnn_properties, properties_descriptor(d->cudnn_properties)).first;
  return {nullptr, it->second->get()};
}

// The cached graph plan of a shape, dtype, pass and beta (0 or 1): for a described device, one that
// sizes its workspace and cannot run.
const GraphPlan& graph_plan(const Conv2dShape& s, bool bf16, ConvPass pass, float beta) {
  if (beta != 0.f && beta != 1.f)
    detail::fail("conv2d " + std::string(pass_name(pass)) + " (graph API): beta must be 0 or 1, found " +
                 std::to_string(beta));
  Tuning& t = tuning();
  using Key = std::tuple<PlanKey, int, bool, std::uint64_t>;
  static std::mutex mu;
  static auto* cache = new std::map<Key, std::unique_ptr<GraphPlan>>;  // never destroyed, as the handles
  const Key key{key_of(s, bf16), static_cast<int>(pass), beta == 1.f, t.generation.load()};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it == cache->end()) it = cache->emplace(key, make_graph_plan(s, bf16, pass, beta, current_target())).first;
  // Recorded for tuning once planned: a pass the graph API cannot plan (use_graph_api's probe of a
  // shape that then goes to the legacy API) is none of the step's.
  if (t.recording.load()) {  // set between steps only, as the table
    std::lock_guard<std::mutex> record(t.mu);
    t.recorded.emplace(conv2d_tuning_key(s, bf16, pass, beta), ConvPassKey{s, bf16, pass, beta});
  }
  return *it->second;
}

// cuDNN's workspace of a pass through the graph API: the larger of its two plans' (beta 0 and 1;
// the forward and a bf16 weight gradient always write).
std::size_t graph_workspace(const Conv2dShape& s, bool bf16, ConvPass pass) {
  const std::size_t write = graph_plan(s, bf16, pass, 0.f).workspace;
  if (pass == ConvPass::forward || (bf16 && pass == ConvPass::backward_filter)) return write;
  return std::max(write, graph_plan(s, bf16, pass, 1.f).workspace);
}

// Automatic: the graph API for bf16 and for channels-last activations, the legacy API for row-major
// float32 (cuda_kernels.h says why) — unless deterministic() is on and the legacy API has no
// deterministic algorithm within the limit for one of the shape's passes (on an H200, 2026-11-28:
// the 1x1 stride-2 projections' backward passes at ResNet-50 batch 256 with TF32, and 1x1
// convolutions of 256x256 images in a 62.5 MiB limit, where the graph API's runs had none
// missing): then the graph API for that shape, if it plans all three passes within the limit
// (its own fallback, with its own warning, where it too has none). A function of the shape and
// the switches, cached (with the plans it reads), so a dry run and the real step choose alike.
bool use_graph_api(const Conv2dShape& s, bool bf16) {
  const CudnnConvApi api = g_conv_api.load();
  if (described_device()) {  // the legacy API's queries need the GPU: a plan without it has the graph API's
    if (api == CudnnConvApi::legacy)
      detail::fail("conv2d: expected the graph API (or automatic) in a plan without the GPU, found the legacy API "
                   "forced (TALLY_CUDNN_CONV_API=legacy), whose algorithm queries need the GPU");
    return true;
  }
  if (api != CudnnConvApi::automatic) return api == CudnnConvApi::graph;
  if (bf16 || s.channels_last) return true;
  if (!deterministic() || plan_for(s, false).nondeterministic.empty()) return false;
  static std::mutex mu;
  static auto* decided = new std::map<PlanKey, bool>;  // never destroyed, as the plans
  const PlanKey key = key_of(s, false);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (const auto it = decided->find(key); it != decided->end()) return it->second;
  }
  bool graph = true;
  try {
    for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter})
      (void)graph_workspace(s, false, pass);
  } catch (const std::exception&) {  // no graph engine at all within the limit: the legacy plan, warned
    graph = false;
  }
  std::lock_guard<std::mutex> lock(mu);
  return decided->emplace(key, graph).first->second;
}

// The buffers of a run of a pass's plan: x, w, y — for the backward passes dx, dw, dy in the same
// slots.
Backend variant_pack(const void* x, const void* w, const void* y, void* workspace) {
  auto pack = backend(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  const std::int64_t uids[3] = {kUidX, kUidW, kUidY};
  void* ptrs[3] = {const_cast<void*>(x), const_cast<void*>(w), const_cast<void*>(y)};
  set_attr(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
  set_attr(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, ptrs);
  set_attr(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  TALLY_CUDNN_CHECK(cudnnBackendFinalize(pack->get()));
  return pack;
}
// Runs an execution plan on them.
void plan_execute(cudnnBackendDescriptor_t plan, const void* x, const void* w, const void* y, void* workspace) {
  auto pack = variant_pack(x, w, y, workspace);
  TALLY_CUDNN_CHECK(cudnnBackendExecute(detail::cudnn(), plan, pack->get()));
}
void graph_execute(const GraphPlan& g, const void* x, const void* w, const void* y, void* workspace) {
  plan_execute(g.plan->get(), x, w, y, workspace);
}

// A bf16 pass's workspace: the bf16 weight (or weight-gradient) buffer, then cuDNN's part.
struct Bf16Workspace {
  bf16* weight;  // (K, C/g, R, S)
  void* cudnn;   // the plan's workspace of the pass, or null when it is 0 bytes
};
Bf16Workspace split_workspace(const Conv2dShape& s, void* workspace, std::size_t cudnn_bytes, const char* pass) {
  if (workspace == nullptr)
    detail::fail(std::string("conv2d ") + pass + " in bf16: expected a workspace of conv2d_workspace_bytes<bf16> (" +
                 std::to_string(bf16_weight_bytes(s) + cudnn_bytes) + " bytes), found none");
  auto* base = static_cast<unsigned char*>(workspace);
  return {reinterpret_cast<bf16*>(base), cudnn_bytes > 0 ? base + bf16_weight_bytes(s) : nullptr};
}

// The float32 weights rounded into the bf16 buffer of the workspace, for cuDNN.
const bf16* bf16_weights(const Conv2dShape& s, const float* w, const Bf16Workspace& ws) {
  convert<float, bf16>(weight_count(s), w, ws.weight);
  return ws.weight;
}

#else  // no cuDNN in this build

[[noreturn]] void no_cudnn() {
  detail::fail("conv2d on a GPU: this build of tally has no cuDNN (configure with CUDNN_ROOT pointing at it)");
}

#endif

bool empty_output(const Conv2dShape& s) { return s.N <= 0 || s.K <= 0 || s.P() <= 0 || s.Q() <= 0; }

}  // namespace

// ---- kernel launchers ----------------------------------------------------------------------------

template <class T>
std::size_t conv2d_workspace_bytes(const Conv2dShape& s, ConvPass pass) {
  if (empty_output(s) || s.C <= 0) return 0;
#if TALLY_HAVE_CUDNN
  std::size_t cudnn_bytes = 0;
  if (use_graph_api(s, is_bf16<T>)) {
    cudnn_bytes = graph_workspace(s, is_bf16<T>, pass);
  } else {
    const Plan& p = legacy_plan(s, is_bf16<T>);
    switch (pass) {
      case ConvPass::forward: cudnn_bytes = p.fwd_ws; break;
      case ConvPass::backward_data: cudnn_bytes = p.bwd_data_ws; break;
      case ConvPass::backward_filter: cudnn_bytes = p.bwd_filter_ws; break;
    }
  }
  return is_bf16<T> ? bf16_weight_bytes(s) + cudnn_bytes : cudnn_bytes;
#else
  (void)pass;
  no_cudnn();
#endif
}

template <class T>
std::string conv2d_plan_description(const Conv2dShape& s) {
  if (empty_output(s) || s.C <= 0) return "conv2d: empty, no cuDNN call";
#if TALLY_HAVE_CUDNN
  if (use_graph_api(s, is_bf16<T>)) {
    std::string d = std::string(is_bf16<T> ? "bf16 " : "") + "conv2d " + shape_text(s) + " through the graph API:";
    for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter})
      d += "\n  " + graph_plan(s, is_bf16<T>, pass, 0.f).description;
    return d;
  }
  return plan_for(s, is_bf16<T>).description;
#else
  no_cudnn();
#endif
}

void set_cudnn_conv_api(CudnnConvApi api) {
#if TALLY_HAVE_CUDNN
  g_conv_api = api;
#else
  (void)api;
#endif
}
CudnnConvApi cudnn_conv_api() {
#if TALLY_HAVE_CUDNN
  return g_conv_api.load();
#else
  return CudnnConvApi::automatic;
#endif
}

// ---- plans without the device ----------------------------------------------------------------

std::string cudnn_device_properties(int device) {
#if TALLY_HAVE_CUDNN
  use_device(device);
  auto d = backend(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR);
  const std::int32_t id = device;
  set_attr(d, CUDNN_ATTR_DEVICEPROP_DEVICE_ID, CUDNN_TYPE_INT32, 1, &id);
  TALLY_CUDNN_CHECK(cudnnBackendFinalize(d->get()));
  std::int64_t n = 0;
  TALLY_CUDNN_CHECK(cudnnBackendGetAttribute(d->get(), CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, 0, &n,
                                            nullptr));
  std::string json(static_cast<std::size_t>(n > 0 ? n : 1 << 20), '\0');
  TALLY_CUDNN_CHECK(cudnnBackendGetAttribute(d->get(), CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                            static_cast<std::int64_t>(json.size()), &n, json.data()));
  json.resize(std::min(json.size(), static_cast<std::size_t>(n)));
  while (!json.empty() && json.back() == '\0') json.pop_back();
  return json;
#else
  (void)device;
  no_cudnn();
#endif
}

OfflineConvPlan conv2d_plan_offline(const Conv2dShape& s, bool bf16, ConvPass pass, float beta,
                                    const std::string& device_properties) {
#if TALLY_HAVE_CUDNN
  const Backend props = properties_descriptor(device_properties);
  const std::unique_ptr<GraphPlan> g = make_graph_plan(s, bf16, pass, beta, {nullptr, props->get()});
  return {g->engine, g->workspace, g->description};
#else
  (void)s, (void)bf16, (void)pass, (void)beta, (void)device_properties;
  no_cudnn();
#endif
}

// ---- tuning ------------------------------------------------------------------------------------

std::string conv2d_tuning_key(const Conv2dShape& s, bool bf16, ConvPass pass, float beta) {
  static constexpr const char* kPass[3] = {"forward", "backward-data", "backward-filter"};
  char text[256];
  std::snprintf(text, sizeof text,
                "%s %s %s beta %d: n %lld c %lld %lldx%lld, k %lld %lldx%lld, stride %lldx%lld, pad %lldx%lld, "
                "dilation %lldx%lld, groups %lld%s%s",
                bf16 ? "bf16" : "float32", s.channels_last ? "nhwc" : "nchw", kPass[static_cast<int>(pass)],
                beta == 0.f ? 0 : 1, static_cast<long long>(s.N), static_cast<long long>(s.C),
                static_cast<long long>(s.H), static_cast<long long>(s.W), static_cast<long long>(s.K),
                static_cast<long long>(s.R), static_cast<long long>(s.S), static_cast<long long>(s.stride_h),
                static_cast<long long>(s.stride_w), static_cast<long long>(s.pad_h), static_cast<long long>(s.pad_w),
                static_cast<long long>(s.dil_h), static_cast<long long>(s.dil_w), static_cast<long long>(s.groups),
                deterministic() ? ", deterministic" : "", !bf16 && allow_tf32() ? ", tf32" : "");
  return text;
}

bool set_conv_tuning(const std::map<std::string, TunedConvPass>& table) {
#if TALLY_HAVE_CUDNN
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.table == table) return false;
  t.table = table;
  ++t.generation;
  return true;
#else
  (void)table;
  return false;
#endif
}

void conv2d_record_passes(bool on) {
#if TALLY_HAVE_CUDNN
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mu);
  if (on) t.recorded.clear();
  t.recording = on;
#else
  (void)on;
#endif
}

std::vector<ConvPassKey> conv2d_recorded_passes() {
  std::vector<ConvPassKey> passes;
#if TALLY_HAVE_CUDNN
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mu);
  for (const auto& [key, pass] : t.recorded) passes.push_back(pass);
#endif
  return passes;
}

std::vector<std::int64_t> conv2d_graph_engines(const Conv2dShape& s, bool bf16, ConvPass pass, float beta) {
  std::vector<std::int64_t> engines;
#if TALLY_HAVE_CUDNN
  const PassGraph pg = pass_graph(s, bf16, pass, beta, current_target());
  for (const Backend& c : pg.configs) engines.push_back(engine_info(c).index);
#else
  (void)s, (void)bf16, (void)pass, (void)beta;
  no_cudnn();
#endif
  return engines;
}

#if TALLY_HAVE_CUDNN
namespace {

// CUDA events for timing, destroyed however the timing ends.
struct TimingEvents {
  cudaEvent_t start = nullptr, stop = nullptr;
  TimingEvents() {
    TALLY_CUDA_CHECK(cudaEventCreate(&start));
    if (const cudaError_t e = cudaEventCreate(&stop); e != cudaSuccess) {
      (void)cudaEventDestroy(start);
      detail::throw_cuda(e, "cudaEventCreate(&stop)", __FILE__, __LINE__);
    }
  }
  ~TimingEvents() {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
};

// The milliseconds a run of `plan` takes: one run first (the engine's own set-up), then the faster
// of two rounds of kTuneRepeats runs (a clock still rising from idle, a cache still cold, would
// otherwise count against the first candidates). One variant pack for all the runs: the host's
// work per run stays out of the device's time.
double time_plan(cudnnBackendDescriptor_t plan, void* x, void* w, void* y, void* workspace, const TimingEvents& ev) {
  auto pack = variant_pack(x, w, y, workspace);
  TALLY_CUDNN_CHECK(cudnnBackendExecute(detail::cudnn(), plan, pack->get()));
  double best = 0;
  for (int round = 0; round < 2; ++round) {
    TALLY_CUDA_CHECK(cudaEventRecord(ev.start, detail::stream()));
    for (int k = 0; k < kTuneRepeats; ++k) TALLY_CUDNN_CHECK(cudnnBackendExecute(detail::cudnn(), plan, pack->get()));
    TALLY_CUDA_CHECK(cudaEventRecord(ev.stop, detail::stream()));
    detail::host_wait(detail::stream());
    float ms = 0;
    TALLY_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.start, ev.stop));
    best = round == 0 ? ms : std::min<double>(best, ms);
  }
  return best / kTuneRepeats;
}

}  // namespace
#endif

TunedConvPass conv2d_tune_pass(const ConvPassKey& p, void* x, void* w, void* y, void* workspace,
                               std::size_t workspace_bytes, double seconds) {
  TunedConvPass r;
#if TALLY_HAVE_CUDNN
  const Conv2dShape& s = p.shape;
  const PlanTarget target{detail::cudnn(), nullptr};
  // The heuristics' choice, as a plan without tuning takes it: its rank, engine and workspace.
  const std::unique_ptr<GraphPlan> untuned = make_graph_plan(s, p.bf16, p.pass, p.beta, target, false);
  r.heuristic_rank = untuned->rank;
  r.heuristic_engine = untuned->engine;
  r.heuristic_workspace = untuned->workspace;
  const std::size_t limit = std::min(s.workspace_limit, workspace_bytes);
  // Without room for the heuristics' own choice, the comparison would be with nothing: not tuned.
  if (untuned->workspace > limit) {
    r.cut = true;
    return r;
  }
  const PassGraph pg = pass_graph(s, p.bf16, p.pass, p.beta, target);
  // The candidates follow the rules a replay checks (make_graph_plan): deterministic engines only
  // while deterministic() is on, whatever the heuristics' choice is.
  const TimingEvents ev;
  const auto began = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < pg.configs.size() && r.candidates < kTuneCandidates; ++i) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() > seconds) {
      r.cut = true;  // the list not measured to its end: kept by no file
      break;
    }
    Tried t = try_config(pg, i, p.bf16, deterministic(), limit, target);
    if (!t.ok) continue;
    double each = 0;
    try {
      each = time_plan(t.plan->get(), x, w, y, workspace, ev);
    } catch (const std::exception& e) {  // an engine that will not run on these buffers: not a candidate
      (void)cudaGetLastError();
      if (cudaStreamSynchronize(detail::stream()) != cudaSuccess)  // an error that sticks: the device is lost
        detail::fail(std::string("convolution tuning: engine ") + std::to_string(t.info.index) + " of " +
                     pass_name(p.pass) + " left the GPU unusable: " + e.what());
      continue;
    }
    ++r.candidates;
    const auto rank = static_cast<std::int64_t>(i);
    if (rank == untuned->rank) r.heuristic_ms = each;
    if (r.rank < 0 || each < r.ms) r.rank = rank, r.engine = t.info.index, r.workspace = t.workspace, r.ms = each;
    if (t.workspace <= untuned->workspace && (r.within_rank < 0 || each < r.within_ms))
      r.within_rank = rank, r.within_engine = t.info.index, r.within_workspace = t.workspace, r.within_ms = each;
  }
#else
  (void)p, (void)x, (void)w, (void)y, (void)workspace, (void)workspace_bytes, (void)seconds;
  no_cudnn();
#endif
  return r;
}

void set_log_conv_algorithms(bool on) {
#if TALLY_HAVE_CUDNN
  g_log_conv = on;
#else
  (void)on;
#endif
}

template <class T>
void conv2d_forward(const Conv2dShape& s,
                    const T* x,        // (N, C, H, W)
                    const P<T>* w,     // (K, C/g, R, S)
                    const P<T>* bias,  // (K) or null
                    T* y,              // (N, K, P, Q)
                    void* workspace) {
  if (empty_output(s)) return;
#if TALLY_HAVE_CUDNN
  const bool graph = use_graph_api(s, is_bf16<T>);
  const Plan* p = graph ? nullptr : &legacy_plan(s, is_bf16<T>);
  const std::size_t cudnn_ws = graph ? graph_workspace(s, is_bf16<T>, ConvPass::forward) : p->fwd_ws;
  const float one = 1.f, zero = 0.f;
  const void* wk = w;
  void* ws = workspace;
  if constexpr (is_bf16<T>) {
    const Bf16Workspace parts = split_workspace(s, workspace, cudnn_ws, "forward");
    wk = bf16_weights(s, w, parts);
    ws = parts.cudnn;
  }
  if (graph)
    graph_execute(graph_plan(s, is_bf16<T>, ConvPass::forward, 0.f), x, wk, y, ws);
  else
    TALLY_CUDNN_CHECK(cudnnConvolutionForward(detail::cudnn(), &one, p->x, x, p->w, wk, p->fwd_conv, p->fwd_algo, ws,
                                              p->fwd_ws, &zero, p->y, y));
  if (bias != nullptr) {
    const i64 PQ = s.P() * s.Q(), total = s.N * s.K * PQ;
    add_channel_bias_kernel<<<detail::grid_for(total), detail::kThreads, 0, detail::stream()>>>(total, s.K, PQ, bias,
                                                                                                y);
    TALLY_LAUNCH_CHECK("conv2d_forward.add_channel_bias");
  }
#else
  (void)x, (void)w, (void)bias, (void)y, (void)workspace;
  no_cudnn();
#endif
}

template <class T>
void conv2d_backward_data(const Conv2dShape& s,
                          const T* dy,     // (N, K, P, Q)
                          const P<T>* w,   // (K, C/g, R, S)
                          T* dx,           // (N, C, H, W)
                          P<T> beta, void* workspace) {
  if (s.N <= 0 || s.C <= 0 || s.H * s.W <= 0) return;
  if (empty_output(s)) {  // no output position: dx = beta * dx
    const i64 n = s.N * s.C * s.H * s.W;
    if (beta != P<T>(1)) {
      scale_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(n, beta, dx);
      TALLY_LAUNCH_CHECK("conv2d_backward_data.scale");
    }
    return;
  }
#if TALLY_HAVE_CUDNN
  const bool graph = use_graph_api(s, is_bf16<T>);
  const Plan* p = graph ? nullptr : &legacy_plan(s, is_bf16<T>);
  const std::size_t cudnn_ws = graph ? graph_workspace(s, is_bf16<T>, ConvPass::backward_data) : p->bwd_data_ws;
  const float one = 1.f, b = static_cast<float>(beta);
  const void* wk = w;
  void* ws = workspace;
  if constexpr (is_bf16<T>) {
    const Bf16Workspace parts = split_workspace(s, workspace, cudnn_ws, "backward data");
    wk = bf16_weights(s, w, parts);
    ws = parts.cudnn;
  }
  if (graph)
    graph_execute(graph_plan(s, is_bf16<T>, ConvPass::backward_data, b), dx, wk, dy, ws);
  else
    TALLY_CUDNN_CHECK(cudnnConvolutionBackwardData(detail::cudnn(), &one, p->w, wk, p->y, dy, p->bwd_data_conv,
                                                   p->bwd_data_algo, ws, p->bwd_data_ws, &b, p->x, dx));
#else
  (void)dy, (void)w, (void)workspace;
  no_cudnn();
#endif
}

template <class T>
void conv2d_backward_filter(const Conv2dShape& s,
                            const T* x,    // (N, C, H, W)
                            const T* dy,   // (N, K, P, Q)
                            P<T>* dw,      // (K, C/g, R, S)
                            P<T> beta, void* workspace) {
  if (empty_output(s) || s.C <= 0) {  // empty sum: dw = beta * dw
    const i64 n = weight_count(s);
    if (n > 0 && beta != P<T>(1)) {
      scale_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(n, beta, dw);
      TALLY_LAUNCH_CHECK("conv2d_backward_filter.scale");
    }
    return;
  }
#if TALLY_HAVE_CUDNN
  const bool graph = use_graph_api(s, is_bf16<T>);
  const Plan* p = graph ? nullptr : &legacy_plan(s, is_bf16<T>);
  const float one = 1.f, b = static_cast<float>(beta);
  if constexpr (is_bf16<T>) {
    // cuDNN writes the bf16 gradient into the workspace (beta = 0); it is added into dw in float32.
    const std::size_t cudnn_ws = graph ? graph_workspace(s, true, ConvPass::backward_filter) : p->bwd_filter_ws;
    const Bf16Workspace parts = split_workspace(s, workspace, cudnn_ws, "backward filter");
    const float zero = 0.f;
    if (graph)
      graph_execute(graph_plan(s, true, ConvPass::backward_filter, 0.f), x, parts.weight, dy, parts.cudnn);
    else
      TALLY_CUDNN_CHECK(cudnnConvolutionBackwardFilter(detail::cudnn(), &one, p->x, x, p->y, dy, p->bwd_filter_conv,
                                                       p->bwd_filter_algo, parts.cudnn, p->bwd_filter_ws, &zero, p->w,
                                                       parts.weight));
    const i64 n = weight_count(s);
    add_weight_gradient_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(n, parts.weight, b, dw);
    TALLY_LAUNCH_CHECK("conv2d_backward_filter.add_weight_gradient");
  } else {
    // beta = 1 accumulates straight into the persistent gradient buffer (cuDNN's own scaling).
    if (graph)
      graph_execute(graph_plan(s, false, ConvPass::backward_filter, b), x, dw, dy, workspace);
    else
      TALLY_CUDNN_CHECK(cudnnConvolutionBackwardFilter(detail::cudnn(), &one, p->x, x, p->y, dy, p->bwd_filter_conv,
                                                       p->bwd_filter_algo, workspace, p->bwd_filter_ws, &b, p->w, dw));
  }
#else
  (void)x, (void)dy, (void)workspace;
  no_cudnn();
#endif
}

template <class T>
void conv2d_backward_bias(const Conv2dShape& s,
                          const T* dy,  // (N, K, P, Q)
                          P<T>* db,     // (K)
                          P<T> beta) {
  if (s.K <= 0) return;
  const i64 PQ = s.P() * s.Q();
  channel_sum_kernel<<<detail::blocks_for(s.K), detail::kReduceThreads, 0, detail::stream()>>>(
      s.N, s.K, PQ < 0 ? 0 : PQ, dy, db, beta);
  TALLY_LAUNCH_CHECK("conv2d_backward_bias");
}

TALLY_INSTANTIATE_CONV(float)
TALLY_INSTANTIATE_CONV(bf16)
template std::string conv2d_plan_description<float>(const Conv2dShape&);
template std::string conv2d_plan_description<bf16>(const Conv2dShape&);

}  // namespace tally::kernels::cuda
