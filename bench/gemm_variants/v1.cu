// 256x128 tile, 1x2 cluster, cooperative (cuBLAS's nvjet tile, transposed).
#include "variant.cuh"

VARIANT(v1, 256, 128, 1, 2, Coop)
