// 64 x 128 x 128 ping-pong, clusters of one: deeper k-blocks, twice the tiles along N.
#include "variant.cuh"

VARIANT(g6, 64, 128, 128, 1, 1, true)
