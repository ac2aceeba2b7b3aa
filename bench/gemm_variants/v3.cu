// 128x256 tile, 1x2 cluster, cooperative.
#include "variant.cuh"

VARIANT(v3, 128, 256, 1, 2, Coop)
