// kernels/cpu/cpu_kernels.h — the CPU reference kernels: the backend contract (kernels/backend.inc,
// whose semantics are these kernels') and what only the CPU has.
//
// Every function is a template on T (float, double, and bf16 for the ops of a mixed-precision
// step), explicitly instantiated in the matching .cpp file (gemm.cpp, conv.cpp, norm.cpp,
// pool.cpp, loss.cpp, elementwise.cpp, optim.cpp, profile.cpp) from kernels/instantiate.h's
// lists. These are the reference every CUDA kernel is tested against: clarity and exactness
// first, then speed (OpenBLAS for GEMM, oneDNN for convolutions where the build has it, OpenMP
// over channels/batch where it pays on a few cores).
#pragma once
#include <cstdint>
#include <string>

#include "kernels/common.h"

namespace tally::kernels::cpu {

template <class T>
using P = compute_t<T>;

#include "kernels/backend.inc"

// ---- what the CPU's kernels do beyond the contract ---------------------------------------------
// gemm.cpp: OpenBLAS (cblas_sgemm / cblas_dgemm). Workspace: none for float and double; for bf16
// the float32 copies of A, B (and C when C is bf16) that sgemm multiplies — float32 math, one
// rounding of C.
//
// conv.cpp: float32 and bf16 on oneDNN where the build has it and oneDNN takes the shape (the
// default; bf16 needs AVX-512), else im2col + GEMM (the reference). A bf16 convolution that oneDNN
// cannot run converts chunks of samples to float32 in its workspace and runs the float32
// convolution on them, with the weights rounded to bf16 — the same products, float32 sums.
// conv_workspace_limit: budget / 32, at least 64 MiB; a pass over it runs over chunks of samples
// (conv_onednn.cpp). conv2d_workspace_bytes: the reference's one image's im2col columns, or 0
// where the convolution is a plain GEMM (1x1, stride 1, no padding); oneDNN's layout buffers and
// scratchpad for this shape and pass at the current OpenMP thread count (the planner's dry runs
// and the real steps run at the same count). conv2d_takes_channels_last: on oneDNN (its direct
// convolutions read and write NHWC without reordering). conv2d_backward_filter runs a GEMM with
// beta = 1 after the first image, so the persistent gradient buffer is the accumulator.
enum class ConvAlgorithm { reference, onednn };
// The float32 algorithm of every later call (onednn falls back to reference in a build without
// oneDNN). Change it only between steps: a plan's dry run and its real step must see the same.
void set_conv_algorithm(ConvAlgorithm a);
ConvAlgorithm conv_algorithm();
bool have_onednn();
// Whether a float32 (or, with bf16_activations, a bf16) call of `pass` on shape `s` runs on
// oneDNN now (the algorithm is onednn and oneDNN takes the shape and type), rather than on the
// reference (float32) or the widened float32 fallback (bf16).
bool conv2d_on_onednn(const Conv2dShape& s, ConvPass pass, bool bf16_activations = false);

// norm.cpp: batch_norm_workspace_bytes is 0 (the CUDA twin's per-block partial sums). The
// channels-last batch norms run an AVX-512 copy of their loops where the CPU has AVX-512 (the same
// bits as the baseline copy: the same loops, no contraction). TALLY_CPU_ISA=baseline in the
// environment, or set_avx512_kernels(false), runs the baseline copy; the setter returns whether
// the AVX-512 copy runs now (false where the CPU or the compiler lacks it).
bool set_avx512_kernels(bool on);
bool avx512_kernels();

// elementwise.cpp: copy_from_host, copy_to_host and copy_bytes are memcpy; sum_to and
// broadcast_scalar are the host twins of CUDA's device-side reductions.
// convert_channels_last: n row-major (c, hw) float images converted to D (float, double, bf16) and
// written channels-last, (hw, c) each — what the input staging writes for a channels-last step
// (core/staging.h), the permutation and the rounding of convert() in one pass.
template <class D>
void convert_channels_last(i64 n, i64 c, i64 hw, const float* x, D* y);
// profile.cpp: host time around each op's kernels; ops run one after another on the host, so the
// times add up to the step's compute. profile_collect has nothing to collect.

}  // namespace tally::kernels::cpu
