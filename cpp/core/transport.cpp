#include <cstring>

#include "uniep/cpu_executor.hpp"
#include "uniep/status.hpp"

namespace uniep {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
  }
  return "?";
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

void LocalTransport::all_gather(const int64_t* in, int64_t n, int64_t* out) {
  if (n > 0) std::memcpy(out, in, n * sizeof(int64_t));
}

void LocalTransport::all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes,
                                uint8_t* recv, const std::vector<int64_t>& recv_bytes) {
  UNIEP_CHECK_CODE(
      send_bytes.size() == 1 && recv_bytes.size() == 1 && send_bytes[0] == recv_bytes[0],
      StatusCode::kInternal, "LocalTransport: mismatched all_to_all sizes");
  if (send_bytes[0] > 0) std::memcpy(recv, send, send_bytes[0]);
}

}  // namespace uniep
