// Decode, operands swapped: 64 weight columns x 32 tokens x 64, ping-pong, clusters of one.
#include "variant.cuh"

VARIANT(s3, 64, 32, 64, 1, 1, true, true)
