// kernels/cpu/conv_onednn.cpp — float32 and bf16 convolutions on oneDNN (the library PyTorch's
// CPU convolutions run on), every byte of them in the caller's workspace.
//
// bf16: activations and their gradients bf16; the weights are tally's float32 master weights,
// which the weight operand's reorder rounds to bf16 in the blocked layout (as it reorders them
// for float32); the weight gradient is float32 (oneDNN accumulates bf16 products in float32).
// oneDNN 2.x has bf16 convolutions only on AVX-512 CPUs (native with avx512_bf16, emulated
// without): elsewhere the plan is unsupported and conv.cpp runs its float32 fallback.
//
// For each shape and pass a plan is made once and cached: the oneDNN primitive, created with
// `format_tag::any` so that oneDNN picks its fast (blocked) layouts, in scratchpad mode `user`;
// for every operand whose layout differs from tally's plain NCHW / (G)OIHW, a buffer in the
// workspace and a reorder into it (inputs) or out of it (outputs). The workspace of a pass is
//
//   [ operand buffers, 64-byte aligned ][ one scratchpad region: the largest of the primitive's
//                                         and the reorders' scratchpads (they run one by one) ]
//
// so conv2d_workspace_bytes() is known before anything runs (a dry run creates the plan to learn
// it, and never executes it), and the arena holds every byte oneDNN touches. The backward passes
// always reserve their output's buffer: when the gradient accumulates (beta = 1, the persistent
// weight gradients), the primitive writes there and a reorder with a sum post-op adds it into the
// gradient; the size does not depend on beta, which the workspace query does not know.
//
// A pass whose workspace would exceed the shape's workspace_limit (core/ sets it from the arena's
// budget, kernels/cpu/cpu_kernels.h) runs over chunks of samples, each within the limit: the
// operands' buffers grow with the batch, and at large micro-batches they would otherwise be a
// large share of the budget (ResNet-50's layer2.0 backward at 241 samples: 1 GiB).
//
// A plan depends on the OpenMP thread count (oneDNN sizes per-thread scratch from it), so the
// count is part of the cache key. A shape oneDNN refuses falls back to the im2col reference.
#include "kernels/cpu/onednn.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <tuple>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

