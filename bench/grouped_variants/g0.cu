// 64 x 256 x 64 ping-pong, clusters of two along M: the engine's pingpong_64x256x64, its choice on
// both loads.
#include "variant.cuh"

VARIANT(g0, 64, 256, 64, 2, 1, true)
