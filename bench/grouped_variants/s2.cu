// Decode, operands swapped: 128 weight columns x 32 tokens x 128, cooperative, clusters of one.
#include "variant.cuh"

VARIANT(s2, 128, 32, 128, 1, 1, false, true)
