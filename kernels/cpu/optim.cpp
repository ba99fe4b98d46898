// kernels/cpu/optim.cpp — fused optimizer updates with torch.optim semantics (single-tensor path).
//
// SGD (torch.optim.SGD, maximize = false):
//   g = grad + wd * p                                  (only when wd != 0)
//   if momentum != 0:
//     buf = first_step ? g : momentum * buf + (1 - dampening) * g   (no dampening on step 1)
//     g   = nesterov ? g + momentum * buf : buf
//   p = p - lr * g
// AdamW (torch.optim.AdamW, amsgrad = false, maximize = false), step t is 1-based:
//   p  = p * (1 - lr * wd)
//   m  = lerp(m, g, 1 - b1)          (= b1 * m + (1 - b1) * g; torch uses lerp_)
//   v  = b2 * v + (1 - b2) * g^2
//   p  = p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The scalar factors (bias corrections, step size) are formed in double as Python does, then
// used in T, so that float results follow torch's float arithmetic closely.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/instantiate.h"

namespace tally::kernels::cpu {
namespace {
constexpr i64 kOptimParallelThreshold = i64{1} << 15;
}  // namespace

template <class T>
void sgd_update(i64 n, T* param, const T* grad, T* momentum_buf, T lr, T momentum, T dampening,
                T weight_decay, bool nesterov, bool first_step) {
  const bool use_wd = weight_decay != T(0);
  const bool use_mom = momentum != T(0);
  const T one_minus_damp = static_cast<T>(1.0 - static_cast<double>(dampening));
#pragma omp parallel for schedule(static) if (n > kOptimParallelThreshold)
  for (i64 i = 0; i < n; ++i) {
    T g = grad[i];
    if (use_wd) g = g + weight_decay * param[i];
    if (use_mom) {
      T b;
      if (first_step) {
        b = g;
      } else {
        b = momentum * momentum_buf[i] + one_minus_damp * g;
      }
      momentum_buf[i] = b;
      g = nesterov ? g + momentum * b : b;
    }
    param[i] = param[i] - lr * g;
  }
}

template <class T>
void adamw_update(i64 n, T* param, const T* grad, T* m, T* v, T lr, T beta1, T beta2, T eps,
                  T weight_decay, i64 step) {
  const AdamWFactors f = adamw_factors(lr, beta1, beta2, weight_decay, step);
  const T step_size = static_cast<T>(f.step_size), bc2_sqrt = static_cast<T>(f.bc2_sqrt);
  const T decay = static_cast<T>(f.decay), w1 = static_cast<T>(f.w1), w2 = static_cast<T>(f.w2);
  const bool use_wd = weight_decay != T(0);
#pragma omp parallel for schedule(static) if (n > kOptimParallelThreshold)
  for (i64 i = 0; i < n; ++i) {
    const T g = grad[i];
    T p = param[i];
    if (use_wd) p = p * decay;
    // torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w).
    const T mi = w1 < T(0.5) ? m[i] + w1 * (g - m[i]) : g - (g - m[i]) * (T(1) - w1);
    const T vi = beta2 * v[i] + w2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const T denom = std::sqrt(vi) / bc2_sqrt + eps;
    p = p - step_size * (mi / denom);
    param[i] = p;
  }
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations.
TALLY_INSTANTIATE_OPTIM(float)
TALLY_INSTANTIATE_OPTIM(double)

}  // namespace tally::kernels::cpu
