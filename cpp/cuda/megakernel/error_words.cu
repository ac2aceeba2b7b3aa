// keep_first_errors (include/uniep/cuda/error_words.hpp): one warp per pair.
#include <cuda_runtime.h>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/error_words.hpp"

namespace uniep::cuda {
namespace {

struct Pairs {
  ErrorWordPair pair[kMaxErrorWordPairs];
};

template <class T>
__device__ void keep_first(const ErrorWordPair& p) {
  T* sticky = static_cast<T*>(p.sticky);
  const T* word = static_cast<const T*>(p.word);
  // Every lane reads the first element before any lane writes it.
  const bool empty = sticky[0] == 0;
  __syncwarp();
  if (!empty) return;
  for (int64_t i = threadIdx.x; i < p.numel; i += 32) sticky[i] = word[i];
}

__global__ void __launch_bounds__(32) keep_first_errors_kernel(Pairs pairs) {
  // Launched while the call's last kernel may still run: its words are read after this.
  wait_for_prior_grid();
  allow_next_grid();
  const ErrorWordPair& p = pairs.pair[blockIdx.x];
  if (p.elem_bytes == 8)
    keep_first<unsigned long long>(p);
  else
    keep_first<unsigned int>(p);
}

}  // namespace

Status keep_first_errors(const ErrorWordPair* pairs, int count, cudaStream_t stream) {
  if (count < 0 || (count > 0 && pairs == nullptr))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("keep_first_errors: count must be >= 0 with pairs given, got ", count)};
  for (int i = 0; i < count; ++i) {
    const ErrorWordPair& p = pairs[i];
    if (p.sticky == nullptr || p.word == nullptr || p.numel < 1 ||
        (p.elem_bytes != 4 && p.elem_bytes != 8))
      return {StatusCode::kInvalidArgument,
              detail::str_cat("keep_first_errors: pair ", i,
                              " needs non-null sticky and word, numel >= 1 and elem_bytes 4 or 8, "
                              "got numel ",
                              p.numel, " and elem_bytes ", p.elem_bytes)};
  }
  for (int first = 0; first < count; first += kMaxErrorWordPairs) {
    const int n = count - first < kMaxErrorWordPairs ? count - first : kMaxErrorWordPairs;
    Pairs batch{};
    for (int i = 0; i < n; ++i) batch.pair[i] = pairs[first + i];
    (void)launch_after_prior(keep_first_errors_kernel, dim3(n), dim3(32), 0, stream, batch);
    if (Status s = launch_status("keep_first_errors"); !s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace uniep::cuda
