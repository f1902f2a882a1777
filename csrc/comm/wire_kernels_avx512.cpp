// The compressed wires' loops for AVX-512 (compiled with -mavx512f -mavx512bw, without FMA;
// chosen at run time).
#define SHARDOPT_WIRE_NS wire_avx512
#include "comm/wire_kernels.inc"
