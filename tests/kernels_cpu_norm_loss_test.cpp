// tests/kernels_cpu_norm_loss_test.cpp — CPU reference kernels: elementwise, norm, loss, optim.
//
// Backward kernels are checked against central finite differences of L = sum(out * r) with a
// random upstream r, in double precision (h = 1e-6). Also checked: the beta convention (beta = 0
// overwrites a NaN-filled buffer, beta = 1 adds exactly), batch-norm running statistics, the
// normalised output statistics, cross-entropy against a direct formula, invalid targets, and the
// optimizer updates against scalar loops of the torch.optim rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace k = tally::kernels::cpu;
using tally::kernels::i64;
using Vec = std::vector<double>;

namespace {

constexpr double kH = 1e-6;     // finite-difference step
constexpr double kFdTol = 1e-6;  // relative tolerance of gradient checks
const double kNaN = std::numeric_limits<double>::quiet_NaN();

Vec random_vec(std::size_t n, unsigned seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

// Uniform in [-1, -margin] U [margin, 1]: keeps relu's kink out of the finite differences.
Vec random_vec_away_from_zero(std::size_t n, unsigned seed, double margin = 0.05) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(margin, 1.0);
  std::bernoulli_distribution sign(0.5);
  Vec v(n);
  for (auto& x : v) x = sign(gen) ? d(gen) : -d(gen);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of L with respect to every element of x (x is perturbed in place and
// restored; L reads x through its captures).
Vec fd_grad(Vec& x, const std::function<double()>& L) {
  Vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double save = x[i];
    x[i] = save + kH;
    const double lp = L();
    x[i] = save - kH;
    const double lm = L();
    x[i] = save;
    g[i] = (lp - lm) / (2 * kH);
  }
  return g;
}

void expect_no_nan(const Vec& v, const std::string& what) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    ASSERT_FALSE(std::isnan(v[i])) << what << "[" << i << "] is NaN";
  }
}

void expect_close(const Vec& actual, const Vec& expected, double rtol, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  expect_no_nan(actual, what);
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double tol = rtol * std::max(1.0, std::abs(expected[i]));
    EXPECT_NEAR(actual[i], expected[i], tol) << what << "[" << i << "]";
  }
}

// The beta convention for one kernel writing `n` outputs: run(out, beta) must, with beta = 0,
// overwrite a NaN-filled buffer completely, and with beta = 1 add exactly the same values onto
// a random preexisting buffer.
void check_beta(std::size_t n, unsigned seed, const std::function<void(double*, double)>& run,
                const std::string& what) {
  Vec fresh(n, kNaN);
  run(fresh.data(), 0.0);
  expect_no_nan(fresh, what + " (beta=0 over NaN)");
  const Vec pre = random_vec(n, seed);
  Vec acc = pre;
  run(acc.data(), 1.0);
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_EQ(acc[i], pre[i] + fresh[i]) << what << " (beta=1)[" << i << "]";
  }
}

}  // namespace

// =============================================================================================
// Elementwise.

TEST(Elementwise, ReluBackwardMatchesFiniteDifferences) {
  const std::size_t n = 257;
  Vec x = random_vec_away_from_zero(n, 1);
  const Vec r = random_vec(n, 2);
  Vec y(n);
  auto L = [&] {
    k::relu_forward<double>(n, x.data(), y.data());
    return dot(y, r);
  };
  L();
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(y[i], x[i] > 0 ? x[i] : 0.0);
  Vec dx(n, kNaN);
  k::relu_backward<double>(n, r.data(), y.data(), dx.data(), 0.0);
  expect_close(dx, fd_grad(x, L), kFdTol, "relu dx");
  check_beta(n, 3, [&](double* out, double b) {
    k::relu_backward<double>(n, r.data(), y.data(), out, b);
  }, "relu_backward");
}

TEST(Elementwise, MulBackwardMatchesFiniteDifferences) {
  const std::size_t n = 100;
  Vec a = random_vec(n, 4), b = random_vec(n, 5);
  const Vec r = random_vec(n, 6);
  Vec y(n);
  auto L = [&] {
    k::mul<double>(n, a.data(), b.data(), y.data());
    return dot(y, r);
  };
  Vec da(n, kNaN), db(n, kNaN);
  k::mul_backward<double>(n, r.data(), b.data(), da.data(), 0.0);
  k::mul_backward<double>(n, r.data(), a.data(), db.data(), 0.0);
  expect_close(da, fd_grad(a, L), kFdTol, "mul da");
  expect_close(db, fd_grad(b, L), kFdTol, "mul db");
  check_beta(n, 7, [&](double* out, double bt) {
    k::mul_backward<double>(n, r.data(), b.data(), out, bt);
  }, "mul_backward");
}

