// The unified tuning space: every overlap strategy is one point of it.
#pragma once

#include <cstdint>
#include <string>

namespace uniep {

enum class OverlapMode { kSequential, kChunked, kFused };
enum class DispatchPrecision { kBf16, kFp8E4M3 };

const char* overlap_mode_name(OverlapMode mode);
const char* dispatch_precision_name(DispatchPrecision precision);

// Printed and parsed as "sms=24/132,token_tile=64,tile_m=128,...". Keys may appear in any order
// and any subset; missing keys keep their defaults. None of these changes the output bits except
// `dispatch` (fp8 quantises what crosses the wire), which is a numerics choice, not a schedule.
struct TuningParams {
  int comm_sms = 24;    // SMs given to dispatch/combine roles
  int total_sms = 0;    // 0: all SMs of the device
  int token_tile = 64;  // tokens per dispatch tile (one signal per tile)
  int tile_m = 128;     // GEMM tile rows
  int tile_n = 128;     // GEMM tile cols
  int tile_k = 64;      // GEMM k-step
  int stages = 2;       // pipeline depth (buffers in flight per role)
  OverlapMode overlap = OverlapMode::kFused;
  DispatchPrecision dispatch = DispatchPrecision::kBf16;

  std::string to_string() const;
  // Throws uniep::Error naming the key and the expected values.
  static TuningParams parse(const std::string& text);
  void validate() const;

  bool operator==(const TuningParams& o) const;
  bool operator!=(const TuningParams& o) const { return !(*this == o); }
};

}  // namespace uniep
