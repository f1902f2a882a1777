// The int8 wire's block loops for AVX-512 (compiled with -mavx512f -mavx512bw, without FMA; chosen at run time).
#define SHARDOPT_INT8_NS int8_avx512
#include "comm/int8_kernels.inc"
