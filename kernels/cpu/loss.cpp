// kernels/cpu/loss.cpp — softmax cross-entropy over logits (N, C), int64 targets (N), with
// torch.nn.functional.cross_entropy's class weights, ignore_index and label smoothing.
//
// For a kept sample i with target t, z = logits[i], lse = log sum_c exp(z_c), -log p_c = lse - z_c:
//   loss_i = (1 - e) * w[t] * (lse - z_t) + (e / C) * sum_c w[c] * (lse - z_c)
// and, since d(-log p_k)/dz_c = p_c - [c == k],
//   dloss_i/dz_c = (1 - e) * w[t] * (p_c - [c == t]) + (e / C) * (W * p_c - w[c]),  W = sum_c w[c].
// An ignored sample (target == ignore_index) has loss 0, weight 0 and gradient 0.
#include <cmath>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/instantiate.h"

namespace tally::kernels::cpu {
namespace {

constexpr i64 kLossParallelThreshold = i64{1} << 14;

// Row maximum and log-sum-exp accumulated in double (max subtracted first: no overflow).
template <class T>
inline double row_lse(i64 C, const T* z) {
  double zmax = -INFINITY;
  for (i64 c = 0; c < C; ++c) {
    const double v = static_cast<double>(z[c]);
    if (v > zmax || std::isnan(v)) zmax = v;
  }
  double s = 0.0;
  for (i64 c = 0; c < C; ++c) s += std::exp(static_cast<double>(z[c]) - zmax);
  return zmax + std::log(s);
}

}  // namespace

template <class T>
i64 cross_entropy_forward(i64 N, i64 C, const T* logits, const i64* targets, const T* class_weight,
                          i64 ignore_index, T label_smoothing, T* loss, T* sample_weight,
                          bool check_targets) {
  // Find the first invalid target sequentially (cheap, and gives a deterministic answer).
  i64 first_invalid = -1;
  for (i64 i = 0; check_targets && i < N; ++i) {
    const i64 t = targets[i];
    if (t != ignore_index && (t < 0 || t >= C)) {
      first_invalid = i;
      break;
    }
  }
  const double e = static_cast<double>(label_smoothing);
  const double e_over_c = C > 0 ? e / static_cast<double>(C) : 0.0;

#pragma omp parallel for schedule(static) if (N * C > kLossParallelThreshold && N > 1)
  for (i64 i = 0; i < N; ++i) {
    const i64 t = targets[i];
    if (t == ignore_index || t < 0 || t >= C) {  // ignored, or invalid (reported above)
      if (loss) loss[i] = T(0);
      if (sample_weight) sample_weight[i] = T(0);
      continue;
    }
    const T* z = logits + i * C;
    const double lse = row_lse(C, z);
    const double wt = class_weight ? static_cast<double>(class_weight[t]) : 1.0;
    double l = (1.0 - e) * wt * (lse - static_cast<double>(z[t]));
    if (e != 0.0) {
      double smooth = 0.0;
      for (i64 c = 0; c < C; ++c) {
        const double wc = class_weight ? static_cast<double>(class_weight[c]) : 1.0;
        smooth += wc * (lse - static_cast<double>(z[c]));
      }
      l += e_over_c * smooth;
    }
    if (loss) loss[i] = static_cast<T>(l);
    if (sample_weight) sample_weight[i] = static_cast<T>(wt);
  }
  return first_invalid;
}

template <class T>
void cross_entropy_reduce(i64 N, const T* loss, const T* sample_weight, T fixed_scale, T* y, T* scale) {
  double total = 0, wsum = 0;
  for (i64 i = 0; i < N; ++i) {
    total += static_cast<double>(loss[i]);
    wsum += static_cast<double>(sample_weight[i]);
  }
  const double sc = fixed_scale > T(0) ? static_cast<double>(fixed_scale) : 1.0 / wsum;
  scale[0] = static_cast<T>(sc);
  y[0] = static_cast<T>(total * sc);
}

template <class T>
void cross_entropy_backward(i64 N, i64 C, const T* logits, const i64* targets,
                            const T* class_weight, i64 ignore_index, T label_smoothing,
                            const T* dloss, T* dlogits, T beta) {
  const double e = static_cast<double>(label_smoothing);
  const double e_over_c = C > 0 ? e / static_cast<double>(C) : 0.0;
  double wsum = static_cast<double>(C);
  if (class_weight) {
    wsum = 0.0;
    for (i64 c = 0; c < C; ++c) wsum += static_cast<double>(class_weight[c]);
  }
  const bool overwrite = beta == T(0);

#pragma omp parallel for schedule(static) if (N * C > kLossParallelThreshold && N > 1)
  for (i64 i = 0; i < N; ++i) {
    const i64 t = targets[i];
    T* g = dlogits + i * C;
    if (t == ignore_index || t < 0 || t >= C) {  // no gradient (invalid targets: defensively)
      if (overwrite) {
        for (i64 c = 0; c < C; ++c) g[c] = T(0);
      }
      continue;
    }
    const T* z = logits + i * C;
    const double lse = row_lse(C, z);
    const double s = static_cast<double>(dloss[i]);
    const double wt = class_weight ? static_cast<double>(class_weight[t]) : 1.0;
    const double a = s * (1.0 - e) * wt;   // coefficient of (p_c - [c == t])
    const double b = s * e_over_c;         // coefficient of (W * p_c - w[c])
    for (i64 c = 0; c < C; ++c) {
      const double p = std::exp(static_cast<double>(z[c]) - lse);
      const double wc = class_weight ? static_cast<double>(class_weight[c]) : 1.0;
      double v = a * (p - (c == t ? 1.0 : 0.0));
      if (e != 0.0) v += b * (wsum * p - wc);
      if (overwrite) {
        g[c] = static_cast<T>(v);
      } else {
        g[c] = beta * g[c] + static_cast<T>(v);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations.
TALLY_INSTANTIATE_LOSS(float)
TALLY_INSTANTIATE_LOSS(double)

}  // namespace tally::kernels::cpu
