// 128 x 256 x 64 cooperative, clusters of two along M: the engine's coop_128x256x64.
#include "variant.cuh"

VARIANT(g3, 128, 256, 64, 2, 1, false)
