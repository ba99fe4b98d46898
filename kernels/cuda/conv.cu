// kernels/cuda/conv.cu — 2-D convolution on cuDNN, NCHW float32: forward, backward data and
// backward filter through cuDNN's legacy convolution API; bias (forward) and backward bias
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
// no deterministic algorithm fits, the search runs again without that rule, with a warning (as
// PyTorch, whose default is not deterministic, would run); none at all: a clear error.
// Each pass has its own workspace (conv2d_workspace_bytes(s, pass)). TALLY_LOG_CONV=1 in the
// environment (or set_log_conv_algorithms(true)) prints every plan's choice and candidates.
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {

// ---- CUDA kernels ------------------------------------------------------------------------------

// y (N, K, PQ) += bias (K), as the CPU adds the bias after the convolution.
template <class T>
__global__ void add_channel_bias_kernel(i64 total, i64 K, i64 PQ, const T* __restrict__ bias, T* __restrict__ y) {
  TALLY_GRID_LOOP(i, total) y[i] += bias[(i / PQ) % K];
}

// db (K) (=|+=) sum over n and pq of dy (N, K, PQ): one block per channel; each thread sums its
// strided share in double (as the CPU), then the block tree.
template <class T>
__global__ void channel_sum_kernel(i64 N, i64 K, i64 PQ, const T* __restrict__ dy, T* __restrict__ db, T beta) {
  const i64 M = N * PQ;
  TALLY_BLOCK_LOOP(k, K) {
    double acc = 0.0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const i64 n = m / PQ, j = m - n * PQ;
      acc += static_cast<double>(dy[(n * K + k) * PQ + j]);
    }
    acc = detail::block_sum(acc);
    if (threadIdx.x == 0) db[k] = beta == T(0) ? static_cast<T>(acc) : beta * db[k] + static_cast<T>(acc);
  }
}

// dw (n elements) = beta * dw, never reading dw when beta == 0 (the empty-batch backward filter).
template <class T>
__global__ void scale_kernel(i64 n, T beta, T* y) {
  TALLY_GRID_LOOP(i, n) y[i] = beta == T(0) ? T(0) : beta * y[i];
}

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
  TensorDescriptor x, y;
  FilterDescriptor w;
  // One convolution descriptor per pass: each carries the math type of its algorithm.
  ConvDescriptor fwd_conv, bwd_data_conv, bwd_filter_conv;
  cudnnConvolutionFwdAlgo_t fwd_algo{};
  cudnnConvolutionBwdDataAlgo_t bwd_data_algo{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter_algo{};
  std::size_t fwd_ws = 0, bwd_data_ws = 0, bwd_filter_ws = 0;
  std::string description;  // the choice and the candidates, for the log and for tests
};

// Everything a plan depends on.
using PlanKey = std::tuple<int /*device*/, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64,
                           bool /*tf32*/, bool /*deterministic*/, std::size_t /*workspace limit*/>;

PlanKey key_of(const Conv2dShape& s) {
  return {current_device(), s.N,  s.C,      s.H,      s.W,     s.K,   s.R,     s.S,
          s.stride_h,       s.stride_w, s.pad_h, s.pad_w, s.dil_h, s.dil_w, s.groups,
          allow_tf32(),     deterministic(), s.workspace_limit};
}

bool is_tensor_op(cudnnMathType_t m) { return m == CUDNN_TENSOR_OP_MATH || m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION; }
// The math type a descriptor runs with: without TF32, FMA math ("default" math lets cuDNN use
// TF32 tensor cores on Ampere and newer).
cudnnMathType_t run_math(cudnnMathType_t m) { return allow_tf32() ? m : CUDNN_FMA_MATH; }

void set_conv_desc(cudnnConvolutionDescriptor_t d, const Conv2dShape& s) {
  TALLY_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d, to_int(s.pad_h, "pad_h", s), to_int(s.pad_w, "pad_w", s),
                                                    to_int(s.stride_h, "stride_h", s), to_int(s.stride_w, "stride_w", s),
                                                    to_int(s.dil_h, "dil_h", s), to_int(s.dil_w, "dil_w", s),
                                                    CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  TALLY_CUDNN_CHECK(cudnnSetConvolutionGroupCount(d, to_int(s.groups, "groups", s)));
  // Heuristics are asked with the math type the run may use.
  TALLY_CUDNN_CHECK(cudnnSetConvolutionMathType(d, allow_tf32() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH));
}

std::string shape_text(const Conv2dShape& s) {
  return "input (" + std::to_string(s.N) + ", " + std::to_string(s.C) + ", " + std::to_string(s.H) + ", " +
         std::to_string(s.W) + "), weight (" + std::to_string(s.K) + ", " + std::to_string(s.C / s.groups) + ", " +
         std::to_string(s.R) + ", " + std::to_string(s.S) + "), stride " + std::to_string(s.stride_h) + "x" +
         std::to_string(s.stride_w) + ", padding " + std::to_string(s.pad_h) + "x" + std::to_string(s.pad_w) +
         ", dilation " + std::to_string(s.dil_h) + "x" + std::to_string(s.dil_w) + ", groups " + std::to_string(s.groups);
}

