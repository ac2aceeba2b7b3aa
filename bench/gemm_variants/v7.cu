// v0 without a source operand (C = void).
#include "variant.cuh"

VARIANT(v7, 128, 256, 2, 1, Coop, void)
