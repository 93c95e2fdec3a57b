// rewind/error.h: the exception hierarchy.
//
// Every error rewind reports is a rwd::Error, allocation failures included
// (a refused allocation is a CapacityError, never std::bad_alloc). Messages
// say what was asked, what is allowed, and where (which layer, which
// argument). An operation that throws leaves the cache exactly as it was
// before the call.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace rwd {

// Base of every exception thrown by rewind.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A tensor argument has the wrong rank, shape, dtype, batch size or stride,
// or an option / argument value is outside its allowed range.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A layer, state or side-tensor index is out of range.
class IndexError : public Error {
 public:
  using Error::Error;
};

// A static layer, the memory budget or the system cannot hold what was
// asked, or a size passes rewind's limits (2^48 bytes per buffer, 2^40
// tokens per sequence).
class CapacityError : public Error {
 public:
  using Error::Error;
};

// A crop the layer cannot perform exactly: too deep, not recording, or a
// positive (legacy) crop on a layer that cannot keep a prefix.
class RollbackError : public Error {
 public:
  using Error::Error;
};

// The operation is not valid in the current state (an operation that needs
// the parts of a layer in step while one part was updated ahead of another,
// a method that does not apply to this layer kind, a stale handle).
class StateError : public Error {
 public:
  using Error::Error;
};

// A model file or configuration is malformed (used by the runtime).
class FormatError : public Error {
 public:
  using Error::Error;
};

// A snapshot store (memory, directory, Redis) cannot be reached or read, or
// refused a request (rewind/store.h). Callers that can recompute what a
// store holds (the prefix cache) treat it as a miss.
class StoreError : public Error {
 public:
  using Error::Error;
};

}  // namespace rwd