[[noreturn]] void no_algorithm(const char* pass, const Conv2dShape& s, const std::string& tried) {
  detail::fail(std::string("conv2d ") + pass + ": cuDNN offers no algorithm for " + shape_text(s) +
               " within a workspace limit of " + std::to_string(s.workspace_limit) + " bytes" +
               (deterministic() ? " that is deterministic" : "") + (allow_tf32() ? "" : " without TF32") +
               " (candidates: " + tried + "): raise the memory budget, or allow more");
}

// The parts of one pass that differ: its algorithm type, heuristics, workspace query and which of
// its algorithms are not deterministic (for the enum-order fallback, where cuDNN reports nothing).
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
};

// Chooses the algorithm of one pass (rules at the top of this file), sets its math type on
// `conv` and returns it with its workspace size; appends what was tried to `log`.
template <class Pass>
bool choose_among(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t conv, const Conv2dShape& s,
                  bool require_deterministic, typename Pass::Algo* chosen, std::size_t* ws, std::string* log,
                  std::string* seen);

template <class Pass>
typename Pass::Algo choose(cudnnHandle_t h, const Plan& p, cudnnConvolutionDescriptor_t conv, const Conv2dShape& s,
                           std::size_t* ws, std::string* log) {
  typename Pass::Algo algo{};
  std::string seen;
  if (choose_among<Pass>(h, p, conv, s, deterministic(), &algo, ws, log, &seen)) return algo;
  if (deterministic()) {
    // No deterministic algorithm fits: rather than stop a training run, take the best other one
    // (as PyTorch does by default) and say so once.
    std::string seen2;
    if (choose_among<Pass>(h, p, conv, s, false, &algo, ws, log, &seen2)) {
      *log += " -- NOT deterministic: no deterministic algorithm fits";
      std::fprintf(stderr, "tally: warning: conv2d %s of %s: no deterministic cuDNN algorithm fits the workspace limit "
                   "of %zu bytes; using algorithm %d, which is not deterministic\n", Pass::name, shape_text(s).c_str(),
                   s.workspace_limit, static_cast<int>(algo));
      return algo;
    }
  }
  no_algorithm(Pass::name, s, seen);
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
    TALLY_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, run_math(math)));
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
    else if (!allow_tf32() && is_tensor_op(c.mathType)) note = "tensor-op math";
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
    else ok = fits(algo, allow_tf32() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH, &note);
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

bool log_conv_from_env() {
  const char* v = std::getenv("TALLY_LOG_CONV");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}
std::atomic<bool> g_log_conv{log_conv_from_env()};

std::unique_ptr<Plan> make_plan(const Conv2dShape& s) {
  cudnnHandle_t h = detail::cudnn();
  auto p = std::make_unique<Plan>();
  const int N = to_int(s.N, "N", s), C = to_int(s.C, "C", s), H = to_int(s.H, "H", s), W = to_int(s.W, "W", s);
  const int K = to_int(s.K, "K", s), Cg = to_int(s.C / s.groups, "C/groups", s), R = to_int(s.R, "R", s),
            S = to_int(s.S, "S", s), P = to_int(s.P(), "P", s), Q = to_int(s.Q(), "Q", s);
  to_int(s.N * s.C * s.H * s.W, "input elements", s);  // cuDNN's legacy API indexes with int
  to_int(s.N * s.K * s.P() * s.Q(), "output elements", s);
  TALLY_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, C, H, W));
  TALLY_CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, N, K, P, Q));
  TALLY_CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, K, Cg, R, S));
  set_conv_desc(p->fwd_conv, s);
  set_conv_desc(p->bwd_data_conv, s);
  set_conv_desc(p->bwd_filter_conv, s);
  std::string log = "conv2d " + shape_text(s) + ", workspace limit " + std::to_string(s.workspace_limit) +
                    (allow_tf32() ? " B, TF32" : " B, no TF32") + (deterministic() ? ", deterministic" : "") + ":\n  ";
  p->fwd_algo = choose<FwdPass>(h, *p, p->fwd_conv, s, &p->fwd_ws, &log);
  log += "\n  ";
  p->bwd_data_algo = choose<BwdDataPass>(h, *p, p->bwd_data_conv, s, &p->bwd_data_ws, &log);
  log += "\n  ";
  p->bwd_filter_algo = choose<BwdFilterPass>(h, *p, p->bwd_filter_conv, s, &p->bwd_filter_ws, &log);
  p->description = log;
  if (g_log_conv) std::fprintf(stderr, "%s\n", log.c_str());
  return p;
}

