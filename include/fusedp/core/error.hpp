#pragma once
// Exceptions that carry their context: what was attempted, on what, and why it failed.
#include "fusedp/core/config.hpp"

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace fusedp {

/// Base of every exception fusedp throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A value passed by the caller is out of range or inconsistent (batch size, label, flag value).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A loss or gradient was NaN or infinite and the policy was to stop.
class NumericError : public Error {
 public:
  using Error::Error;
};

/// A file could not be read or does not hold what it should. `path()` names the file.
class DataError : public Error {
 public:
  DataError(std::string path, const std::string& problem)
      : Error(path + ": " + problem), path_(std::move(path)) {}
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

/// A CUDA, NCCL or MPI call failed. Carries the call's text, its numeric code and the rank.
class DeviceError : public Error {
 public:
  DeviceError(std::string call, int code, const std::string& message, int rank = -1)
      : Error(format(call, code, message, rank)), call_(std::move(call)), message_(message), code_(code), rank_(rank) {}
  [[nodiscard]] const std::string& call() const noexcept { return call_; }
  /// What went wrong, without the call, code and rank that what() puts before it.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  [[nodiscard]] int code() const noexcept { return code_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }

 private:
  static std::string format(const std::string& call, int code, const std::string& message, int rank) {
    std::ostringstream s;
    if (rank >= 0) s << "rank " << rank << ": ";
    s << call << " failed with code " << code << ": " << message;
    return s.str();
  }
  std::string call_;
  std::string message_;
  int code_;
  int rank_;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}
}  // namespace detail

/// Throws E with the message made of `parts` when `condition` is false.
template <class E = InvalidArgument, class... Parts>
void require(bool condition, const Parts&... parts) {
  if (!condition) throw E(detail::concat(parts...));
}

}  // namespace fusedp