TEST(Elementwise, MapsAndRowOps) {
  const std::size_t n = 50;
  const Vec a = random_vec(n, 8), b = random_vec(n, 9);
  Vec y(n, kNaN);
  k::fill<double>(n, 2.5, y.data());
  for (double v : y) EXPECT_EQ(v, 2.5);
  k::copy<double>(n, a.data(), y.data());
  EXPECT_EQ(y, a);
  k::add<double>(n, a.data(), b.data(), -1.0, y.data());
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(y[i], a[i] - b[i]);
  k::axpby<double>(n, 3.0, a.data(), 0.0, y.data());
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(y[i], 3.0 * a[i]);
  check_beta(n, 10, [&](double* out, double bt) {
    k::axpby<double>(n, -0.5, a.data(), bt, out);
  }, "axpby");

  const i64 rows = 7, cols = 5;
  const Vec x = random_vec(rows * cols, 11), bias = random_vec(cols, 12);
  Vec z(rows * cols, kNaN);
  k::add_bias_rows<double>(rows, cols, x.data(), bias.data(), z.data());
  for (i64 r = 0; r < rows; ++r)
    for (i64 c = 0; c < cols; ++c) EXPECT_EQ(z[r * cols + c], x[r * cols + c] + bias[c]);
  // sum_rows is the backward of add_bias_rows with respect to bias.
  Vec bias_v = bias;
  const Vec up = random_vec(rows * cols, 13);
  auto L = [&] {
    k::add_bias_rows<double>(rows, cols, x.data(), bias_v.data(), z.data());
    return dot(z, up);
  };
  Vec dbias(cols, kNaN);
  k::sum_rows<double>(rows, cols, up.data(), dbias.data(), 0.0);
  expect_close(dbias, fd_grad(bias_v, L), kFdTol, "sum_rows");
  check_beta(cols, 14, [&](double* out, double bt) {
    k::sum_rows<double>(rows, cols, up.data(), out, bt);
  }, "sum_rows");

  // Large cases take the parallel paths.
  const i64 R2 = 300, C2 = 500;
  const Vec big = random_vec(R2 * C2, 15);
  Vec s2(C2, kNaN);
  k::sum_rows<double>(R2, C2, big.data(), s2.data(), 0.0);
  for (i64 c = 0; c < C2; ++c) {
    double s = 0.0;
    for (i64 r = 0; r < R2; ++r) s += big[r * C2 + c];
    EXPECT_NEAR(s2[c], s, 1e-12);
  }
  double s = 0.0;
  for (double v : big) s += v;
  EXPECT_NEAR(k::sum_all<double>(R2 * C2, big.data()), s, 1e-9);
  EXPECT_NEAR(k::sum_all<double>(3, big.data()), big[0] + big[1] + big[2], 1e-15);
  EXPECT_EQ(k::sum_all<double>(0, big.data()), 0.0);
  // float input, double accumulation: 2^24 + 1 + 1 + ... would stall in float.
  std::vector<float> f(1 << 17, 1.0f);
  f[0] = 16777216.0f;
  EXPECT_EQ(k::sum_all<float>(static_cast<i64>(f.size()), f.data()),
            static_cast<float>(16777216.0 + (f.size() - 1)));
}

TEST(Elementwise, StridedCopyOfTransposed3DView) {
  // x is a dense (2, 3, 4) tensor; the view permutes it to (4, 2, 3): v[i][j][k] = x[j][k][i].
  const i64 A = 2, B = 3, Cc = 4;
  Vec x(A * B * Cc);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<double>(i);
  const i64 shape[3] = {Cc, A, B};
  const i64 strides[3] = {1, B * Cc, Cc};
  Vec y(x.size(), kNaN);
  k::strided_copy<double>(3, shape, strides, x.data(), y.data());
  for (i64 i = 0; i < Cc; ++i)
    for (i64 j = 0; j < A; ++j)
      for (i64 kk = 0; kk < B; ++kk)
        EXPECT_EQ(y[(i * A + j) * B + kk], x[(j * B + kk) * Cc + i]);

  // Broadcast (stride 0) of a row vector to (3, 4), and a scalar to (2, 2).
  const i64 bshape[2] = {3, 4}, bstrides[2] = {0, 1};
  Vec yb(12, kNaN);
  k::strided_copy<double>(2, bshape, bstrides, x.data(), yb.data());
  for (i64 r = 0; r < 3; ++r)
    for (i64 c = 0; c < 4; ++c) EXPECT_EQ(yb[r * 4 + c], x[c]);
  const i64 sshape[2] = {2, 2}, sstrides[2] = {0, 0};
  Vec ys(4, kNaN);
  k::strided_copy<double>(2, sshape, sstrides, x.data() + 5, ys.data());
  for (double v : ys) EXPECT_EQ(v, 5.0);

  // A large transposed view (parallel path): (64, 32, 48) -> permute (2, 0, 1).
  const i64 P0 = 64, P1 = 32, P2 = 48;
  Vec bx(P0 * P1 * P2);
  for (std::size_t i = 0; i < bx.size(); ++i) bx[i] = static_cast<double>(i);
  const i64 lshape[3] = {P2, P0, P1};
  const i64 lstrides[3] = {1, P1 * P2, P2};
  Vec by(bx.size(), kNaN);
  k::strided_copy<double>(3, lshape, lstrides, bx.data(), by.data());
  std::size_t bad = 0;
  for (i64 i = 0; i < P2; ++i)
    for (i64 j = 0; j < P0; ++j)
      for (i64 kk = 0; kk < P1; ++kk)
        bad += by[(i * P0 + j) * P1 + kk] != bx[(j * P1 + kk) * P2 + i];
  EXPECT_EQ(bad, 0u);
}

TEST(Elementwise, ConvertRoundTrip) {
  const std::size_t n = 1000;
  const Vec d = random_vec(n, 16);
  std::vector<float> f(n);
  k::convert<double, float>(n, d.data(), f.data());
  Vec back(n, kNaN);
  k::convert<float, double>(n, f.data(), back.data());
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_EQ(f[i], static_cast<float>(d[i]));
    EXPECT_EQ(back[i], static_cast<double>(static_cast<float>(d[i])));
  }
  std::vector<float> f2(n);
  k::convert<float, float>(n, f.data(), f2.data());
  EXPECT_EQ(f2, f);
  Vec d2(n);
  k::convert<double, double>(n, d.data(), d2.data());
  EXPECT_EQ(d2, d);
  // float -> double -> float is exact.
  std::vector<float> f3(n);
  k::convert<double, float>(n, back.data(), f3.data());
  EXPECT_EQ(f3, f);
}

