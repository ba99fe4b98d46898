// core/ops.cpp — forward and backward of every op: checks, allocation, dispatch, autograd nodes.
//
// Pattern of every op: check operands -> allocate outputs (activation) -> dispatch to the kernel
// (core/dispatch.h; a dry run stops there) -> if grad is needed, a Node saves what backward needs (activation)
// and records the edges. Each Node's backward asks grad_target() for the buffer of each needed
// input gradient: beta = 1 means accumulate into an existing buffer (a parameter's persistent
// gradient, or a tensor consumed twice), beta = 0 means a fresh buffer.
//
// The ops live by family, as kernels/ does: core/ops_conv.cpp, ops_linear.cpp, ops_norm.cpp,
// ops_elementwise.cpp, ops_pool.cpp, ops_shape.cpp (shape ops and reductions), ops_loss.cpp; what
// they share is core/ops_internal.h. This file keeps the FLOP counter.
#include "core/ops.h"

#include <cmath>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/dispatch.h"
#include "core/dry_run.h"
#include "core/memory.h"

namespace tally {

FlopCount& flop_count() {
  thread_local FlopCount count;
  return count;
}

}  // namespace tally
