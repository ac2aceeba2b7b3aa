// 128 x 256 x 64 cooperative, clusters of one.
#include "variant.cuh"

VARIANT(g5, 128, 256, 64, 1, 1, false)