// =============================================================================================
// Batch norm.

namespace {

struct BnCase {
  i64 N, C, HW;
};

void run_bn_train_fd(const BnCase& s, bool affine, unsigned seed) {
  const i64 N = s.N, C = s.C, HW = s.HW, n = N * C * HW;
  const double eps = 1e-5;
  Vec x = random_vec(n, seed);
  Vec gamma = random_vec(C, seed + 1, 0.5, 1.5), beta = random_vec(C, seed + 2);
  const Vec r = random_vec(n, seed + 3);
  Vec y(n), mean(C), invstd(C);
  auto L = [&] {
    k::batch_norm_forward_train<double>(N, C, HW, x.data(), affine ? gamma.data() : nullptr,
                                        affine ? beta.data() : nullptr, eps, 0.1, nullptr,
                                        nullptr, y.data(), mean.data(), invstd.data());
    return dot(y, r);
  };
  L();
  expect_no_nan(y, "bn y");
  Vec dx(n, kNaN), dg(C, kNaN), db(C, kNaN);
  k::batch_norm_backward<double>(N, C, HW, r.data(), x.data(), affine ? gamma.data() : nullptr,
                                 mean.data(), invstd.data(), dx.data(), 0.0, dg.data(), db.data(),
                                 0.0);
  const std::string tag = affine ? "bn(affine)" : "bn(no affine)";
  expect_close(dx, fd_grad(x, L), kFdTol, tag + " dx");
  if (affine) {
    expect_close(dg, fd_grad(gamma, L), kFdTol, tag + " dgamma");
    expect_close(db, fd_grad(beta, L), kFdTol, tag + " dbeta");
  } else {
    // Without affine parameters dgamma/dbeta are still the gradients at gamma = 1, beta = 0.
    std::fill(gamma.begin(), gamma.end(), 1.0);
    std::fill(beta.begin(), beta.end(), 0.0);
    affine = true;
    expect_close(dg, fd_grad(gamma, L), kFdTol, tag + " dgamma");
    expect_close(db, fd_grad(beta, L), kFdTol, tag + " dbeta");
    affine = false;
    L();
    // dx alone (dgamma / dbeta null) gives the same dx.
    Vec dx2(n, kNaN);
    k::batch_norm_backward<double>(N, C, HW, r.data(), x.data(), nullptr, mean.data(),
                                   invstd.data(), dx2.data(), 0.0, nullptr, nullptr, 0.0);
    EXPECT_EQ(dx2, dx);
  }
  // beta semantics, for dx and the parameter gradients separately.
  const Vec* g = affine ? &gamma : nullptr;
  check_beta(n, seed + 4, [&](double* out, double bt) {
    k::batch_norm_backward<double>(N, C, HW, r.data(), x.data(), g ? g->data() : nullptr,
                                   mean.data(), invstd.data(), out, bt, nullptr, nullptr, 0.0);
  }, tag + " dx");
  check_beta(C, seed + 5, [&](double* out, double bt) {
    k::batch_norm_backward<double>(N, C, HW, r.data(), x.data(), g ? g->data() : nullptr,
                                   mean.data(), invstd.data(), nullptr, 0.0, out, nullptr, bt);
  }, tag + " dgamma");
  check_beta(C, seed + 6, [&](double* out, double bt) {
    k::batch_norm_backward<double>(N, C, HW, r.data(), x.data(), g ? g->data() : nullptr,
                                   mean.data(), invstd.data(), nullptr, 0.0, nullptr, out, bt);
  }, tag + " dbeta");
}

}  // namespace

TEST(BatchNorm, TrainBackwardMatchesFiniteDifferencesAffine) {
  run_bn_train_fd({3, 4, 5}, true, 100);
  run_bn_train_fd({2, 3, 1}, true, 110);  // HW = 1 (BatchNorm1d on (N, C))
  run_bn_train_fd({1, 2, 7}, true, 120);  // N = 1
}

TEST(BatchNorm, TrainBackwardMatchesFiniteDifferencesNoAffine) {
  run_bn_train_fd({3, 4, 5}, false, 200);
  run_bn_train_fd({4, 2, 3}, false, 210);
}

