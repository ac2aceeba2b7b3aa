// 128x256 tile, no cluster, cooperative.
#include "variant.cuh"

VARIANT(v9, 128, 256, 1, 1, Coop)
