// Decode, operands swapped (d^T = w^T x^T): 128 weight columns x 16 tokens x 128, cooperative,
// clusters of one.
#include "variant.cuh"

VARIANT(s0, 128, 16, 128, 1, 1, false, true)
