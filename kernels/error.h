// kernels/error.h — the exceptions tally throws. Nothing in tally aborts the process on bad input:
// every check throws one of these with a message that names the operation, what was expected
// and what was found. They live at the bottom of the library (kernels/ depends on nothing above
// it) so that kernels, core and everything built on them share one type; core/error.h is the
// name the rest of tally and its users include.
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
