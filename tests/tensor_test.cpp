// Tensor, view and device semantics, and the errors bad inputs produce.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>

#include "core/dry_run.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "tests/dropout_check.h"
#include "tests/pending_check.h"
#include "tests/staging_check.h"

using namespace tally;

TEST(Tensor, FromVectorRoundTripAndProperties) {
  const std::vector<float> v{1, 2, 3, 4, 5, 6};
  Tensor t = Tensor::from_vector(v, {2, 3});
  EXPECT_EQ(t.shape(), (Shape{2, 3}));
  EXPECT_EQ(t.strides(), (Shape{3, 1}));
  EXPECT_EQ(t.numel(), 6);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.to_vector<float>(), v);
  EXPECT_EQ(t.str(), "float32[2, 3] on cpu");
  EXPECT_EQ(t.category(), Category::input);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::from_vector(std::vector<double>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4});
  Tensor tt = t.transpose(0, 1);
  EXPECT_EQ(tt.shape(), (Shape{4, 3}));
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.contiguous().to_vector<double>(), (std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  Tensor row = t.narrow(0, 1, 2);
  EXPECT_EQ(row.to_vector<double>(), (std::vector<double>{4, 5, 6, 7, 8, 9, 10, 11}));
  Tensor col = t.narrow(1, 2, 1);
  EXPECT_EQ(col.to_vector<double>(), (std::vector<double>{2, 6, 10}));
  Tensor v = t.view({2, -1});
  EXPECT_EQ(v.shape(), (Shape{2, 6}));
  v.fill_(3.5);  // writes through to t
  EXPECT_EQ(t.to_vector<double>(), std::vector<double>(12, 3.5));
  EXPECT_THROW(tt.view({12}), ShapeError);    // not contiguous
  EXPECT_EQ(tt.reshape({12}).numel(), 12);     // reshape copies instead
  EXPECT_THROW(t.view({5, -1}), ShapeError);
  EXPECT_THROW(t.narrow(0, 2, 2), ShapeError);
}

TEST(Tensor, DtypeConversionAndItem) {
  Tensor f = Tensor::from_vector(std::vector<float>{1.5f, -2.25f}, {2});
  Tensor d = f.to(DType::Float64);
  EXPECT_EQ(d.to_vector<double>(), (std::vector<double>{1.5, -2.25}));
  EXPECT_THROW(f.to_vector<double>(), ShapeError);
  EXPECT_THROW(f.item(), ShapeError);
  EXPECT_DOUBLE_EQ(f.narrow(0, 1, 1).item(), -2.25);
}

TEST(Tensor, MismatchErrorsNameTheOpAndBothOperands) {
  Tensor a = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2});
  Tensor c = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3});
  try {
    add(a, b);
    FAIL();
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("add"), std::string::npos) << m;
    EXPECT_NE(m.find("float32[2, 3]"), std::string::npos) << m;
    EXPECT_NE(m.find("float32[3, 2]"), std::string::npos) << m;
  }
  try {
    mul(a, c);
    FAIL();
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("mul"), std::string::npos) << m;
    EXPECT_NE(m.find("float64[2, 3]"), std::string::npos) << m;
  }
  EXPECT_THROW(Tensor::from_vector(std::vector<float>{1, 2, 3}, {2, 2}), ShapeError);
  EXPECT_THROW(Tensor::empty({-1, 2}), ShapeError);
  EXPECT_THROW(Tensor().shape(), Error);
  EXPECT_THROW(parse_device("tpu"), Error);
  EXPECT_EQ(parse_device("cuda:1"), Device::cuda(1));
}

