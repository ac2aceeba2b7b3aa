// 64x256 tile, 2x1 cluster, ping-pong.
#include "variant.cuh"

VARIANT(v6, 64, 256, 2, 1, Pingpong)
