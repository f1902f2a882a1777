// The fused step's loops for AVX2 + FMA (compiled with -mavx2 -mfma; chosen at run time).
#define SHARDOPT_KERNELS_NS kernels_avx2
#include "optim/fused_kernels.inc"
