// Device error words kept across CUDA-graph replays. A call captured in a graph cannot read its
// error words on the host; with check="deferred" each word is folded into a sticky word that
// keeps the first error of any replay until the host reads it (uniep.moe.megakernel.launch,
// check_errors). Folding every word of a call in one launch keeps that bookkeeping to one small
// kernel per step.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "uniep/status.hpp"

namespace uniep::cuda {

// One error word (device memory, numel elements of elem_bytes: 4 or 8) and the sticky word that
// keeps it: the sticky word takes the word's elements where its own first element is 0 (no
// error kept yet), and is left as it is otherwise.
struct ErrorWordPair {
  void* sticky = nullptr;
  const void* word = nullptr;
  int64_t numel = 0;
  int elem_bytes = 8;
};

// Every pair of `pairs` (a host array of `count`) kept in one launch on `stream` (one more per
// kMaxErrorWordPairs pairs); no host sync. kInvalidArgument naming the pair on a null pointer,
// numel below 1 or elem_bytes other than 4 and 8; nothing is launched for count 0.
constexpr int kMaxErrorWordPairs = 16;
Status keep_first_errors(const ErrorWordPair* pairs, int count, cudaStream_t stream);

}  // namespace uniep::cuda
