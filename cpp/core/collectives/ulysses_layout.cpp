// The Ulysses all-to-all's block geometry (uniep/collectives.hpp), shared by both executors so
// that the CPU tests check the strides the CUDA copies use.
#include <cstring>

#include "uniep/collectives.hpp"
#include "uniep/status.hpp"

namespace uniep {
namespace {

int64_t product(const std::vector<int64_t>& shape, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t d = from; d < to; ++d) p *= shape[d];
  return p;
}

// The slice [p * n, (p + 1) * n) along `dim` of a contiguous tensor of `shape`, for every p.
StridedBlocks slices(const std::vector<int64_t>& shape, size_t dim, int64_t n, int64_t world,
                     int64_t element_bytes) {
  const int64_t inner = product(shape, dim + 1, shape.size()) * element_bytes;
  StridedBlocks b;
  b.rows = product(shape, 0, dim);
  b.row_bytes = n * inner;
  b.pitch = world * n * inner;
  b.block_stride = n * inner;
  return b;
}

void copy_rows(uint8_t* dst, int64_t dpitch, const uint8_t* src, int64_t spitch, int64_t width,
               int64_t rows) {
  if (width == 0) return;
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(dst + i * dpitch, src + i * spitch, static_cast<size_t>(width));
}

}  // namespace

UlyssesLayout ulysses_layout(const std::vector<int64_t>& shape, int64_t scatter_dim,
                             int64_t gather_dim, int64_t world_size, int64_t element_bytes) {
  const auto dims = static_cast<int64_t>(shape.size());
  UNIEP_CHECK(dims >= 2, "x must have at least 2 dimensions, got ", dims);
  UNIEP_CHECK(scatter_dim >= 0 && scatter_dim < dims, "scatter_dim must be in [0, ", dims,
              "), got ", scatter_dim);
  UNIEP_CHECK(gather_dim >= 0 && gather_dim < dims, "gather_dim must be in [0, ", dims, "), got ",
              gather_dim);
  UNIEP_CHECK(scatter_dim != gather_dim,
              "scatter_dim and gather_dim must differ, both are dimension ", scatter_dim);
  UNIEP_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  UNIEP_CHECK(element_bytes >= 1, "element_bytes must be >= 1, got ", element_bytes);
  for (int64_t d = 0; d < dims; ++d)
    UNIEP_CHECK(shape[d] >= 0, "x's sizes must be >= 0, got ", shape[d], " in dimension ", d);
  const auto s = static_cast<size_t>(scatter_dim), g = static_cast<size_t>(gather_dim);
  UNIEP_CHECK(shape[s] % world_size == 0, "x.size(scatter_dim = ", scatter_dim, ") (", shape[s],
              ") must be divisible by the world size ", world_size);
  UlyssesLayout l;
  l.out_shape = shape;
  l.out_shape[s] = shape[s] / world_size;
  l.out_shape[g] = shape[g] * world_size;
  l.send = slices(shape, s, shape[s] / world_size, world_size, element_bytes);
  l.recv = slices(l.out_shape, g, shape[g], world_size, element_bytes);
  l.block_bytes = l.send.rows * l.send.row_bytes;
  UNIEP_CHECK_CODE(l.block_bytes == l.recv.rows * l.recv.row_bytes, StatusCode::kInternal,
                   "ulysses_layout: send and receive blocks differ in size (", l.block_bytes,
                   " and ", l.recv.rows * l.recv.row_bytes, " bytes)");
  return l;
}

void pack_blocks(const StridedBlocks& blocks, int64_t world_size, const void* tensor,
                 void* packed) {
  const auto* src = static_cast<const uint8_t*>(tensor);
  auto* dst = static_cast<uint8_t*>(packed);
  const int64_t block = blocks.rows * blocks.row_bytes;
  for (int64_t p = 0; p < world_size; ++p)
    copy_rows(dst + p * block, blocks.row_bytes, src + p * blocks.block_stride, blocks.pitch,
              blocks.row_bytes, blocks.rows);
}

void unpack_blocks(const StridedBlocks& blocks, int64_t world_size, const void* packed,
                   void* tensor) {
  const auto* src = static_cast<const uint8_t*>(packed);
  auto* dst = static_cast<uint8_t*>(tensor);
  const int64_t block = blocks.rows * blocks.row_bytes;
  for (int64_t p = 0; p < world_size; ++p)
    copy_rows(dst + p * blocks.block_stride, blocks.pitch, src + p * block, blocks.row_bytes,
              blocks.row_bytes, blocks.rows);
}

}  // namespace uniep
