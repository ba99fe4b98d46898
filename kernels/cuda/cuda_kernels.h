// kernels/cuda/cuda_kernels.h — the CUDA kernels: the backend contract (kernels/backend.inc,
// declared once for both backends, with the CPU reference's semantics) and what only CUDA has.
//
// A plain C++ header: no CUDA types, declared in every build (core/dispatch.h reaches it only
// in a build with the CUDA backend). Every function is a template on T explicitly instantiated
// for float and, for the ops of a mixed-precision step, bf16 (the loss, the optimizers and the
// norm moments are float only); the memory-only functions (fill, copy, strided_copy, convert) take
// more types — the lists are kernels/instantiate.h's. The bf16 kernels load bf16, compute in
// float32 (or in double where the float32 kernel does) and round once per element stored.
//
// Conventions (see kernels/common.h for layout, `beta` and workspaces):
//   * Pointers are device pointers of the *current* device (kernels/cuda/context.h: use_device),
//     except the shape/stride arrays of strided_copy, which are host arrays.
//   * Every kernel is enqueued on the current device's compute stream and returns without waiting
//     (the host thread runs ahead). The only exceptions are the functions that return a value
//     computed on the device: sum_all and cross_entropy_forward wait for the compute stream
//     before returning, and conv2d_workspace_bytes may run cuDNN's heuristics (host-side) once
//     per shape.
//   * Errors (a failing launch, a cuBLAS/cuDNN status) throw tally::Error naming the call,
//     file:line and the status string. Launches are checked with cudaGetLastError; a fault
//     inside a kernel surfaces at the next synchronizing call.
//   * Reductions are deterministic: fixed launch shapes and fixed summation trees, no float
//     atomics, so repeated runs give bitwise identical results.
//   * Sizes are i64 and indexing is 64-bit wherever an index can pass 2^31; the cuBLAS and cuDNN
//     calls take int sizes and throw a clear error beyond them.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/common.h"  // Conv2dShape, Pool2dShape

