// 128 x 128 x 64 cooperative, clusters of one.
#include "variant.cuh"

VARIANT(g7, 128, 128, 64, 1, 1, false)
