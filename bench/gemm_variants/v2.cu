// 256x128 tile, 2x1 cluster, cooperative.
#include "variant.cuh"

VARIANT(v2, 256, 128, 2, 1, Coop)