TEST(BatchNorm, EvalBackwardMatchesFiniteDifferences) {
  const i64 N = 3, C = 4, HW = 6, n = N * C * HW;
  const double eps = 1e-5;
  Vec x = random_vec(n, 300), gamma = random_vec(C, 301), beta = random_vec(C, 302);
  const Vec rm = random_vec(C, 303), rv = random_vec(C, 304, 0.2, 2.0), r = random_vec(n, 305);
  Vec y(n);
  auto L = [&] {
    k::batch_norm_forward_eval<double>(N, C, HW, x.data(), gamma.data(), beta.data(), rm.data(),
                                       rv.data(), eps, y.data());
    return dot(y, r);
  };
  L();
  for (i64 nn = 0; nn < N; ++nn)
    for (i64 c = 0; c < C; ++c)
      for (i64 i = 0; i < HW; ++i) {
        const i64 idx = (nn * C + c) * HW + i;
        EXPECT_NEAR(y[idx], (x[idx] - rm[c]) / std::sqrt(rv[c] + eps) * gamma[c] + beta[c],
                    1e-14);
      }
  Vec dx(n, kNaN), dg(C, kNaN), db(C, kNaN);
  k::batch_norm_backward_eval<double>(N, C, HW, r.data(), x.data(), gamma.data(), rm.data(),
                                      rv.data(), eps, dx.data(), 0.0, dg.data(), db.data(), 0.0);
  expect_close(dx, fd_grad(x, L), kFdTol, "bn eval dx");
  expect_close(dg, fd_grad(gamma, L), kFdTol, "bn eval dgamma");
  expect_close(db, fd_grad(beta, L), kFdTol, "bn eval dbeta");
  check_beta(n, 306, [&](double* out, double bt) {
    k::batch_norm_backward_eval<double>(N, C, HW, r.data(), x.data(), gamma.data(), rm.data(),
                                        rv.data(), eps, out, bt, nullptr, nullptr, 0.0);
  }, "bn eval dx");
  check_beta(C, 307, [&](double* out, double bt) {
    k::batch_norm_backward_eval<double>(N, C, HW, r.data(), x.data(), gamma.data(), rm.data(),
                                        rv.data(), eps, nullptr, 0.0, out, nullptr, bt);
  }, "bn eval dgamma");
  check_beta(C, 308, [&](double* out, double bt) {
    k::batch_norm_backward_eval<double>(N, C, HW, r.data(), x.data(), gamma.data(), rm.data(),
                                        rv.data(), eps, nullptr, 0.0, nullptr, out, bt);
  }, "bn eval dbeta");
  // Without gamma: dx = dy * invstd.
  Vec dx1(n, kNaN);
  k::batch_norm_backward_eval<double>(N, C, HW, r.data(), x.data(), nullptr, rm.data(), rv.data(),
                                      eps, dx1.data(), 0.0, nullptr, nullptr, 0.0);
  for (i64 nn = 0; nn < N; ++nn)
    for (i64 c = 0; c < C; ++c)
      for (i64 i = 0; i < HW; ++i) {
        const i64 idx = (nn * C + c) * HW + i;
        EXPECT_NEAR(dx1[idx], r[idx] / std::sqrt(rv[c] + eps), 1e-14);
      }
}

TEST(BatchNorm, RunningStatsAndNormalisedOutput) {
  const i64 N = 4, C = 3, HW = 5, n = N * C * HW, M = N * HW;
  const double eps = 1e-5, mom = 0.1;
  // Channels with different offsets and scales.
  Vec x = random_vec(n, 400);
  for (i64 nn = 0; nn < N; ++nn)
    for (i64 c = 0; c < C; ++c)
      for (i64 i = 0; i < HW; ++i) x[(nn * C + c) * HW + i] = 3.0 * c - 2.0 + (c + 1) * x[(nn * C + c) * HW + i];
  const Vec rm0 = random_vec(C, 401), rv0 = random_vec(C, 402, 0.5, 1.5);
  Vec rm = rm0, rv = rv0, y(n, kNaN), sm(C, kNaN), si(C, kNaN);
  k::batch_norm_forward_train<double>(N, C, HW, x.data(), nullptr, nullptr, eps, mom, rm.data(),
                                      rv.data(), y.data(), sm.data(), si.data());
  expect_no_nan(y, "bn y");
  for (i64 c = 0; c < C; ++c) {
    double s = 0.0;
    for (i64 nn = 0; nn < N; ++nn)
      for (i64 i = 0; i < HW; ++i) s += x[(nn * C + c) * HW + i];
    const double mean = s / M;
    double ss = 0.0;
    for (i64 nn = 0; nn < N; ++nn)
      for (i64 i = 0; i < HW; ++i) ss += std::pow(x[(nn * C + c) * HW + i] - mean, 2);
    const double var_b = ss / M, var_u = ss / (M - 1);
    EXPECT_NEAR(sm[c], mean, 1e-13);
    EXPECT_NEAR(si[c], 1.0 / std::sqrt(var_b + eps), 1e-12);
    EXPECT_NEAR(rm[c], 0.9 * rm0[c] + 0.1 * mean, 1e-13);
    EXPECT_NEAR(rv[c], 0.9 * rv0[c] + 0.1 * var_u, 1e-13);
    // Output statistics per channel: mean 0, biased variance var / (var + eps) ~ 1.
    double ys = 0.0, yss = 0.0;
    for (i64 nn = 0; nn < N; ++nn)
      for (i64 i = 0; i < HW; ++i) ys += y[(nn * C + c) * HW + i];
    const double ym = ys / M;
    for (i64 nn = 0; nn < N; ++nn)
      for (i64 i = 0; i < HW; ++i) yss += std::pow(y[(nn * C + c) * HW + i] - ym, 2);
    EXPECT_NEAR(ym, 0.0, 1e-13);
    EXPECT_NEAR(yss / M, var_b / (var_b + eps), 1e-12);
    EXPECT_NEAR(yss / M, 1.0, 1e-4);
  }
  // gamma = 1, beta = 0 explicitly gives the same output as affine = false.
  Vec ones(C, 1.0), zeros(C, 0.0), y2(n, kNaN);
  k::batch_norm_forward_train<double>(N, C, HW, x.data(), ones.data(), zeros.data(), eps, mom,
                                      nullptr, nullptr, y2.data(), nullptr, nullptr);
  EXPECT_EQ(y2, y);
}

