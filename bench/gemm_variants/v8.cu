// v1 without a source operand (C = void).
#include "variant.cuh"

VARIANT(v8, 256, 128, 1, 2, Coop, void)
