// core/error.h — tally's exceptions (Error, ShapeError, FormatError; OutOfMemory in core/arena.h),
// defined in kernels/error.h, the bottom of the library, so that kernels share the same types.
#pragma once
#include "kernels/error.h"