TEST(BatchNorm, FloatMatchesDouble) {
  const i64 N = 8, C = 16, HW = 300, n = N * C * HW;  // large enough for the parallel path
  const Vec xd = random_vec(n, 500), gd = random_vec(C, 501), bd = random_vec(C, 502),
            rd = random_vec(n, 503);
  std::vector<float> xf(n), gf(C), bf(C), rf(n);
  k::convert<double, float>(n, xd.data(), xf.data());
  k::convert<double, float>(C, gd.data(), gf.data());
  k::convert<double, float>(C, bd.data(), bf.data());
  k::convert<double, float>(n, rd.data(), rf.data());
  Vec yd(n), md(C), id(C), dxd(n), dgd(C), dbd(C);
  std::vector<float> yf(n), mf(C), iff(C), dxf(n), dgf(C), dbf(C);
  k::batch_norm_forward_train<double>(N, C, HW, xd.data(), gd.data(), bd.data(), 1e-5, 0.1,
                                      nullptr, nullptr, yd.data(), md.data(), id.data());
  k::batch_norm_forward_train<float>(N, C, HW, xf.data(), gf.data(), bf.data(), 1e-5f, 0.1f,
                                     nullptr, nullptr, yf.data(), mf.data(), iff.data());
  k::batch_norm_backward<double>(N, C, HW, rd.data(), xd.data(), gd.data(), md.data(), id.data(),
                                 dxd.data(), 0.0, dgd.data(), dbd.data(), 0.0);
  k::batch_norm_backward<float>(N, C, HW, rf.data(), xf.data(), gf.data(), mf.data(), iff.data(),
                                dxf.data(), 0.0f, dgf.data(), dbf.data(), 0.0f);
  for (i64 i = 0; i < n; ++i) {
    ASSERT_NEAR(yf[i], yd[i], 1e-5);
    ASSERT_NEAR(dxf[i], dxd[i], 1e-5);
  }
  for (i64 c = 0; c < C; ++c) {
    EXPECT_NEAR(dgf[c], dgd[c], 1e-3);
    EXPECT_NEAR(dbf[c], dbd[c], 1e-3);
  }
}

// =============================================================================================
// Group norm.

namespace {

void run_gn_fd(i64 N, i64 C, i64 HW, i64 G, bool affine, unsigned seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C) + " HW=" +
               std::to_string(HW) + " G=" + std::to_string(G) + (affine ? " affine" : ""));
  const i64 n = N * C * HW;
  const double eps = 1e-5;
  Vec x = random_vec(n, seed);
  Vec gamma = random_vec(C, seed + 1, 0.5, 1.5), beta = random_vec(C, seed + 2);
  if (!affine) {
    std::fill(gamma.begin(), gamma.end(), 1.0);
    std::fill(beta.begin(), beta.end(), 0.0);
  }
  const Vec r = random_vec(n, seed + 3);
  Vec y(n), mean(N * G), invstd(N * G);
  bool use_params = affine;
  auto L = [&] {
    k::group_norm_forward<double>(N, C, HW, G, x.data(), use_params ? gamma.data() : nullptr,
                                  use_params ? beta.data() : nullptr, eps, y.data(), mean.data(),
                                  invstd.data());
    return dot(y, r);
  };
  L();
  expect_no_nan(y, "gn y");
  const double* gp = affine ? gamma.data() : nullptr;
  Vec dx(n, kNaN), dg(C, kNaN), db(C, kNaN);
  k::group_norm_backward<double>(N, C, HW, G, r.data(), x.data(), gp, mean.data(), invstd.data(),
                                 dx.data(), 0.0, dg.data(), db.data(), 0.0);
  expect_close(dx, fd_grad(x, L), kFdTol, "gn dx");
  use_params = true;  // dgamma / dbeta are the gradients at the (possibly default) parameters
  expect_close(dg, fd_grad(gamma, L), kFdTol, "gn dgamma");
  expect_close(db, fd_grad(beta, L), kFdTol, "gn dbeta");
  use_params = affine;
  L();
  check_beta(n, seed + 4, [&](double* out, double bt) {
    k::group_norm_backward<double>(N, C, HW, G, r.data(), x.data(), gp, mean.data(),
                                   invstd.data(), out, bt, nullptr, nullptr, 0.0);
  }, "gn dx");
  check_beta(C, seed + 5, [&](double* out, double bt) {
    k::group_norm_backward<double>(N, C, HW, G, r.data(), x.data(), gp, mean.data(),
                                   invstd.data(), nullptr, 0.0, out, nullptr, bt);
  }, "gn dgamma");
  check_beta(C, seed + 6, [&](double* out, double bt) {
    k::group_norm_backward<double>(N, C, HW, G, r.data(), x.data(), gp, mean.data(),
                                   invstd.data(), nullptr, 0.0, nullptr, out, bt);
  }, "gn dbeta");
}

}  // namespace

TEST(GroupNorm, BackwardMatchesFiniteDifferences) {
  run_gn_fd(2, 6, 4, 1, true, 600);   // G = 1 (LayerNorm-like over C, HW)
  run_gn_fd(2, 6, 4, 2, true, 610);
  run_gn_fd(2, 6, 4, 3, false, 620);
  run_gn_fd(2, 6, 4, 6, true, 630);   // G = C (InstanceNorm-like)
  run_gn_fd(3, 4, 1, 2, true, 640);   // HW = 1
  run_gn_fd(1, 8, 9, 4, false, 650);
}

