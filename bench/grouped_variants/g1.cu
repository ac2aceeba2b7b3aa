// 64 x 256 x 64 ping-pong, clusters of one: no expert rounded to two tiles, B not multicast.
#include "variant.cuh"

VARIANT(g1, 64, 256, 64, 1, 1, true)
