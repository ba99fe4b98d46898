// kernels/cuda/optim.cu — fused optimizer updates on the GPU with torch.optim semantics; the
// CUDA twin of kernels/cpu/optim.cpp (the formulas are written out there). One thread per
// parameter element reads the parameter, its gradient and its state once and writes them once.
// The scalar factors (bias corrections, step size) are formed on the host in double, as on the
// CPU and in Python, then passed as float.
#include <cmath>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/instantiate.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {
using detail::grid_for;
using detail::kThreads;

// ---- CUDA kernels ------------------------------------------------------------------------------

template <class T>
__global__ void sgd_update_kernel(i64 n, T* __restrict__ param, const T* __restrict__ grad,
                                  T* __restrict__ momentum_buf, T lr, T momentum, T one_minus_damp,
                                  T weight_decay, bool use_wd, bool use_mom, bool nesterov, bool first_step) {
  TALLY_GRID_LOOP(i, n) {
    T g = grad[i];
    if (use_wd) g = g + weight_decay * param[i];
    if (use_mom) {
      // The first step writes the buffer without reading it (it starts uninitialised).
      const T b = first_step ? g : momentum * momentum_buf[i] + one_minus_damp * g;
      momentum_buf[i] = b;
      g = nesterov ? g + momentum * b : b;
    }
    param[i] = param[i] - lr * g;
  }
}

template <class T>
__global__ void adamw_update_kernel(i64 n, T* __restrict__ param, const T* __restrict__ grad, T* __restrict__ m,
                                    T* __restrict__ v, T beta2, T eps, T step_size, T bc2_sqrt, T decay, T w1, T w2,
                                    bool use_wd) {
  TALLY_GRID_LOOP(i, n) {
    const T g = grad[i];
    T p = param[i];
    if (use_wd) p = p * decay;
    // torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w).
    const T mi = w1 < T(0.5) ? m[i] + w1 * (g - m[i]) : g - (g - m[i]) * (T(1) - w1);
    const T vi = beta2 * v[i] + w2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const T denom = sqrt(vi) / bc2_sqrt + eps;
    p = p - step_size * (mi / denom);
    param[i] = p;
  }
}

}  // namespace

// ---- kernel launchers ----------------------------------------------------------------------------

template <class T>
void sgd_update(i64 n, T* param, const T* grad, T* momentum_buf, T lr, T momentum, T dampening, T weight_decay,
                bool nesterov, bool first_step) {
  if (n <= 0) return;
  const T one_minus_damp = static_cast<T>(1.0 - static_cast<double>(dampening));
  sgd_update_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, param, grad, momentum_buf, lr, momentum,
                                                                      one_minus_damp, weight_decay,
                                                                      weight_decay != T(0), momentum != T(0),
                                                                      nesterov, first_step);
  TALLY_LAUNCH_CHECK("sgd_update");
}

template <class T>
void adamw_update(i64 n, T* param, const T* grad, T* m, T* v, T lr, T beta1, T beta2, T eps, T weight_decay,
                  i64 step) {
  if (n <= 0) return;
  const AdamWFactors f = adamw_factors(lr, beta1, beta2, weight_decay, step);
  const T step_size = static_cast<T>(f.step_size), bc2_sqrt = static_cast<T>(f.bc2_sqrt);
  const T decay = static_cast<T>(f.decay), w1 = static_cast<T>(f.w1), w2 = static_cast<T>(f.w2);
  adamw_update_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, param, grad, m, v, beta2, eps, step_size,
                                                                       bc2_sqrt, decay, w1, w2, weight_decay != T(0));
  TALLY_LAUNCH_CHECK("adamw_update");
}

TALLY_INSTANTIATE_OPTIM(float)

}  // namespace tally::kernels::cuda
