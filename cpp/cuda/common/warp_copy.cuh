// Row copies by one warp, with several 16-byte loads in flight per lane before the stores: a
// plain load-store loop keeps one load per lane outstanding and is latency-bound (a 14 KB row
// then takes ~30 round trips). The destination may be a peer's memory mapped over NVLink.
#pragma once

#include <cstdint>

namespace uniep::cuda {

__device__ __forceinline__ int4 load_streaming(const int4* p) {
  int4 v;
  // Read once: do not keep the source rows in L1.
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// bytes must be a multiple of 16 and both pointers 16-byte aligned. The tail is unrolled too
// (guarded), so any length costs ceil(bytes / (512 * kUnroll)) round trips.
template <int kUnroll = 4>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int64_t bytes, int lane) {
  const int4* s = static_cast<const int4*>(src);
  int4* d = static_cast<int4*>(dst);
  const int64_t n = bytes / 16;
  for (int64_t i = lane; i < n; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < n) v[u] = load_streaming(s + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < n) d[i + 32 * u] = v[u];
  }
}

// Up to 32 rows of `pieces` 16-byte pieces each, copied as one flat run: lane j < n holds row
// j's source and destination. One warp's share of a send is bound by the bytes it keeps in
// flight, and rows copied one at a time leave most of the unroll idle on short rows (a 4 KB row
// fills half of 16 x 512 bytes) and pay a round trip per row.
template <int kUnroll>
__device__ __forceinline__ void warp_copy_rows(const int4* src, int4* dst, int n, int pieces,
                                               int lane) {
  const int total = n * pieces;
  for (int base = 0; base < total; base += 32 * kUnroll) {
    int4 v[kUnroll];
    const int j0 = (base + lane) / pieces, p0 = base + lane - j0 * pieces;
    int j = j0, p = p0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Every lane shuffles (the source lane varies by lane); only pieces in range load.
      const auto* s = reinterpret_cast<const int4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(src), j < 32 ? j : 31));
      if (j < n) v[u] = load_streaming(s + p);
      for (p += 32; p >= pieces; p -= pieces) ++j;
    }
    j = j0;
    p = p0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      auto* d = reinterpret_cast<int4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(dst), j < 32 ? j : 31));
      if (j < n) d[p] = v[u];
      for (p += 32; p >= pieces; p -= pieces) ++j;
    }
  }
}

// Rows split into `segments` pieces (16-byte aligned) so that several warps share a row: a
// decode batch has a few rows per block, and one warp per row leaves the row's reads (scattered
// in a large buffer, so HBM and TLB latency) in a chain of round trips.
struct RowSegment {
  int64_t offset, bytes;
};
__device__ __forceinline__ RowSegment row_segment(int64_t row_bytes, int segments, int seg) {
  const int64_t vecs = row_bytes / 16, per = (vecs + segments - 1) / segments;
  const int64_t first = per * seg < vecs ? per * seg : vecs;
  const int64_t last = first + per < vecs ? first + per : vecs;
  return {first * 16, (last - first) * 16};
}

// The same copy to several destinations (a token bound for several ranks): each source vector
// is read once.
template <int kUnroll = 4>
__device__ __forceinline__ void warp_copy_multi(void* const* dsts, int num_dsts, const void* src,
                                                int64_t bytes, int lane) {
  const int4* s = static_cast<const int4*>(src);
  const int64_t n = bytes / 16;
  int64_t i = lane;
  for (; i + 32 * (kUnroll - 1) < n; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_streaming(s + i + 32 * u);
    for (int j = 0; j < num_dsts; ++j) {
      int4* d = static_cast<int4*>(dsts[j]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + 32 * u] = v[u];
    }
  }
  for (; i < n; i += 32) {
    const int4 v = load_streaming(s + i);
    for (int j = 0; j < num_dsts; ++j) static_cast<int4*>(dsts[j])[i] = v;
  }
}

}  // namespace uniep::cuda