namespace tally::kernels::cpu::onednn {

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// The sanitizer build caps oneDNN at AVX-512 with bf16 (no AMX) unless ONEDNN_MAX_CPU_ISA says
// otherwise. oneDNN 2.6.3's AMX brgemm convolution (brgconv:avx512_core_amx_bf16) reads past its
// own buffers while its primitive is created: under AddressSanitizer, on an AMX Xeon, creating the
// bf16 3x3 forward of 171x64x56x56 (nhwc, ResNet-50's layer1.0.conv2 at a micro-batch of 171)
// met an unmapped page (SEGV in dnnl_primitive_create). The read depends on the heap's layout: a
// program that creates that one primitive alone ran clean, and the normal build passes — its
// read lands in mapped memory. oneDNN is not instrumented, so this is no finding about tally; the
// cap keeps the sanitizer build about tally's own code. Normal builds keep AMX, which trains bf16
// ResNet-20 about 2x as fast here (958 against 452-525 images/s, AVX512_CORE_BF16).
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizerBuild = true;
#else
constexpr bool kSanitizerBuild = false;
#endif
dnnl::engine& engine() {
  static dnnl::engine e = [] {
    if (kSanitizerBuild && std::getenv("ONEDNN_MAX_CPU_ISA") == nullptr)
      dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16);  // before oneDNN's first kernel
    return dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return e;
}
dnnl::stream& stream() {
  static dnnl::stream s(engine());
  return s;
}

constexpr std::size_t kAlign = 64;
std::size_t aligned(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// One operand of a primitive: tally's plain layout (`user`) and the primitive's (`prim`).
struct Operand {
  int arg = 0;
  bool output = false;
  memory::desc user, prim;
  bool buffered = false;        // prim != user, or an output that may accumulate
  std::size_t offset = 0;       // of its buffer in the workspace
  dnnl::reorder to_prim;        // inputs: user -> buffer
  dnnl::reorder to_user;        // outputs: buffer -> user, overwriting
  dnnl::reorder add_to_user;    // outputs: buffer -> user, adding (sum post-op)
  memory::desc to_prim_scratch, to_user_scratch, add_scratch;
};

struct Plan {
  dnnl::primitive prim;
  memory::desc scratch;  // the primitive's
  std::vector<Operand> operands;
  std::size_t scratch_offset = 0, bytes = 0;
  bool supported = false;
};

Operand operand(int arg, bool output, const memory::desc& user, const memory::desc& prim) {
  Operand o;
  o.arg = arg, o.output = output, o.user = user, o.prim = prim;
  return o;
}

dnnl::primitive_attr user_scratchpad() {
  dnnl::primitive_attr a;
  a.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return a;
}

std::pair<dnnl::reorder, memory::desc> make_reorder(const memory::desc& from, const memory::desc& to, bool add) {
  dnnl::primitive_attr a = user_scratchpad();
  if (add) {
    dnnl::post_ops po;
    po.append_sum(1.f);
    a.set_post_ops(po);
  }
  dnnl::reorder::primitive_desc pd(engine(), from, engine(), to, a);
  return {dnnl::reorder(pd), pd.scratchpad_desc()};
}

using Key = std::tuple<i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, int, int, int, bool>;
Key key_of(const Conv2dShape& s, ConvPass pass, Elem elem) {
  return {s.N, s.C, s.H, s.W, s.K, s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w, s.dil_h, s.dil_w, s.groups,
          static_cast<int>(pass), omp_get_max_threads(), static_cast<int>(elem), s.channels_last};
}
std::size_t elem_bytes(Elem e) { return e == Elem::bf16 ? 2 : 4; }

// Lays out the buffers and the shared scratchpad region; makes the reorders.
void finish(Plan& p, const memory::desc& prim_scratch) {
  p.scratch = prim_scratch;
  std::size_t at = 0, scratch = prim_scratch.get_size();
  for (Operand& o : p.operands) {
    // A backward pass's output (listed first, its arg not DST) always has a buffer: it may accumulate.
    o.buffered = o.prim != o.user || (o.output && o.arg != DNNL_ARG_DST);
    if (!o.buffered) continue;
    o.offset = at;
    at += aligned(o.prim.get_size());
    if (!o.output) {
      std::tie(o.to_prim, o.to_prim_scratch) = make_reorder(o.user, o.prim, false);
      scratch = std::max(scratch, o.to_prim_scratch.get_size());
    } else {
      std::tie(o.to_user, o.to_user_scratch) = make_reorder(o.prim, o.user, false);
      std::tie(o.add_to_user, o.add_scratch) = make_reorder(o.prim, o.user, true);
      scratch = std::max({scratch, o.to_user_scratch.get_size(), o.add_scratch.get_size()});
    }
  }
  p.scratch_offset = at;
  p.bytes = at + aligned(scratch);
  p.supported = true;
}

std::unique_ptr<Plan> make_plan(const Conv2dShape& s, ConvPass pass, Elem elem) {
  auto p = std::make_unique<Plan>();
  const memory::dims x_dims{s.N, s.C, s.H, s.W}, y_dims{s.N, s.K, s.P(), s.Q()};
  const bool grouped = s.groups > 1;
  const memory::dims w_dims = grouped ? memory::dims{s.groups, s.K / s.groups, s.C / s.groups, s.R, s.S}
                                      : memory::dims{s.K, s.C, s.R, s.S};
  const memory::dims strides{s.stride_h, s.stride_w}, dilates{s.dil_h - 1, s.dil_w - 1}, pad_l{s.pad_h, s.pad_w};
  // PyTorch's output size rounds down: the right/bottom padding is what makes oneDNN agree.
  const memory::dims pad_r{(s.P() - 1) * s.stride_h + (s.R - 1) * s.dil_h + 1 - s.H - s.pad_h,
                           (s.Q() - 1) * s.stride_w + (s.S - 1) * s.dil_w + 1 - s.W - s.pad_w};
  const dt a = elem == Elem::bf16 ? dt::bf16 : dt::f32;  // activations, and the weights as read
  // Channels-last activations are given to the primitive as they are (nhwc, oneDNN's direct
  // convolutions run on it): no reorder in or out. Row-major ones go to the layout it prefers.
  const tag act = s.channels_last ? tag::nhwc : tag::nchw;
  const memory::desc x_user(x_dims, a, act), y_user(y_dims, a, act);
  const memory::desc w_user(w_dims, dt::f32, grouped ? tag::goihw : tag::oihw);  // the master weights
  const memory::desc x_any(x_dims, a, s.channels_last ? tag::nhwc : tag::any),
      y_any(y_dims, a, s.channels_last ? tag::nhwc : tag::any), w_any(w_dims, a, tag::any);
  const memory::desc dw_any(w_dims, dt::f32, tag::any);  // weight gradients: float32
  const auto alg = dnnl::algorithm::convolution_direct;
  try {
    const dnnl::primitive_attr attr = user_scratchpad();
    const dnnl::convolution_forward::primitive_desc fwd(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, x_any, w_any, y_any, strides, dilates,
                                        pad_l, pad_r),
        attr, engine());
    if (pass == ConvPass::forward) {
      p->prim = dnnl::convolution_forward(fwd);
      p->operands = {operand(DNNL_ARG_DST, true, y_user, fwd.dst_desc()),
                     operand(DNNL_ARG_SRC, false, x_user, fwd.src_desc()),
                     operand(DNNL_ARG_WEIGHTS, false, w_user, fwd.weights_desc())};
      finish(*p, fwd.scratchpad_desc());
    } else if (pass == ConvPass::backward_data) {
      const dnnl::convolution_backward_data::primitive_desc bwd(
          dnnl::convolution_backward_data::desc(alg, x_any, w_any, y_any, strides, dilates, pad_l, pad_r), attr,
          engine(), fwd);
      p->prim = dnnl::convolution_backward_data(bwd);
      p->operands = {operand(DNNL_ARG_DIFF_SRC, true, x_user, bwd.diff_src_desc()),
                     operand(DNNL_ARG_DIFF_DST, false, y_user, bwd.diff_dst_desc()),
                     operand(DNNL_ARG_WEIGHTS, false, w_user, bwd.weights_desc())};
      finish(*p, bwd.scratchpad_desc());
    } else {
      const dnnl::convolution_backward_weights::primitive_desc bwd(
          dnnl::convolution_backward_weights::desc(alg, x_any, dw_any, y_any, strides, dilates, pad_l, pad_r), attr,
          engine(), fwd);
      p->prim = dnnl::convolution_backward_weights(bwd);
      p->operands = {operand(DNNL_ARG_DIFF_WEIGHTS, true, w_user, bwd.diff_weights_desc()),
                     operand(DNNL_ARG_SRC, false, x_user, bwd.src_desc()),
                     operand(DNNL_ARG_DIFF_DST, false, y_user, bwd.diff_dst_desc())};
      finish(*p, bwd.scratchpad_desc());
    }
  } catch (const dnnl::error&) {
    p = std::make_unique<Plan>();  // unsupported: the reference path runs this shape
  }
  return p;
}

Plan& plan(const Conv2dShape& s, ConvPass pass, Elem elem) {
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<Plan>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[key_of(s, pass, elem)];
  if (!slot) slot = make_plan(s, pass, elem);
  return *slot;
}

// Runs a plan: `ptrs` holds the user pointer of each operand, in the plan's order (output first).
void run(Plan& p, const std::vector<void*>& ptrs, bool accumulate, void* workspace) {
  auto* base = static_cast<char*>(workspace);
  auto scratch = [&](const memory::desc& md) { return memory(md, engine(), base + p.scratch_offset); };
  dnnl::stream& st = stream();
  std::unordered_map<int, memory> args;
  std::vector<memory> user(p.operands.size());
  for (std::size_t i = 0; i < p.operands.size(); ++i) {
    Operand& o = p.operands[i];
    user[i] = memory(o.user, engine(), ptrs[i]);
    if (!o.buffered) {
      args[o.arg] = user[i];
      continue;
    }
    if (o.output && !accumulate && o.prim == o.user) {  // written in place: nothing to reorder or add
      args[o.arg] = user[i];
      continue;
    }
    memory buf(o.prim, engine(), base + o.offset);
    if (!o.output)
      o.to_prim.execute(st, {{DNNL_ARG_FROM, user[i]}, {DNNL_ARG_TO, buf}, {DNNL_ARG_SCRATCHPAD, scratch(o.to_prim_scratch)}});
    args[o.arg] = buf;
  }
  args[DNNL_ARG_SCRATCHPAD] = scratch(p.scratch);
  p.prim.execute(st, args);
  Operand& out = p.operands.front();
  if (out.buffered && !(!accumulate && out.prim == out.user)) {
    if (accumulate)
      out.add_to_user.execute(st, {{DNNL_ARG_FROM, args[out.arg]}, {DNNL_ARG_TO, user[0]},
                                   {DNNL_ARG_SCRATCHPAD, scratch(out.add_scratch)}});
    else
      out.to_user.execute(st, {{DNNL_ARG_FROM, args[out.arg]}, {DNNL_ARG_TO, user[0]},
                               {DNNL_ARG_SCRATCHPAD, scratch(out.to_user_scratch)}});
  } else if (accumulate) {
    throw std::logic_error("onednn conv: an accumulating output without a buffer");
  }
  st.wait();
}

Conv2dShape with_samples(Conv2dShape s, i64 n) {
  s.N = n;
  return s;
}

// Samples per chunk: the whole batch when its pass fits s.workspace_limit, else the most whose
// plan does (at least one; the workspace grows with N by the operands' buffers, so the first
// guess is linear between one sample and N, then stepped down until it fits). Chunks are
// n, n, ..., and the rest: at most two shapes, two plans.
i64 chunk_samples(const Conv2dShape& s, ConvPass pass, Elem elem) {
  const Plan& full = plan(s, pass, elem);
  if (!full.supported || full.bytes <= s.workspace_limit || s.N == 1) return s.N;
  static std::mutex mu;
  static std::map<std::pair<Key, std::size_t>, i64> cache;
  const auto key = std::make_pair(key_of(s, pass, elem), s.workspace_limit);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  const Plan& one = plan(with_samples(s, 1), pass, elem);
  i64 n = 1;
  if (one.supported && one.bytes < s.workspace_limit && full.bytes > one.bytes) {
    const double per_sample = static_cast<double>(full.bytes - one.bytes) / static_cast<double>(s.N - 1);
    n = std::clamp<i64>(1 + static_cast<i64>(static_cast<double>(s.workspace_limit - one.bytes) / per_sample), 1, s.N - 1);
    while (n > 1 && plan(with_samples(s, n), pass, elem).bytes > s.workspace_limit) --n;
  }
  // Every chunk shape must be one oneDNN takes; if not, the whole batch at once.
  if (!plan(with_samples(s, n), pass, elem).supported ||
      (s.N % n != 0 && !plan(with_samples(s, s.N % n), pass, elem).supported))
    n = s.N;
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  return n;
}

// Runs a pass chunk by chunk (samples are outermost in NCHW, so a chunk is a contiguous slice of
// x/y and dx/dy); a filter gradient accumulates over the chunks after the first.
// Pointers are to activations of `elem` (bytes per element: elem_bytes) or to float32 weights.
void run_chunked(const Conv2dShape& s, ConvPass pass, Elem elem, const void* in0, const void* in1, void* out,
                 bool accumulate, void* workspace) {
  const i64 n = chunk_samples(s, pass, elem);
  const i64 e = static_cast<i64>(elem_bytes(elem));
  const i64 x_sample = s.C * s.H * s.W * e, y_sample = s.K * s.P() * s.Q() * e;  // bytes
  for (i64 start = 0; start < s.N; start += n) {
    const i64 len = std::min(n, s.N - start);
    Plan& p = plan(with_samples(s, len), pass, elem);
    auto* a = static_cast<char*>(const_cast<void*>(in0));
    auto* b = static_cast<char*>(const_cast<void*>(in1));
    auto* o = static_cast<char*>(out);
    switch (pass) {
      case ConvPass::forward:  // in0 = x, in1 = w, out = y
        run(p, {o + start * y_sample, a + start * x_sample, b}, false, workspace);
        break;
      case ConvPass::backward_data:  // in0 = dy, in1 = w, out = dx
        run(p, {o + start * x_sample, a + start * y_sample, b}, accumulate, workspace);
        break;
      case ConvPass::backward_filter:  // in0 = x, in1 = dy, out = dw
        run(p, {o, a + start * x_sample, b + start * y_sample}, accumulate || start > 0, workspace);
        break;
    }
  }
}

}  // namespace

