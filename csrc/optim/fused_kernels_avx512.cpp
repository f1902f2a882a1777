// The fused step's loops for AVX-512 (compiled with -mavx512f/bw/vl/dq -mfma; chosen at run time).
#define SHARDOPT_KERNELS_NS kernels_avx512
#include "optim/fused_kernels.inc"
