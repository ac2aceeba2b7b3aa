// 128x256 tile, 2x1 cluster, cooperative: the kernel cpp/cuda/gemm ships.
#include "variant.cuh"

VARIANT(v0, 128, 256, 2, 1, Coop)