TEST(GroupNorm, NormalisedOutputStatistics) {
  const i64 N = 3, C = 8, HW = 10, G = 4, Cg = C / G, M = Cg * HW;
  const double eps = 1e-5;
  Vec x = random_vec(N * C * HW, 700);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 5.0 + 2.0 * x[i];
  Vec y(x.size(), kNaN), mean(N * G, kNaN), invstd(N * G, kNaN);
  k::group_norm_forward<double>(N, C, HW, G, x.data(), nullptr, nullptr, eps, y.data(),
                                mean.data(), invstd.data());
  expect_no_nan(y, "gn y");
  for (i64 ng = 0; ng < N * G; ++ng) {
    double xs = 0.0, ys = 0.0;
    for (i64 i = 0; i < M; ++i) {
      xs += x[ng * M + i];
      ys += y[ng * M + i];
    }
    const double xm = xs / M, ym = ys / M;
    double xss = 0.0, yss = 0.0;
    for (i64 i = 0; i < M; ++i) {
      xss += std::pow(x[ng * M + i] - xm, 2);
      yss += std::pow(y[ng * M + i] - ym, 2);
    }
    const double var = xss / M;
    EXPECT_NEAR(mean[ng], xm, 1e-13);
    EXPECT_NEAR(invstd[ng], 1.0 / std::sqrt(var + eps), 1e-12);
    EXPECT_NEAR(ym, 0.0, 1e-13);
    EXPECT_NEAR(yss / M, var / (var + eps), 1e-12);
    EXPECT_NEAR(yss / M, 1.0, 1e-4);
  }
  // With parameters: y = yhat * gamma[c] + beta[c].
  const Vec gamma = random_vec(C, 701), beta = random_vec(C, 702);
  Vec y2(x.size(), kNaN);
  k::group_norm_forward<double>(N, C, HW, G, x.data(), gamma.data(), beta.data(), eps, y2.data(),
                                nullptr, nullptr);
  for (i64 nn = 0; nn < N; ++nn)
    for (i64 c = 0; c < C; ++c)
      for (i64 i = 0; i < HW; ++i) {
        const i64 idx = (nn * C + c) * HW + i;
        EXPECT_NEAR(y2[idx], y[idx] * gamma[c] + beta[c], 1e-13);
      }
}

// =============================================================================================
// Cross-entropy.

namespace {

struct CeCase {
  std::string name;
  bool weights;
  i64 ignore_index;
  double smoothing;
  std::vector<i64> targets;
};

void run_ce_fd(const CeCase& cs, i64 C, unsigned seed) {
  SCOPED_TRACE(cs.name);
  const i64 N = static_cast<i64>(cs.targets.size());
  Vec z = random_vec(N * C, seed, -3.0, 3.0);
  const Vec w = random_vec(C, seed + 1, 0.2, 2.0);
  const double* wp = cs.weights ? w.data() : nullptr;
  const Vec r = random_vec(N, seed + 2);
  Vec loss(N, kNaN), sw(N, kNaN);
  auto L = [&] {
    const i64 bad = k::cross_entropy_forward<double>(N, C, z.data(), cs.targets.data(), wp,
                                                     cs.ignore_index, cs.smoothing, loss.data(),
                                                     sw.data());
    EXPECT_EQ(bad, -1);
    return dot(loss, r);
  };
  L();
  expect_no_nan(loss, "ce loss");
  expect_no_nan(sw, "ce weight");
  // Per-sample loss and weight against a direct evaluation of the formula.
  for (i64 i = 0; i < N; ++i) {
    const i64 t = cs.targets[i];
    if (t == cs.ignore_index) {
      EXPECT_EQ(loss[i], 0.0);
      EXPECT_EQ(sw[i], 0.0);
      continue;
    }
    double s = 0.0;
    for (i64 c = 0; c < C; ++c) s += std::exp(z[i * C + c]);
    auto nlp = [&](i64 c) { return std::log(s) - z[i * C + c]; };
    double smooth = 0.0;
    for (i64 c = 0; c < C; ++c) smooth += (wp ? w[c] : 1.0) * nlp(c);
    const double wt = wp ? w[t] : 1.0;
    const double expect = (1 - cs.smoothing) * wt * nlp(t) + cs.smoothing / C * smooth;
    EXPECT_NEAR(loss[i], expect, 1e-12);
    EXPECT_EQ(sw[i], wt);
  }
  Vec dz(N * C, kNaN);
  k::cross_entropy_backward<double>(N, C, z.data(), cs.targets.data(), wp, cs.ignore_index,
                                    cs.smoothing, r.data(), dz.data(), 0.0);
  expect_close(dz, fd_grad(z, L), kFdTol, "ce dlogits");
  check_beta(N * C, seed + 3, [&](double* out, double bt) {
    k::cross_entropy_backward<double>(N, C, z.data(), cs.targets.data(), wp, cs.ignore_index,
                                      cs.smoothing, r.data(), out, bt);
  }, "ce dlogits");
}

}  // namespace

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const i64 C = 5;
  const std::vector<i64> t = {0, 3, 4, 1, 2, 2, 0};
  run_ce_fd({"plain", false, -100, 0.0, t}, C, 800);
  run_ce_fd({"class weights", true, -100, 0.0, t}, C, 810);
  run_ce_fd({"ignore_index -100", false, -100, 0.0, {0, -100, 4, 1, -100, 2, 3}}, C, 820);
  run_ce_fd({"ignore_index in range", false, 2, 0.0, t}, C, 830);
  run_ce_fd({"label smoothing", false, -100, 0.1, t}, C, 840);
  run_ce_fd({"weights + ignore + smoothing", true, 2, 0.1, t}, C, 850);
  run_ce_fd({"weights + ignore -100 + smoothing 0.3", true, -100, 0.3,
             {1, -100, 4, -100, 0, 3, 3}}, C, 860);
  run_ce_fd({"all ignored", true, -100, 0.1, {-100, -100}}, C, 870);
  run_ce_fd({"binary", true, -100, 0.2, {0, 1, 1}}, 2, 880);
}

