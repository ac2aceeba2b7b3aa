// The fp8 swapped tile of 16 rows by 128 output columns (SwapGemm, fp8_kernel.cuh): the weights'
// columns on the MMA's M side, an expert's few rows (decode) on its N side.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_swap_16x128x128() {
  static const Entry e = make_swap_entry<16>("fp8_swap_16x128x128");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
