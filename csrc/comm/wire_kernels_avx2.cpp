// The compressed wires' loops for AVX2 (compiled with -mavx2, without FMA; chosen at run time).
#define SHARDOPT_WIRE_NS wire_avx2
#include "comm/wire_kernels.inc"
