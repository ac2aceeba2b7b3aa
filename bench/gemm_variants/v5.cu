// 128x128 tile, 2x1 cluster, ping-pong.
#include "variant.cuh"

VARIANT(v5, 128, 128, 2, 1, Pingpong)
