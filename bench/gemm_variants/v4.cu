// 128x128 tile, 1x2 cluster, ping-pong.
#include "variant.cuh"

VARIANT(v4, 128, 128, 1, 2, Pingpong)
