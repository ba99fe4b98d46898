// Golden tests against PyTorch: tests/gen_fixtures.py (PyTorch 1.13, float32) wrote each op's
// inputs, upstream gradient `dy`, output and input gradients to tests/fixtures/*.safetensors.
// Each case runs the op through tally's autograd, backpropagates sum(y * dy) and compares with
// relative error ||tally - torch|| / ||torch||: <= 1e-5 for elementwise ops, <= 1e-4 for
// conv/GEMM/norm (and the residual blocks).
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/safetensors.h"
#include "tests/model_common.h"

using namespace tally;

namespace {

struct Fixture {
  std::map<std::string, Tensor> t;
  std::map<std::string, std::string> meta;
  const Tensor& operator[](const std::string& k) const {
    auto it = t.find(k);
    if (it == t.end()) throw Error("fixture has no tensor '" + k + "'");
    return it->second;
  }
  bool has(const std::string& k) const { return t.count(k) > 0; }
  double num(const std::string& k) const { return std::stod(meta.at(k)); }
};

Fixture load(const std::string& name) {
  const auto f = safetensors::read(std::string(TALLY_FIXTURES_DIR) + "/" + name + ".safetensors");
  Fixture fx;
  fx.meta = f.metadata;
  for (const auto& [k, e] : f.tensors) {
    if (e.dtype == "F32") fx.t[k] = Tensor::from_vector(safetensors::as_f32(e), e.shape, Device::cpu(), Category::parameter);
    else if (e.dtype == "I64") fx.t[k] = Tensor::from_vector(safetensors::as_i64(e), e.shape, Device::cpu(), Category::input);
    else throw Error("unexpected fixture dtype " + e.dtype);
  }
  return fx;
}

using test::rel_err;

Tensor grad_input(const Fixture& fx, const std::string& k) {
  Tensor t = fx[k].clone(Category::parameter);
  t.set_requires_grad(true);
  return t;
}

// Runs y = op(inputs), backpropagates sum(y * dy) (or y for scalar outputs), compares y and the
// gradients of `names` with the fixture.
void check(const Fixture& fx, const std::vector<std::string>& names, const std::function<Tensor(std::map<std::string, Tensor>&)>& op,
           double tol) {
  std::map<std::string, Tensor> in;
  for (const auto& n : names) in[n] = grad_input(fx, n);
  Tensor y = op(in);
  EXPECT_LE(rel_err(y, fx["y"]), tol) << "output";
  Tensor loss = fx.has("dy") ? sum(mul(y, fx["dy"])) : y;
  loss.backward();
  for (const auto& n : names) {
    ASSERT_TRUE(in[n].grad().defined()) << "no gradient for " << n;
    EXPECT_LE(rel_err(in[n].grad(), fx["grad." + n]), tol) << "gradient of " << n;
  }
}

std::array<std::int64_t, 2> pair(const Fixture& fx, const std::string& k) {
  const auto v = static_cast<std::int64_t>(fx.num(k));
  return {v, v};
}

}  // namespace

TEST(Golden, Conv2d) {
  for (const char* c : {"conv2d_basic", "conv2d_stride2_pad2_dil2", "conv2d_groups2", "conv2d_depthwise", "conv2d_1x1"}) {
    SCOPED_TRACE(c);
    const Fixture fx = load(c);
    Conv2dOptions o;
    o.stride = pair(fx, "stride");
    o.padding = pair(fx, "padding");
    o.dilation = pair(fx, "dilation");
    o.groups = static_cast<std::int64_t>(fx.num("groups"));
    const bool bias = fx.meta.at("bias") == "true";
    std::vector<std::string> names{"x", "w"};
    if (bias) names.push_back("b");
    check(fx, names, [&](auto& t) { return conv2d(t["x"], t["w"], bias ? t["b"] : Tensor(), o); }, 1e-4);
  }
}

TEST(Golden, LinearAndMatmul) {
  const Fixture l = load("linear");
  check(l, {"x", "w", "b"}, [](auto& t) { return linear(t["x"], t["w"], t["b"]); }, 1e-4);
  const Fixture m = load("matmul");
  check(m, {"a", "b"}, [](auto& t) { return matmul(t["a"], t["b"]); }, 1e-4);
}

