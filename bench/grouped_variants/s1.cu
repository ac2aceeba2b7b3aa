// Decode, operands swapped: 64 weight columns x 16 tokens x 128, ping-pong, clusters of one.
#include "variant.cuh"

VARIANT(s1, 64, 16, 128, 1, 1, true, true)