namespace tally::kernels::cuda {

template <class T>
using P = compute_t<T>;

#include "kernels/backend.inc"

// ---- gemm.cu: cuBLAS (cublasGemmEx on the column-major transpose) -------------------------------
// `workspace` is cuBLAS's scratch for this call, set with cublasSetWorkspace just before the call;
// cuBLAS never allocates on its own. cuBLAS may fail without one (CUBLAS_STATUS_ALLOC_FAILED), so a
// null workspace or one under kGemmMinWorkspace bytes is an error. float32 math, no TF32 unless
// set_allow_tf32(true) (float32 operands only: bf16 operands are multiplied exactly and summed in
// float32, CUBLAS_COMPUTE_32F, whatever the switch).
inline constexpr std::size_t kGemmMinWorkspace = std::size_t(1) << 20;
// The workspace of every GEMM under a memory budget (an arena's budget()): budget / 16, at least
// kGemmMinWorkspace, at most cuBLAS's recommendation for the current device (32 MiB on Hopper and
// newer, 4 MiB before), in 256-byte units. The contract's form (the CPU's depends on the shape and
// type) asks this one: cuBLAS's does not depend on them.
std::size_t gemm_workspace_bytes(std::size_t budget);
template <class T>
std::size_t gemm_workspace_bytes(std::size_t budget, i64 /*M*/, i64 /*N*/, i64 /*K*/) {
  return gemm_workspace_bytes(budget);
}

// ---- conv.cu: cuDNN ----------------------------------------------------------------------------
// conv_workspace_limit: budget / 8, at most 1 GiB. The algorithms of forward, backward data and
// backward filter are chosen once per shape (its workspace_limit included, and per TF32 /
// determinism setting) from cuDNN's heuristics, cached, and reused: conv2d_workspace_bytes(s,
// pass) is the workspace of that pass's cached choice (at most s.workspace_limit), the same number
// in a dry run and a real run.
// bf16: x, y, dx, dy are bf16 (cuDNN's bf16 convolutions, products summed in float32); the float32
// master weights are rounded to a bf16 copy in the pass's workspace before the call, and the
// weight gradient is written by cuDNN in bf16 into the workspace, then added into the float32 dw.
// So a bf16 pass's workspace is cuDNN's plus that bf16 weight (or weight-gradient) buffer, in
// 256-byte aligned parts; plans are cached per dtype. A bf16 forward with a bias adds the bias to
// the output cuDNN has rounded to bf16 and rounds the sum again (the CPU sums in float32 first and
// rounds once). float32 backward filter: cuDNN writes with beta = 1 straight into the persistent
// gradient buffer. conv2d_backward_bias: a deterministic reduction kernel, not cuDNN.
// The cached plan of a shape in words: each pass's algorithm, workspace and the candidates seen
// (float or bf16: a plan per data type).
template <class T = float>
std::string conv2d_plan_description(const Conv2dShape& s);
// Prints every new plan's description to stderr (also switched on by TALLY_LOG_CONV=1).
void set_log_conv_algorithms(bool on);
// The cuDNN API the convolutions go through (kernels/cuda/conv.cu): legacy (cudnnConvolution*),
// graph (the backend API of cudnn_graph.h: one operation graph per pass, engines from heuristics
// mode A, then the fallback mode, under the same rules) or automatic, the default: the graph API
// for bf16 and for channels-last activations, the legacy API for row-major float32 — on an H100 (2026-11-26, ResNet-50 batch 256) bf16
// trained 10x faster through the graph API (1,202 against 117 images/s), float32 as fast through
// either (692 / 693) and TF32 3% faster through the legacy one (1,406 / 1,358) — except a
// row-major float32 shape for which the legacy API has no deterministic algorithm within the
// workspace limit while deterministic() is on: that shape goes through the graph API.
// TALLY_CUDNN_CONV_API=legacy|graph|auto in the environment selects it at start (another value:
// a warning, and auto). Change it only between steps: a plan's dry run and its real step must
// choose alike.
enum class CudnnConvApi { automatic, legacy, graph };
void set_cudnn_conv_api(CudnnConvApi api);
CudnnConvApi cudnn_conv_api();
// Channels-last (NHWC) activations go through cuDNN's graph API, whose NHWC engines take the weights
// as stored, (K, C/g, R, S) (the plan's workspace holds cuDNN's reorder of them): so a convolution
// with no bias takes them unless the legacy API is forced (TALLY_CUDNN_CONV_API=legacy), where
// core/ converts a channels-last input to row-major first.
template <class T>
bool conv2d_takes_channels_last(const Conv2dShape& s) {
  return !s.bias && cudnn_conv_api() != CudnnConvApi::legacy;
}

// Plans without the device (cuDNN 9.8+'s deviceless ahead-of-time compilation; docs/gpu.md,
// "Plans without the GPU"). cudnn_device_properties: cuDNN's serialized description of GPU
// `device` (CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION) — on that GPU. conv2d_plan_offline: one
// pass's graph-API plan (beta 0 writes, 1 accumulates) for the GPU those properties describe,
// chosen under the same rules as the graph API's on the device (heuristics mode A then the
// fallback mode; deterministic(), allow_tf32() and the shape's workspace_limit as set) and
// finalized by cuDNN from the description alone: no GPU, driver or handle is touched. A
// description cuDNN refuses (another cuDNN's, or damaged): a tally::Error naming cuDNN's reason.
std::string cudnn_device_properties(int device);
struct OfflineConvPlan {
  std::int64_t engine = -1;    // cuDNN's global engine index
  std::size_t workspace = 0;   // cuDNN's workspace in bytes (bf16: without tally's weight copy)
  std::string description;     // the choice and the candidates, as conv2d_plan_description words them
};
OfflineConvPlan conv2d_plan_offline(const Conv2dShape& s, bool bf16, ConvPass pass, float beta,
                                    const std::string& device_properties);

// Engines chosen by measurement (docs/gpu.md, "Tuning"): a graph-API pass's candidates timed on
// the device, the fastest replayed by every later plan of the pass. Only passes that go through the
// graph API are tuned (bf16, channels-last, TALLY_CUDNN_CONV_API=graph): the legacy API's choice of a
// row-major float32 shape stays the heuristics'. A tuned pass is keyed by conv2d_tuning_key — its
// shape without the workspace limit, data type, pass, beta and the switches deterministic() and
// allow_tf32() — and replayed only where the heuristics list the same engine at the same rank, the
// rules allow it and its workspace fits the shape's limit; anywhere else the pass takes the
// heuristics' choice, saying so in its description.
std::string conv2d_tuning_key(const Conv2dShape& s, bool bf16, ConvPass pass, float beta);
// The table every graph-API plan made from now on replays (empty: none): each entry's fastest
// choice, or its within_* one where the entry says use_within. Plans made before stay cached under
// the table they were made with. Between steps only, like set_cudnn_conv_api. Returns whether that
// changed what is replayed (the table is the process's, whoever installed it before).
bool set_conv_tuning(const std::map<std::string, TunedConvPass>& table);
// While on, every graph-API pass a plan sizes or runs is recorded (a dry run's passes: what a
// step will run); on clears the record.
void conv2d_record_passes(bool on);
std::vector<ConvPassKey> conv2d_recorded_passes();
// The global engine index of each configuration the heuristics list for a graph-API pass, by rank
// (for the current device, or the described one): what a tuning entry's rank and engine refer to.
std::vector<std::int64_t> conv2d_graph_engines(const Conv2dShape& s, bool bf16, ConvPass pass, float beta);
// Times the candidates of one pass on the current device: up to kTuneCandidates configurations of
// the heuristics' list that the rules allow, each finalized, run once, then timed over kTuneRepeats
// runs on the compute stream; candidates whose workspace is over min(the shape's limit,
// workspace_bytes) are skipped, as is one that fails to run; past `seconds` of measuring no further
// candidate starts. x, w and y are device buffers of the pass's shape and data type (w in the
// data's type: bf16 weights for a bf16 pass), their contents overwritten. The result's rank and
// engine are -1 when no candidate could be timed.
inline constexpr int kTuneCandidates = 24, kTuneRepeats = 3;
TunedConvPass conv2d_tune_pass(const ConvPassKey& p, void* x, void* w, void* y, void* workspace,
                               std::size_t workspace_bytes, double seconds);

// Channels-last batch norm's elementwise passes run vectorized (kVec channels a thread, norm.cu) where
// the shape and alignment allow; off, the scalar passes run everywhere — the same values bit for
// bit (a test compares them). For tests; on by default.
void set_batch_norm_vectorized(bool on);

// ---- context.cpp, elementwise.cu, norm.cu, pool.cu, loss.cu, optim.cu ---------------------------
// copy_from_host and copy_to_host return once the copy is done (the host buffer may be reused or
// read at once), copy_bytes without waiting; all are enqueued on the compute stream after every
// kernel before them. sum_all waits for the compute stream and returns the value; sum_to,
// broadcast_scalar and fill_product never wait.
// Norms: sums and per-element formulas in double. Batch norm: partial sums over several blocks per
// channel (its workspace: batch_norm_workspace_bytes), a per-channel finalize, an elementwise
// pass; group norm: one block per (n, group). bf16: the same double sums and formulas on widened
// values, the statistics and parameter gradients float32, each bf16 output rounded once. The fused
// residual add and ReLU ride on the normalizing pass and on the backward's partial sums and dx
// pass, as on the CPU.
// Pooling: the backward kernels gather (one thread per input element, summing its windows in the
// CPU's order) instead of scattering, so overlapping windows need no atomics. bf16: each gradient
// summed in float32 in the CPU's order and rounded once, as the CPU's float32 plane does.
// Loss: with check_targets, cross_entropy_forward waits for the compute stream: it returns the
// index of the first target outside [0, C) that is not ignore_index (else -1), found on the host
// from a copy of the targets; without, it never waits.
// Profile (context.cpp): with profiling on (set_profiling(true), or TALLY_PROFILE=1 in the
// environment) every op records a pair of timed events on the compute stream around its
// launches; profile_collect() — called where the stream is known to be idle, e.g. after a
// training step's one wait — adds their elapsed times to the table without waiting itself.

}  // namespace tally::kernels::cuda