TEST(Golden, BatchNormTrainUpdatesRunningStatistics) {
  const Fixture fx = load("batch_norm_train");
  Tensor rm = fx["running_mean_in"].clone(Category::parameter), rv = fx["running_var_in"].clone(Category::parameter);
  BatchNormOptions o;
  o.momentum = fx.num("momentum");
  o.eps = fx.num("eps");
  check(fx, {"x", "weight", "bias"}, [&](auto& t) { return batch_norm(t["x"], t["weight"], t["bias"], rm, rv, o); }, 1e-4);
  EXPECT_LE(rel_err(rm, fx["running_mean_out"]), 1e-5);
  EXPECT_LE(rel_err(rv, fx["running_var_out"]), 1e-5);
}

TEST(Golden, BatchNormEval) {
  const Fixture fx = load("batch_norm_eval");
  BatchNormOptions o;
  o.training = false;
  o.eps = fx.num("eps");
  check(fx, {"x", "weight", "bias"},
        [&](auto& t) { return batch_norm(t["x"], t["weight"], t["bias"], fx["running_mean"], fx["running_var"], o); }, 1e-4);
}

TEST(Golden, GroupNorm) {
  for (const char* c : {"group_norm", "group_norm_g1"}) {
    SCOPED_TRACE(c);
    const Fixture fx = load(c);
    const auto g = static_cast<std::int64_t>(fx.num("num_groups"));
    check(fx, {"x", "weight", "bias"}, [&](auto& t) { return group_norm(t["x"], g, t["weight"], t["bias"], fx.num("eps")); }, 1e-4);
  }
}

TEST(Golden, Elementwise) {
  check(load("relu"), {"x"}, [](auto& t) { return relu(t["x"]); }, 1e-5);
  check(load("add"), {"a", "b"}, [](auto& t) { return add(t["a"], t["b"]); }, 1e-5);
  check(load("mul"), {"a", "b"}, [](auto& t) { return mul(t["a"], t["b"]); }, 1e-5);
  const Fixture s = load("scale");
  check(s, {"x"}, [&](auto& t) { return scale(t["x"], s.num("alpha")); }, 1e-5);
}

// sigmoid (some inputs at +-30 and +-90: no overflow), x * s broadcast over H and W with s
// (N, C, 1, 1) or (N, C), torch.cat along the channels.
TEST(Golden, SigmoidScaleChannelsAndConcat) {
  check(load("sigmoid"), {"x"}, [](auto& t) { return sigmoid(t["x"]); }, 1e-5);
  for (const char* c : {"scale_channels", "scale_channels_2d"}) {
    SCOPED_TRACE(c);
    check(load(c), {"x", "s"}, [](auto& t) { return scale_channels(t["x"], t["s"]); }, 1e-5);
  }
  check(load("concat"), {"x0", "x1", "x2"}, [](auto& t) { return concat({t["x0"], t["x1"], t["x2"]}); }, 1e-5);
}

// dropout: PyTorch's formula (x times a mask of 1 / (1 - p) and 0) on the mask an independent Philox
// in the fixture script draws from the same key — tally's mask, word for word.
TEST(Golden, Dropout) {
  const Fixture fx = load("dropout");
  const SampleIndex at{static_cast<std::uint64_t>(fx.num("step")), static_cast<std::int64_t>(fx.num("first"))};
  const auto seed = static_cast<std::uint64_t>(fx.num("seed"));
  check(fx, {"x"}, [&](auto& t) { return dropout(t["x"], fx.num("p"), seed, at); }, 0.0);
}

