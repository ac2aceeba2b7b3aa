// Launch shape of the low-latency kernels (dispatch/ll_dispatch.cu, combine/ll_combine.cu). A
// block carries one (expert, source) region's rows: a few on average (T * K / E), so a few
// warps. Small blocks under a register cap keep every block of the grid resident at once: with
// 512 threads and 128 registers a block filled an SM, and 288 experts ran in three waves (the
// receive-side waits of the first wave then held SMs while the senders of the later waves
// queued).
#pragma once

namespace uniep::cuda {

constexpr int kLlThreads = 256;
constexpr int kLlWarps = kLlThreads / 32;
constexpr int kLlMinBlocksPerSm = 3;
constexpr int kLlSegments = 4;  // warps sharing one row (see row_segment)
constexpr int kLlUnroll = 8;    // 16-byte loads in flight per lane: up to 4 KB per warp per trip

}  // namespace uniep::cuda