bool supports(const Conv2dShape& s, ConvPass pass, Elem elem) { return plan(s, pass, elem).supported; }

std::size_t conv_workspace_bytes(const Conv2dShape& s, ConvPass pass, Elem elem) {
  const i64 n = chunk_samples(s, pass, elem);
  if (n == s.N) return plan(s, pass, elem).bytes;
  std::size_t bytes = plan(with_samples(s, n), pass, elem).bytes;
  if (s.N % n != 0) bytes = std::max(bytes, plan(with_samples(s, s.N % n), pass, elem).bytes);
  return bytes;
}

void conv_forward(const Conv2dShape& s, Elem elem, const void* x, const float* w, void* y, void* workspace) {
  run_chunked(s, ConvPass::forward, elem, x, w, y, false, workspace);
}

void conv_backward_data(const Conv2dShape& s, Elem elem, const void* dy, const float* w, void* dx, bool accumulate,
                        void* workspace) {
  run_chunked(s, ConvPass::backward_data, elem, dy, w, dx, accumulate, workspace);
}

void conv_backward_filter(const Conv2dShape& s, Elem elem, const void* x, const void* dy, float* dw, bool accumulate,
                          void* workspace) {
  run_chunked(s, ConvPass::backward_filter, elem, x, dy, dw, accumulate, workspace);
}

}  // namespace tally::kernels::cpu::onednn
