// The int8 wire's block loops for AVX2 (compiled with -mavx2, without FMA; chosen at run time).
#define SHARDOPT_INT8_NS int8_avx2
#include "comm/int8_kernels.inc"
