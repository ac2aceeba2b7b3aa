// 64 x 256 x 64 ping-pong, clusters of two along N: A multicast, no rounding along M.
#include "variant.cuh"

VARIANT(g2, 64, 256, 64, 1, 2, true)