// scale_channels and concat name what they expected and what they found.
TEST(Tensor, ScaleChannelsAndConcatErrorsNameExpectedAndFound) {
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const ShapeError& e) {
      return e.what();
    }
    return "(no error)";
  };
  const Tensor x = Tensor::zeros({2, 3, 4, 5}), y = Tensor::zeros({2, 2, 4, 6});
  std::string m = message([&] { scale_channels(x, Tensor::zeros({2, 4, 1, 1})); });
  EXPECT_NE(m.find("scale_channels: expected s of shape [2, 3, 1, 1] or [2, 3] for x float32[2, 3, 4, 5] on cpu, "
                   "found float32[2, 4, 1, 1]"),
            std::string::npos)
      << m;
  m = message([&] { scale_channels(x, Tensor::zeros({2, 3, 1, 1}, DType::Float64)); });
  EXPECT_NE(m.find("different dtypes"), std::string::npos) << m;
  m = message([&] { concat({x, y}); });
  EXPECT_NE(m.find("concat: input 1 has shape [2, 2, 4, 6], expected [2, *, 4, 5]"), std::string::npos) << m;
  m = message([&] { concat({x, Tensor::zeros({2, 3, 4})}); });
  EXPECT_NE(m.find("input 1 has shape [2, 3, 4], expected [2, *, 4, 5]"), std::string::npos) << m;
  m = message([&] { concat({x, x}, 2); });
  EXPECT_NE(m.find("concat: joins along dim 1 (the channels) only, found dim 2"), std::string::npos) << m;
  m = message([&] { concat({}); });
  EXPECT_NE(m.find("concat: no tensors"), std::string::npos) << m;
  m = message([&] { concat({x, Tensor::zeros({2, 3, 4, 5}, DType::Float64)}); });
  EXPECT_NE(m.find("different dtypes"), std::string::npos) << m;
}

TEST(Tensor, DryRunAllocatesButHasNoData) {
  const DryRun dry(Device::cpu(), 1 << 20);
  const auto& v = dry.arena_ptr();
  Tensor t = Tensor::empty({4, 4});
  EXPECT_EQ(t.raw_data(), nullptr);
  EXPECT_EQ(v->stats().total.current, 256);
  EXPECT_THROW(t.to_vector<float>(), Error);
}

TEST(Tensor, CudaDeviceAbsentWithoutGpu) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is present; this checks the CPU-only behaviour";
  EXPECT_EQ(cuda_device_count(), 0);
  EXPECT_FALSE(build_info().empty());
}

// ---- dispatch (core/dispatch.h) ------------------------------------------------------------------

// The memory ops reach one kernel per storable dtype: fill, dense copy and the strided gather
// of a transposed view, each checked element by element against the host's own arithmetic.
TEST(Dispatch, EveryStorableDtypeFillsCopiesAndGathers) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> d(-1000, 1000);
  const double value = d(rng);
  auto check = [&](DType dt, auto zero) {
    using V = decltype(zero);
    SCOPED_TRACE(dtype_name(dt));
    Tensor t = Tensor::full({3, 5}, value, dt);
    EXPECT_EQ(t.to_vector<V>(), std::vector<V>(15, static_cast<V>(value)));
    std::vector<V> src(15);
    for (auto& x : src) x = static_cast<V>(d(rng));
    Tensor s = Tensor::empty({3, 5}, dt);
    std::memcpy(s.raw_data(), src.data(), sizeof(V) * src.size());
    t.copy_(s);
    EXPECT_EQ(t.to_vector<V>(), src);
    const std::vector<V> got = s.transpose(0, 1).contiguous().to_vector<V>();
    for (int i = 0; i < 5; ++i)
      for (int j = 0; j < 3; ++j) EXPECT_EQ(got[i * 3 + j], src[j * 5 + i]) << i << "," << j;
  };
  check(DType::Float32, 0.f);
  check(DType::Float64, 0.0);
  check(DType::Int32, std::int32_t{0});
  check(DType::Int64, std::int64_t{0});
}

