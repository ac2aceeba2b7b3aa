// Errors and status codes shared by every UniEP entry point.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace uniep {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // caller passed something malformed; the message names the argument
  kCapacityExceeded,  // a receive buffer would overflow; never silently dropped
  kTimeout,           // a device-side wait gave up; the message names the peer
  kUnsupported,       // valid request this build or executor cannot serve
  kInternal,
};

const char* status_code_name(StatusCode code);

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
};

// Thrown by the C++ API; the Python bindings map kInvalidArgument to ValueError.
class Error : public std::runtime_error {
 public:
  Error(StatusCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  StatusCode code() const { return code_; }
  Status status() const { return {code_, what()}; }

 private:
  StatusCode code_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& value, const Rest&... rest) {
  os << value;
  append(os, rest...);
}
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
}
}  // namespace detail

}  // namespace uniep

// UNIEP_CHECK(cond, "topk_idx must be int64, got ", dtype): message names the argument first.
#define UNIEP_CHECK_CODE(cond, code, ...)                                  \
  do {                                                                     \
    if (!(cond)) {                                                         \
      throw ::uniep::Error((code), ::uniep::detail::str_cat(__VA_ARGS__)); \
    }                                                                      \
  } while (0)
#define UNIEP_CHECK(cond, ...) \
  UNIEP_CHECK_CODE(cond, ::uniep::StatusCode::kInvalidArgument, __VA_ARGS__)
