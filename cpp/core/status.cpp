#include "uniep/status.hpp"

namespace uniep {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kCapacityExceeded:
      return "capacity exceeded";
    case StatusCode::kTimeout:
      return "timeout";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kInternal:
      return "internal error";
  }
  return "unknown";
}

}  // namespace uniep
