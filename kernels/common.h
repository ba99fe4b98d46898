// kernels/common.h — conventions shared by every kernel in kernels/cpu and kernels/cuda.
//
// Kernels know raw pointers, sizes and (on CUDA) a stream: no Tensor, no arena, no autograd.
// Conventions, so that the CPU and CUDA files of one op family read side by side:
//   * Layout is NCHW, densely packed (contiguous, row-major). Shapes are written next to
//     every pointer: `x  // (N, C, H, W)`.
//   * Element type T of the activations is float or double on CPU (double exists for gradient
//     checks), float on CUDA, and bf16 (below). A kernel computes in compute_t<T> — T itself, or
//     float for bf16 — and takes its scalars (alpha, beta, eps) and the parameters and statistics
//     beside the activations (weights, biases, norm statistics, their gradients) in compute_t<T>:
//     mixed precision keeps parameters in float32 while activations are bf16.
//   * An output that a backward kernel may *accumulate* into takes `T beta` (0 or 1):
//       beta == 0  -> out = value           (out is never read: it may hold garbage or NaN)
//       beta == 1  -> out = out + value     (gradient accumulation, "beta = 1 in GEMM")
//   * A kernel that needs scratch memory never allocates: it has a `*_workspace_bytes` companion
//     and receives a `void* workspace` of at least that size, carved from the arena by core/.
//   * Integer labels are int64 (PyTorch's torch.long); pooling argmax indices are int32.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>

#if defined(__CUDACC__)
#define TALLY_HOST_DEVICE __host__ __device__
#else
#define TALLY_HOST_DEVICE
#endif

namespace tally::kernels {
using i64 = std::int64_t;

// bfloat16: the upper 16 bits of a float32 (sign, 8 exponent bits, 7 mantissa bits), the same
// bits on both backends and in safetensors' BF16. From float: round to nearest, ties to even; a
// NaN stays a NaN (quiet, its sign kept) and +-Inf stay +-Inf, values past the largest finite
// bf16 round to Inf as IEEE's rounding says. From double: through float (as PyTorch converts).
// To float: exact.
struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  TALLY_HOST_DEVICE explicit bf16(float f) : bits(round(f)) {}
  TALLY_HOST_DEVICE explicit bf16(double d) : bits(round(static_cast<float>(d))) {}
  TALLY_HOST_DEVICE explicit bf16(int i) : bits(round(static_cast<float>(i))) {}
  TALLY_HOST_DEVICE operator float() const {
    const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
    float f;
    copy_bits(&f, &u);
    return f;
  }
  TALLY_HOST_DEVICE static bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }

 private:
  // memcpy (host and device) rather than a loop of bytes: the compilers see a register move, and
  // the CPU's loops over bf16 arrays vectorize (a byte loop made them 10x slower, measured).
  TALLY_HOST_DEVICE static void copy_bits(void* dst, const void* src) { std::memcpy(dst, src, 4); }
  // Branch-free (a select), so that conversions in loops vectorize.
  TALLY_HOST_DEVICE static std::uint16_t round(float f) {
    std::uint32_t u;
    copy_bits(&u, &f);
    const std::uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // ties to even; Inf stays Inf
    const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
    return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest);
  }
};
static_assert(sizeof(bf16) == 2, "bf16 is two bytes");

// The type a kernel on T computes in, and the type of its parameters and scalars: float for bf16.
template <class T>
struct Compute {
  using type = T;
};
template <>
struct Compute<bf16> {
  using type = float;
};
template <class T>
using compute_t = typename Compute<T>::type;