TEST(CrossEntropy, ForwardSmallCaseAndInvalidTargets) {
  // logits (2, 3), targets {2, 0}.
  const Vec z = {1.0, 2.0, 3.0, 0.5, -0.5, 0.0};
  const std::vector<i64> t = {2, 0};
  Vec loss(2, kNaN), sw(2, kNaN);
  EXPECT_EQ(k::cross_entropy_forward<double>(2, 3, z.data(), t.data(), nullptr, -100, 0.0,
                                             loss.data(), sw.data()),
            -1);
  const double l0 = -std::log(std::exp(3.0) / (std::exp(1.0) + std::exp(2.0) + std::exp(3.0)));
  const double l1 = -std::log(std::exp(0.5) / (std::exp(0.5) + std::exp(-0.5) + std::exp(0.0)));
  EXPECT_NEAR(loss[0], l0, 1e-14);
  EXPECT_NEAR(loss[1], l1, 1e-14);
  EXPECT_EQ(sw[0], 1.0);
  EXPECT_EQ(sw[1], 1.0);
  // Mean reduction with weights = sum loss / sum weight, as PyTorch (checked on the parts).
  const Vec w = {0.5, 1.0, 2.0};
  EXPECT_EQ(k::cross_entropy_forward<double>(2, 3, z.data(), t.data(), w.data(), -100, 0.0,
                                             loss.data(), sw.data()),
            -1);
  EXPECT_NEAR(loss[0], 2.0 * l0, 1e-14);
  EXPECT_NEAR(loss[1], 0.5 * l1, 1e-14);
  EXPECT_EQ(sw[0], 2.0);
  EXPECT_EQ(sw[1], 0.5);

  // Huge logits stay finite (max subtracted).
  const Vec big = {1000.0, 999.0, -1000.0};
  const std::vector<i64> t1 = {1};
  EXPECT_EQ(k::cross_entropy_forward<double>(1, 3, big.data(), t1.data(), nullptr, -100, 0.1,
                                             loss.data(), sw.data()),
            -1);
  const double lse = 1000.0 + std::log(1.0 + std::exp(-1.0) + std::exp(-2000.0));
  EXPECT_NEAR(loss[0], 0.9 * (lse - 999.0) + 0.1 / 3 * (3 * lse - 999.0), 1e-10);
  Vec dbig(3, kNaN);
  const Vec one = {1.0};
  k::cross_entropy_backward<double>(1, 3, big.data(), t1.data(), nullptr, -100, 0.1, one.data(),
                                    dbig.data(), 0.0);
  expect_no_nan(dbig, "ce big dlogits");

  // Invalid targets: the first index outside [0, C) that is not ignore_index.
  const Vec z4 = random_vec(4 * 3, 900);
  Vec l4(4, kNaN), w4(4, kNaN);
  const std::vector<i64> bad1 = {0, -100, 3, -1};
  EXPECT_EQ(k::cross_entropy_forward<double>(4, 3, z4.data(), bad1.data(), nullptr, -100, 0.0,
                                             l4.data(), w4.data()),
            2);
  expect_no_nan(l4, "ce loss with invalid target");
  const std::vector<i64> bad2 = {0, 1, 2, -1};
  EXPECT_EQ(k::cross_entropy_forward<double>(4, 3, z4.data(), bad2.data(), nullptr, -100, 0.0,
                                             l4.data(), w4.data()),
            3);
  const std::vector<i64> ok = {0, 1, 2, -1};  // -1 is ignore_index here
  EXPECT_EQ(k::cross_entropy_forward<double>(4, 3, z4.data(), ok.data(), nullptr, -1, 0.0,
                                             l4.data(), w4.data()),
            -1);
  EXPECT_EQ(l4[3], 0.0);
  EXPECT_EQ(w4[3], 0.0);
}

TEST(CrossEntropy, FloatMatchesDouble) {
  const i64 N = 300, C = 100;  // parallel path
  const Vec zd = random_vec(N * C, 950, -4.0, 4.0), wd = random_vec(C, 951, 0.1, 1.0),
            sd = random_vec(N, 952);
  std::vector<i64> t(N);
  std::mt19937 gen(953);
  for (auto& v : t) v = static_cast<i64>(gen() % (C + 1)) - 1;  // -1 ignored
  std::vector<float> zf(N * C), wf(C), sf(N);
  k::convert<double, float>(N * C, zd.data(), zf.data());
  k::convert<double, float>(C, wd.data(), wf.data());
  k::convert<double, float>(N, sd.data(), sf.data());
  Vec ld(N), swd(N), gd(N * C);
  std::vector<float> lf(N), swf(N), gf(N * C);
  EXPECT_EQ(k::cross_entropy_forward<double>(N, C, zd.data(), t.data(), wd.data(), -1, 0.1,
                                             ld.data(), swd.data()),
            -1);
  EXPECT_EQ(k::cross_entropy_forward<float>(N, C, zf.data(), t.data(), wf.data(), -1, 0.1f,
                                            lf.data(), swf.data()),
            -1);
  k::cross_entropy_backward<double>(N, C, zd.data(), t.data(), wd.data(), -1, 0.1, sd.data(),
                                    gd.data(), 0.0);
  k::cross_entropy_backward<float>(N, C, zf.data(), t.data(), wf.data(), -1, 0.1f, sf.data(),
                                   gf.data(), 0.0f);
  for (i64 i = 0; i < N; ++i) ASSERT_NEAR(lf[i], ld[i], 1e-5 * (1 + std::abs(ld[i])));
  for (i64 i = 0; i < N * C; ++i) ASSERT_NEAR(gf[i], gd[i], 1e-6);
}

