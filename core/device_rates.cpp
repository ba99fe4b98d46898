// core/device_rates.cpp — a device's copy and compute rates, measured; see core/device_rates.h.
#include "core/device_rates.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "core/autograd.h"
#include "core/dry_run.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/ops.h"

namespace tally {

namespace {
// The best of `reps` timings of f(), the device synchronized after each.
template <class F>
double best_seconds(Device device, int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    synchronize(device);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
}  // namespace

DeviceRates measure_device_rates(Device device, DType dtype) {
  if (is_dry_run()) throw Error("measure_device_rates: not in a dry run, where nothing runs");
  constexpr std::int64_t kCopyBytes = std::int64_t(32) << 20;
  const Shape xs{4, 64, 56, 56}, ws{64, 64, 3, 3};
  // Room for the convolution's tensors and a library's workspace (a fraction of the arena).
  const std::size_t device_bytes = static_cast<std::size_t>(kCopyBytes) + (std::size_t(192) << 20);
  auto device_arena = std::make_shared<Arena>(device, device_bytes);
  const std::shared_ptr<Arena> host = Arena::make_host(static_cast<std::size_t>(kCopyBytes) + (std::size_t(1) << 20));
  DeviceRates r;
  const ArenaScope on_device(device_arena);
  {
    Tensor d = Tensor::empty({kCopyBytes / 4}, DType::Int32, device, Category::temporary, "device_rates.copy");
    Tensor h;
    {
      const ArenaScope on_host(host);
      h = Tensor::empty({kCopyBytes / 4}, DType::Int32, Device::cpu(), Category::temporary, "device_rates.copy");
    }
    h.fill_(1);
    d.fill_(2);
    const double out = best_seconds(device, 4, [&] { h.copy_(d); });
    const double back = best_seconds(device, 4, [&] { d.copy_(h); });
    r.copy_bytes_per_second = 2.0 * static_cast<double>(kCopyBytes) / (out + back);
  }
  // A block's forward in miniature: the convolution, then its batch norm and ReLU, whose time the
  // rate includes although only the convolution's FLOPs count (as the planner counts them).
  const NoGradGuard off;
  const Tensor x = Tensor::full(xs, 0.5, dtype, device, Category::temporary, "device_rates.conv");
  const Tensor w = Tensor::full(ws, 0.01, param_dtype(dtype), device, Category::temporary, "device_rates.conv");
  const Tensor gamma = Tensor::full({64}, 1.0, param_dtype(dtype), device, Category::temporary, "device_rates.norm");
  const Tensor beta = Tensor::full({64}, 0.0, param_dtype(dtype), device, Category::temporary, "device_rates.norm");
  Conv2dOptions o;
  o.padding = {1, 1};
  BatchNormOptions n;
  n.relu = true;
  const auto forward = [&] { (void)batch_norm(conv2d(x, w, {}, o), gamma, beta, {}, {}, n); };
  forward();  // the first call chooses algorithms and loads kernels
  const double t = best_seconds(device, 6, forward);
  r.flops_per_second = 2.0 * static_cast<double>(shape_numel(xs)) * 64 * 9 / t;
  return r;
}

}  // namespace tally