// What a training batch norm fuses after itself (core/ops.h, batch_norm with relu or a residual):
// forward y = relu(bn(x) + residual); backward folds ReLU's mask (y > 0) into the norm's gradient
// and hands the residual its gradient dz = dy * (y > 0). The defaults are the plain batch norm.
// channels_last: x, y and the residual are stored (N, HW, C) — a channels-last tensor's bytes —
// instead of (N, C, HW); both backends' batch norms run it, their group norms refuse it.
template <class T>
struct NormAct {
  const T* residual = nullptr;  // (N, C, HW) added before the ReLU, or null
  bool relu = false;
  bool channels_last = false;
};
// In place: dresidual may be dy itself (beta 0: the masked gradient replaces dy), or else dx may
// be dy itself (beta 0) — a backward that owns its incoming gradient reuses its buffer.
template <class T>
struct NormActGrad {
  const T* y = nullptr;  // (N, C, HW) the fused forward's output, whose sign is ReLU's mask (relu only)
  bool relu = false;
  T* dresidual = nullptr;  // (N, C, HW) receives dz (=|+= by beta_residual); null: not needed
  compute_t<T> beta_residual = 0;
  bool channels_last = false;  // dy, x, y, dx and dresidual stored (N, HW, C), as NormAct's
  // The per-channel sums of a backward, sum dz and sum dz * (x - mean), as (2, C) doubles: written
  // to sums_out when given, and taken from sums_in instead of summed when given (a second call on
  // the same dz and x, which would sum the same bits again). The CPU's; CUDA sums again.
  double* sums_out = nullptr;
  const double* sums_in = nullptr;
};

// The three passes of a convolution; each has its own workspace (conv2d_workspace_bytes).
enum class ConvPass { forward, backward_data, backward_filter };

// A 2-d convolution, as both backends take it.
struct Conv2dShape {
  i64 N, C, H, W;      // input  (N, C, H, W)
  i64 K, R, S;         // weight (K, C / groups, R, S); output (N, K, P, Q)
  i64 stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1, groups = 1;
  // The most workspace one pass may take; core/ sets it from the arena's budget. CUDA: cuDNN's
  // algorithm is chosen under it (docs/gpu.md); CPU: oneDNN runs the batch in chunks of samples
  // under it. The CPU's im2col workspace is fixed by the shape.
  std::size_t workspace_limit = std::size_t(64) << 20;
  // The forward adds a bias. (The CPU's bf16 forward with a bias runs where the bias is added
  // before the one rounding to bf16: the widened route, not oneDNN, which would round twice.)
  bool bias = false;
  // x, y, dx and dy are channels-last: stored (N, H, W, C) / (N, P, Q, K) rather than NCHW (the
  // weights stay (K, C/g, R, S)). Only where conv2d_takes_channels_last says so.
  bool channels_last = false;
  i64 P() const { return (H + 2 * pad_h - dil_h * (R - 1) - 1) / stride_h + 1; }
  i64 Q() const { return (W + 2 * pad_w - dil_w * (S - 1) - 1) / stride_w + 1; }
};

// One convolution pass as a plan runs it: what a GPU's tuning measures (kernels/cuda/cuda_kernels.h).
struct ConvPassKey {
  Conv2dShape shape;
  bool bf16 = false;
  ConvPass pass = ConvPass::forward;
  float beta = 0;  // 0 writes, 1 accumulates
};
// A pass's engines as measured on a GPU (docs/gpu.md, "Tuning"): the fastest configuration of the
// heuristics' list — its rank there, cuDNN's global engine index, workspace and time a run — and the
// fastest whose workspace is at most the heuristics' own choice's (the within_* fields: what a plan
// takes when the fastest would shrink its micro-batch), beside the heuristics' choice and its time.
// Ranks and engines -1: nothing measured. Times in milliseconds.
struct TunedConvPass {
  std::int64_t rank = -1, engine = -1;
  std::size_t workspace = 0;
  double ms = 0;
  std::int64_t within_rank = -1, within_engine = -1;
  std::size_t within_workspace = 0;
  double within_ms = 0;
  std::int64_t heuristic_rank = -1, heuristic_engine = -1;
  std::size_t heuristic_workspace = 0;
  double heuristic_ms = 0;
  int candidates = 0;  // configurations timed
  // Installed for its within_* choice (the level a run gave the pass: core/conv_tuning.h); not kept
  // in files or records, which say each pass's level apart.
  bool use_within = false;
  // Not measured to the end: the time cap cut the list short, or the heuristics' own choice had no
  // room to run. Such a result is no file's entry.
  bool cut = false;
  friend bool operator==(const TunedConvPass&, const TunedConvPass&) = default;
};