TEST(Golden, Pooling) {
  const Fixture mp = load("max_pool2d");
  check(mp, {"x"}, [&](auto& t) { return max_pool2d(t["x"], pair(mp, "kernel_size"), pair(mp, "stride"), pair(mp, "padding")); }, 1e-5);
  for (const char* c : {"avg_pool2d", "avg_pool2d_pad"}) {
    SCOPED_TRACE(c);
    const Fixture fx = load(c);
    check(fx, {"x"}, [&](auto& t) {
      return avg_pool2d(t["x"], pair(fx, "kernel_size"), pair(fx, "stride"), pair(fx, "padding"), fx.meta.at("count_include_pad") == "true");
    }, 1e-5);
  }
  for (const char* c : {"adaptive_avg_pool2d", "global_avg_pool"}) {
    SCOPED_TRACE(c);
    const Fixture fx = load(c);
    const std::array<std::int64_t, 2> out{static_cast<std::int64_t>(fx.num("output_h")), static_cast<std::int64_t>(fx.num("output_w"))};
    check(fx, {"x"}, [&](auto& t) { return adaptive_avg_pool2d(t["x"], out); }, 1e-5);
  }
}

TEST(Golden, Reductions) {
  check(load("sum"), {"x"}, [](auto& t) { return sum(t["x"]); }, 1e-5);
  check(load("mean"), {"x"}, [](auto& t) { return mean(t["x"]); }, 1e-5);
}

TEST(Golden, CrossEntropy) {
  for (const char* c : {"cross_entropy_mean", "cross_entropy_sum", "cross_entropy_smooth", "cross_entropy_ignore",
                        "cross_entropy_weight", "cross_entropy_all"}) {
    SCOPED_TRACE(c);
    Fixture fx = load(c);
    fx.t["y"] = fx["loss"];
    CrossEntropyOptions o;
    o.reduction = fx.meta.at("reduction") == "sum" ? Reduction::Sum : Reduction::Mean;
    o.label_smoothing = fx.num("label_smoothing");
    o.ignore_index = static_cast<std::int64_t>(fx.num("ignore_index"));
    if (fx.has("weight")) o.weight = fx["weight"];
    check(fx, {"logits"}, [&](auto& t) { return cross_entropy(t["logits"], fx["targets"], o); }, 1e-5);
  }
}

// A torchvision BasicBlock in training mode: output, every gradient and the running statistics.
TEST(Golden, ResidualBasicBlock) {
  for (const char* c : {"basic_block", "basic_block_proj"}) {
    SCOPED_TRACE(c);
    const Fixture fx = load(c);
    const std::int64_t stride = static_cast<std::int64_t>(fx.num("stride"));
    const bool proj = fx.has("downsample.0.weight");
    std::vector<std::string> names{"x", "conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias"};
    if (proj) names.insert(names.end(), {"downsample.0.weight", "downsample.1.weight", "downsample.1.bias"});
    std::map<std::string, Tensor> running;
    for (const char* bn : {"bn1", "bn2", "downsample.1"}) {
      if (!proj && std::string(bn) == "downsample.1") continue;
      running[std::string(bn) + ".running_mean"] = Tensor::zeros({fx[std::string(bn) + ".weight"].size(0)}, DType::Float32, Device::cpu(), Category::parameter);
      running[std::string(bn) + ".running_var"] = Tensor::full({fx[std::string(bn) + ".weight"].size(0)}, 1.0, DType::Float32, Device::cpu(), Category::parameter);
    }
    BatchNormOptions bo;
    bo.momentum = fx.num("bn_momentum");
    bo.eps = fx.num("bn_eps");
    auto bn = [&](const Tensor& h, const std::string& n, std::map<std::string, Tensor>& t) {
      return batch_norm(h, t[n + ".weight"], t[n + ".bias"], running[n + ".running_mean"], running[n + ".running_var"], bo);
    };
    check(fx, names, [&](auto& t) {
      Conv2dOptions c1;
      c1.stride = {stride, stride};
      c1.padding = {1, 1};
      Conv2dOptions c2;
      c2.padding = {1, 1};
      Tensor out = relu(bn(conv2d(t["x"], t["conv1.weight"], {}, c1), "bn1", t));
      out = bn(conv2d(out, t["conv2.weight"], {}, c2), "bn2", t);
      Tensor sc = t["x"];
      if (proj) {
        Conv2dOptions d;
        d.stride = {stride, stride};
        sc = bn(conv2d(t["x"], t["downsample.0.weight"], {}, d), "downsample.1", t);
      }
      return relu(add(out, sc));
    }, 1e-4);
    for (const auto& [k, v] : running) EXPECT_LE(rel_err(v, fx["out." + k]), 1e-5) << k;
  }
}