// =============================================================================================
// Optimizers.

TEST(Optim, SgdMatchesTorchRuleOverThreeSteps) {
  struct Cfg {
    double lr, momentum, dampening, wd;
    bool nesterov;
  };
  const Cfg cfgs[] = {{0.1, 0.0, 0.0, 0.0, false},  {0.1, 0.9, 0.0, 0.0, false},
                      {0.05, 0.9, 0.1, 1e-2, false}, {0.05, 0.9, 0.0, 1e-2, true},
                      {0.2, 0.5, 0.3, 5e-4, true},   {0.1, 0.0, 0.0, 1e-1, false}};
  const std::size_t n = 37;
  int ci = 0;
  for (const Cfg& c : cfgs) {
    SCOPED_TRACE("config " + std::to_string(ci++));
    Vec p = random_vec(n, 1000), buf(n, kNaN);  // buf garbage before the first step
    Vec rp = p, rbuf(n, 0.0);
    for (int step = 0; step < 3; ++step) {
      const Vec g = random_vec(n, 1001 + step);
      k::sgd_update<double>(n, p.data(), g.data(), c.momentum != 0 ? buf.data() : nullptr, c.lr,
                            c.momentum, c.dampening, c.wd, c.nesterov, step == 0);
      // torch.optim.SGD._single_tensor_sgd, one scalar at a time.
      for (std::size_t i = 0; i < n; ++i) {
        double d_p = g[i];
        if (c.wd != 0) d_p = d_p + c.wd * rp[i];
        if (c.momentum != 0) {
          if (step == 0) {
            rbuf[i] = d_p;
          } else {
            rbuf[i] = rbuf[i] * c.momentum + (1 - c.dampening) * d_p;
          }
          d_p = c.nesterov ? d_p + c.momentum * rbuf[i] : rbuf[i];
        }
        rp[i] = rp[i] - c.lr * d_p;
      }
      expect_close(p, rp, 1e-14, "sgd param");
      if (c.momentum != 0) expect_close(buf, rbuf, 1e-14, "sgd momentum buffer");
    }
  }
}

TEST(Optim, AdamWMatchesTorchRuleOverThreeSteps) {
  struct Cfg {
    double lr, b1, b2, eps, wd;
  };
  const Cfg cfgs[] = {{1e-3, 0.9, 0.999, 1e-8, 1e-2}, {1e-1, 0.8, 0.99, 1e-6, 0.0},
                      {3e-2, 0.5, 0.9, 1e-3, 0.1}};
  const std::size_t n = 41;
  int ci = 0;
  for (const Cfg& c : cfgs) {
    SCOPED_TRACE("config " + std::to_string(ci++));
    Vec p = random_vec(n, 1100), m(n, 0.0), v(n, 0.0);
    Vec rp = p, rm(n, 0.0), rv(n, 0.0);
    for (i64 step = 1; step <= 3; ++step) {
      const Vec g = random_vec(n, 1100 + static_cast<unsigned>(step));
      k::adamw_update<double>(n, p.data(), g.data(), m.data(), v.data(), c.lr, c.b1, c.b2, c.eps,
                              c.wd, step);
      // Algorithm of torch.optim.AdamW (amsgrad = false), one scalar at a time.
      for (std::size_t i = 0; i < n; ++i) {
        rp[i] *= 1 - c.lr * c.wd;
        rm[i] = c.b1 * rm[i] + (1 - c.b1) * g[i];
        rv[i] = c.b2 * rv[i] + (1 - c.b2) * g[i] * g[i];
        const double mhat = rm[i] / (1 - std::pow(c.b1, static_cast<double>(step)));
        const double vhat = rv[i] / (1 - std::pow(c.b2, static_cast<double>(step)));
        rp[i] -= c.lr * mhat / (std::sqrt(vhat) + c.eps);
      }
      expect_close(p, rp, 1e-13, "adamw param");
      expect_close(m, rm, 1e-13, "adamw m");
      expect_close(v, rv, 1e-13, "adamw v");
    }
  }
  // float instantiation follows the double one.
  std::vector<float> pf(n), gf(n), mf(n, 0.0f), vf(n, 0.0f);
  const Vec p0 = random_vec(n, 1200), g0 = random_vec(n, 1201);
  Vec pd = p0, md(n, 0.0), vd(n, 0.0);
  k::convert<double, float>(n, p0.data(), pf.data());
  k::convert<double, float>(n, g0.data(), gf.data());
  k::adamw_update<float>(n, pf.data(), gf.data(), mf.data(), vf.data(), 1e-2f, 0.9f, 0.999f, 1e-8f,
                         1e-2f, 1);
  k::adamw_update<double>(n, pd.data(), g0.data(), md.data(), vd.data(), 1e-2, 0.9, 0.999, 1e-8,
                          1e-2, 1);
  for (std::size_t i = 0; i < n; ++i) EXPECT_NEAR(pf[i], pd[i], 1e-6);
}