// A dry run runs no kernel but checks what a real run checks: a dtype with no kernel is the same
// error in both, naming the op, the tensor and the dtypes the backend takes.
TEST(Dispatch, ADryRunChecksTheDtypeButRunsNoKernel) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> v(12);
  for (auto& x : v) x = n(rng);
  Tensor x = Tensor::from_vector(v, {3, 4});
  Tensor y = Tensor::full({3, 4}, 5.0);
  {
    const DryRun dry;  // the switch alone, on the real arena
    x.fill_(7.0);
    y.copy_(x);
    y.copy_(x.transpose(0, 1).contiguous().view({3, 4}));
  }
  EXPECT_EQ(x.to_vector<float>(), v);
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>(12, 5.f));
  Tensor b = Tensor::empty({2}, DType::Float16);  // a dtype with a name and no kernels
  for (bool dry_run : {false, true}) {
    SCOPED_TRACE(dry_run ? "dry run" : "real run");
    std::optional<DryRun> guard;
    if (dry_run) guard.emplace();
    try {
      b.fill_(1.0);
      ADD_FAILURE() << "fill_ of a float16 tensor did not throw";
    } catch (const ShapeError& e) {
      EXPECT_STREQ(e.what(), "fill_: no kernel for float16[2] on cpu (on the cpu it takes float32 or float64 or "
                             "bfloat16 or int32 or int64)");
    }
  }
}

// ---- bfloat16 storage ------------------------------------------------------------------------------

namespace {
// The nearest bfloat16 by arithmetic, not by bits: the two candidates around |f| (its float bits
// truncated to 16, and the next one up), the closer wins, a tie goes to the even one.
std::uint16_t nearest_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16), hi = static_cast<std::uint16_t>(lo + 1);
  const auto value = [](std::uint16_t b) {
    const std::uint32_t w = static_cast<std::uint32_t>(b) << 16;
    float v;
    std::memcpy(&v, &w, 4);
    return static_cast<double>(v);
  };
  const double d_lo = std::fabs(static_cast<double>(f) - value(lo)), d_hi = std::fabs(value(hi) - static_cast<double>(f));
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return hi;
  return (lo & 1) ? hi : lo;
}
}  // namespace

// float -> bfloat16 rounds to nearest, ties to even (checked against arithmetic on fresh random
// floats of every magnitude and on the edge cases); NaN stays NaN with its sign, Inf stays Inf,
// values past the largest bf16 become Inf; bfloat16 -> float is exact.
TEST(BFloat16, RoundsToNearestEvenAndKeepsNanAndInf) {
  using kernels::bf16;
  EXPECT_EQ(bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16(1.00390625f).bits, 0x3f80);  // halfway between 1 and 1 + 2^-7: to the even 1
  EXPECT_EQ(bf16(1.01171875f).bits, 0x3f82);  // halfway between 1 + 2^-7 and 1 + 2^-6: to the even one
  EXPECT_EQ(bf16(-2.5f).bits, 0xc020);
  EXPECT_EQ(bf16(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_EQ(bf16(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  EXPECT_EQ(bf16(std::numeric_limits<float>::max()).bits, 0x7f80);  // rounds past the largest bf16
  const bf16 nan(std::numeric_limits<float>::quiet_NaN()), neg_nan(-std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(static_cast<float>(nan)));
  EXPECT_TRUE(std::isnan(static_cast<float>(neg_nan)));
  EXPECT_TRUE(std::signbit(static_cast<float>(neg_nan)));
  std::uint32_t snan_bits = 0x7f800001;  // a signalling NaN whose payload is below bf16's bits
  float snan;
  std::memcpy(&snan, &snan_bits, 4);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(snan))));
  EXPECT_EQ(static_cast<float>(bf16::from_bits(0x4049)), 3.140625f);
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<std::uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isfinite(f) || std::fabs(f) > 3.3e38f) continue;
    ASSERT_EQ(bf16(f).bits, nearest_bf16(f)) << std::hexfloat << f;
    ++checked;
  }
  EXPECT_GT(checked, 190000);
}

