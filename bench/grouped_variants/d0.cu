// Decode, as the engine: 64 x 128 x 64 ping-pong, clusters of one (the MegaKernel's decode tile).
#include "variant.cuh"

VARIANT(d0, 64, 128, 64, 1, 1, true)
