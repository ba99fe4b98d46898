// core/error.h — the exceptions tally throws: Error, ShapeError, FormatError (OutOfMemory, with
// its byte counts, in core/arena.h).
//
// Nothing in tally aborts the process on bad input: every check throws one of these with a
// message that names the operation, what was expected and what was found. This header depends
// on nothing but the standard library, so it is the one header of core/ that kernels/ include as
// well: kernels, core and everything built on them throw and catch the same types.
#pragma once
#include <stdexcept>
#include <string>

namespace tally {

// Base of every tally exception.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Shapes, dtypes or devices of operands do not fit an operation.
class ShapeError : public Error {
  using Error::Error;
};

// A file (checkpoint, data set, fixture) is malformed or truncated.
class FormatError : public Error {
  using Error::Error;
};

// An arena could not satisfy a request; defined with its details in core/arena.h.
class OutOfMemory;

}  // namespace tally