// A bfloat16 tensor: conversions among float32, float64 and bfloat16 (through float for double,
// as PyTorch), fill, dense copy and strided gather, two bytes an element in the arena — also in a
// dry run — and BF16 in safetensors.
TEST(BFloat16, TensorsConvertFillGatherAndCountTwoBytes) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> n(0.f, 3.f);
  std::vector<float> v(24);
  for (auto& x : v) x = n(rng);
  const Tensor f = Tensor::from_vector(v, {4, 6});
  const Tensor b = f.to(DType::BFloat16);
  ASSERT_EQ(b.dtype(), DType::BFloat16);
  EXPECT_EQ(b.nbytes(), 48u);
  const std::vector<kernels::bf16> got = b.to_vector<kernels::bf16>();
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(got[i].bits, kernels::bf16(v[i]).bits) << i;
  const std::vector<float> back = b.to(DType::Float32).to_vector<float>();
  const std::vector<double> back64 = b.to(DType::Float64).to_vector<double>();
  for (std::size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(back[i], static_cast<float>(got[i]));
    EXPECT_EQ(back64[i], static_cast<double>(static_cast<float>(got[i])));
    EXPECT_LE(std::fabs(back[i] - v[i]), std::ldexp(std::fabs(v[i]), -8)) << i;  // half a bf16 ulp
  }
  std::vector<double> d(v.begin(), v.end());
  const std::vector<kernels::bf16> from64 =
      Tensor::from_vector(d, {4, 6}).to(DType::BFloat16).to_vector<kernels::bf16>();
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(from64[i].bits, got[i].bits);
  const std::vector<kernels::bf16> t = b.transpose(0, 1).contiguous().to_vector<kernels::bf16>();
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_EQ(t[i * 4 + j].bits, got[j * 6 + i].bits);
  Tensor filled = Tensor::full({3}, 2.5, DType::BFloat16);
  EXPECT_THROW(filled.item(), ShapeError);  // item() needs one element
  EXPECT_EQ(filled.narrow(0, 1, 1).item(), 2.5);
  EXPECT_THROW(b.to(DType::Int64), Error);
  {
    const DryRun dry(Device::cpu(), 1 << 20);
    const auto& virt = dry.arena_ptr();
    const Tensor x = Tensor::empty({10, 10});
    const auto before = virt->stats().total.current;
    const Tensor y = x.to(DType::BFloat16);
    EXPECT_EQ(virt->stats().total.current - before, 256);  // 200 bytes, in the arena's 256-byte units
  }
  const safetensors::Entry e = safetensors::make_bf16({4, 6}, [&] {
    std::vector<std::uint16_t> bits;
    for (const auto& x : got) bits.push_back(x.bits);
    return bits;
  }());
  EXPECT_EQ(e.dtype, "BF16");
  EXPECT_EQ(e.data.size(), 48u);
  const std::vector<std::uint16_t> read = safetensors::as_bf16_bits(e);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(read[i], got[i].bits);
  EXPECT_THROW(safetensors::as_f32(e), FormatError);
}

// core/staging.h on the CPU: floats converted on their way into float32, bf16 and float64 inputs,
// labels copied (gpu_test runs the same body through pinned memory and uploads).
TEST(Staging, FloatsArriveConvertedAndLabelsAsTheyWere) {
  tally::test::check_input_staging(Device::cpu(), std::random_device{}());
}

// core/pending.h on the CPU: a value read, then its tensor's block written over, reads as it was;
// and with the CPU's reads held back (TALLY_TEST_DEFER_READS, tally train's deferred path) a read
// is not ready until its get() (gpu_test: the same body on a GPU).
TEST(Pending, AValueReadArrivesAsItWasAndDeferredReadsWaitForGet) {
  tally::test::check_pending_scalar(Device::cpu(), std::random_device{}());
  PendingScalar::defer_cpu_reads_for_tests(true);
  struct Restore {
    ~Restore() { PendingScalar::defer_cpu_reads_for_tests(false); }
  } restore;
  tally::test::check_pending_scalar(Device::cpu(), std::random_device{}());
  PendingScalar p = PendingScalar::read(Tensor::full({1}, 3.25));
  EXPECT_FALSE(p.ready()) << "a deferred CPU read must stay pending until get()";
  EXPECT_EQ(p.get(), 3.25);
  EXPECT_TRUE(p.ready());
}

TEST(Dropout, TheMaskIsTheKeysInEveryFormatSliceAndPass) {
  tally::test::check_dropout(Device::cpu(), std::random_device{}());
}