// ---- dropout's mask (docs/models.md, "Dropout") ------------------------------------------------
// Counter-based, so that it does not depend on how a batch is split, where, or how often it is
// drawn: element e of sample s (e in the sample's logical (C, H, W) order, whatever the memory
// format; s the sample's index in the step's whole batch, across micro-batches, ranks and pipeline
// stages) at training step `step` of the layer with seed `seed` is kept when word e % 4 of
// Philox4x32-10 (Salmon et al., SC 2011; PyTorch's and cuRAND's generator) with key `seed` and
// counter (e / 4, s, step) is at least p * 2^32 — computed the same on the CPU and the GPU, so a
// micro-batched step equals the full batch, a recomputed segment draws the same mask, and a
// resumed run the same bits. A kept element is x * scale with scale = (float)(1 / (1 - p)), a
// dropped one 0: PyTorch's formula (its mask's values are that scale).
struct DropoutKey {
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  std::int64_t first_sample = 0;  // the index of the tensor's sample 0 in the step's batch
  std::uint64_t threshold = 0;    // p * 2^32, rounded: keep when the word is >= it (2^32 for p = 1)
  float scale = 1;                // 1 / (1 - p) in float (0 for p = 1)
};
// The key of dropout with probability p (0 <= p <= 1) for these seed, step and first sample.
inline DropoutKey dropout_key(double p, std::uint64_t seed, std::uint64_t step, std::int64_t first_sample) {
  DropoutKey k;
  k.seed = seed, k.step = step, k.first_sample = first_sample;
  k.threshold = static_cast<std::uint64_t>(p * 4294967296.0 + 0.5);
  k.scale = p >= 1 ? 0.f : static_cast<float>(1.0 / (1.0 - p));
  return k;
}
// Philox4x32-10: the four 32-bit words of counter c under key k.
TALLY_HOST_DEVICE inline void philox4x32_10(std::uint32_t c[4], std::uint32_t k0, std::uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(0xD2511F53u) * c[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(0xCD9E8D57u) * c[2];
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    const std::uint32_t c1 = c[1], c3 = c[3];
    c[0] = hi1 ^ c1 ^ k0, c[1] = lo1, c[2] = hi0 ^ c3 ^ k1, c[3] = lo0;
    k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
  }
}
// Whether element e of sample s (of the tensor: the key's first_sample is added) is kept.
TALLY_HOST_DEVICE inline bool dropout_keeps(const DropoutKey& k, std::int64_t s, std::int64_t e) {
  const std::uint64_t sample = static_cast<std::uint64_t>(k.first_sample + s);
  std::uint32_t c[4] = {static_cast<std::uint32_t>(e >> 2), static_cast<std::uint32_t>(sample),
                        static_cast<std::uint32_t>(k.step), static_cast<std::uint32_t>(k.step >> 32)};
  philox4x32_10(c, static_cast<std::uint32_t>(k.seed), static_cast<std::uint32_t>(k.seed >> 32));
  return static_cast<std::uint64_t>(c[e & 3]) >= k.threshold;
}

// A 2-d pooling window, as both backends take it.
struct Pool2dShape {
  i64 N, C, H, W;
  i64 kh, kw, stride_h, stride_w, pad_h = 0, pad_w = 0;
  // Max pooling (both backends): x, y, argmax, dx and dy channels-last, (N, H, W, C) / (N, P, Q, C);
  // the argmax is still h * W + w. The other pooling kernels take NCHW only.
  bool channels_last = false;
  i64 P() const { return (H + 2 * pad_h - kh) / stride_h + 1; }
  i64 Q() const { return (W + 2 * pad_w - kw) / stride_w + 1; }
};

// AdamW's per-step scalars (PyTorch's formulas), formed on the host in double from the step t >= 1
// and then rounded once to T: both backends' updates use exactly these.
struct AdamWFactors {
  double step_size;  // lr / (1 - beta1^t)
  double bc2_sqrt;   // sqrt(1 - beta2^t)
  double decay;      // 1 - lr * weight_decay
  double w1, w2;     // 1 - beta1, 1 - beta2 (lerp weights)
};
inline AdamWFactors adamw_factors(double lr, double beta1, double beta2, double weight_decay, i64 step) {
  const double t = static_cast<double>(step);
  return {lr / (1.0 - std::pow(beta1, t)), std::sqrt(1.0 - std::pow(beta2, t)), 1.0 - lr * weight_decay,
          1.0 - beta1, 1.0 - beta2};
}

// Time per op (kernels/backend.inc's profile functions): calls and milliseconds per op name.
struct ProfileRow {
  std::int64_t calls = 0;
  double ms = 0;
};
using ProfileTable = std::map<std::string, ProfileRow>;
}  // namespace tally::kernels