// The cached plan of a shape (built on first use; plans live as long as the process).
const Plan& plan_for(const Conv2dShape& s) {
  static std::mutex mu;
  static auto* cache = new std::map<PlanKey, std::unique_ptr<Plan>>;  // never destroyed, as the handles
  const PlanKey key = key_of(s);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it == cache->end()) it = cache->emplace(key, make_plan(s)).first;
  return *it->second;
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
  const Plan& p = plan_for(s);
  switch (pass) {
    case ConvPass::forward: return p.fwd_ws;
    case ConvPass::backward_data: return p.bwd_data_ws;
    case ConvPass::backward_filter: return p.bwd_filter_ws;
  }
  return 0;
#else
  (void)pass;
  no_cudnn();
#endif
}

std::string conv2d_plan_description(const Conv2dShape& s) {
  if (empty_output(s) || s.C <= 0) return "conv2d: empty, no cuDNN call";
#if TALLY_HAVE_CUDNN
  return plan_for(s).description;
#else
  no_cudnn();
#endif
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
                    const T* x,     // (N, C, H, W)
                    const T* w,     // (K, C/g, R, S)
                    const T* bias,  // (K) or null
                    T* y,           // (N, K, P, Q)
                    void* workspace) {
  if (empty_output(s)) return;
#if TALLY_HAVE_CUDNN
  const Plan& p = plan_for(s);
  const float one = 1.f, zero = 0.f;
  TALLY_CUDNN_CHECK(cudnnConvolutionForward(detail::cudnn(), &one, p.x, x, p.w, w, p.fwd_conv, p.fwd_algo, workspace,
                                            p.fwd_ws, &zero, p.y, y));
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
                          const T* dy,  // (N, K, P, Q)
                          const T* w,   // (K, C/g, R, S)
                          T* dx,        // (N, C, H, W)
                          T beta, void* workspace) {
  if (s.N <= 0 || s.C <= 0 || s.H * s.W <= 0) return;
  if (empty_output(s)) {  // no output position: dx = beta * dx
    const i64 n = s.N * s.C * s.H * s.W;
    if (beta != T(1)) {
      scale_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(n, beta, dx);
      TALLY_LAUNCH_CHECK("conv2d_backward_data.scale");
    }
    return;
  }
#if TALLY_HAVE_CUDNN
  const Plan& p = plan_for(s);
  const float one = 1.f, b = static_cast<float>(beta);
  TALLY_CUDNN_CHECK(cudnnConvolutionBackwardData(detail::cudnn(), &one, p.w, w, p.y, dy, p.bwd_data_conv,
                                                 p.bwd_data_algo, workspace, p.bwd_data_ws, &b, p.x, dx));
#else
  (void)dy, (void)w, (void)workspace;
  no_cudnn();
#endif
}

template <class T>
void conv2d_backward_filter(const Conv2dShape& s,
                            const T* x,   // (N, C, H, W)
                            const T* dy,  // (N, K, P, Q)
                            T* dw,        // (K, C/g, R, S)
                            T beta, void* workspace) {
  if (empty_output(s) || s.C <= 0) {  // empty sum: dw = beta * dw
    const i64 n = s.K * (s.C / s.groups) * s.R * s.S;
    if (n > 0 && beta != T(1)) {
      scale_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(n, beta, dw);
      TALLY_LAUNCH_CHECK("conv2d_backward_filter.scale");
    }
    return;
  }
#if TALLY_HAVE_CUDNN
  const Plan& p = plan_for(s);
  // beta = 1 accumulates straight into the persistent gradient buffer (cuDNN's own scaling).
  const float one = 1.f, b = static_cast<float>(beta);
  TALLY_CUDNN_CHECK(cudnnConvolutionBackwardFilter(detail::cudnn(), &one, p.x, x, p.y, dy, p.bwd_filter_conv,
                                                   p.bwd_filter_algo, workspace, p.bwd_filter_ws, &b, p.w, dw));
#else
  (void)x, (void)dy, (void)workspace;
  no_cudnn();
#endif
}

template <class T>
void conv2d_backward_bias(const Conv2dShape& s,
                          const T* dy,  // (N, K, P, Q)
                          T* db,        // (K)
                          T beta) {
  if (s.K <= 0) return;
  const i64 PQ = s.P() * s.Q();
  channel_sum_kernel<<<detail::blocks_for(s.K), detail::kReduceThreads, 0, detail::stream()>>>(
      s.N, s.K, PQ < 0 ? 0 : PQ, dy, db, beta);
  TALLY_LAUNCH_CHECK("conv2d_backward_bias");
}

#define TALLY_INSTANTIATE_CONV(T)                                                                \
  template std::size_t conv2d_workspace_bytes<T>(const Conv2dShape&, ConvPass);                  \
  template void conv2d_forward<T>(const Conv2dShape&, const T*, const T*, const T*, T*, void*);  \
  template void conv2d_backward_data<T>(const Conv2dShape&, const T*, const T*, T*, T, void*);   \
  template void conv2d_backward_filter<T>(const Conv2dShape&, const T*, const T*, T*, T, void*); \
  template void conv2d_backward_bias<T>(const Conv2dShape&, const T*, T*, T);

TALLY_INSTANTIATE_CONV(float)
#undef TALLY_INSTANTIATE_CONV

}  // namespace tally::kernels::cuda
