// 128 x 256 x 64 cooperative, clusters of two along N.
#include "variant.cuh"

VARIANT(g4, 128, 256, 64, 1, 2, false)
