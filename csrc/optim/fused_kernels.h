// The fused step's math over a list of contiguous tensors, built three times: for any x86-64 CPU, for
// AVX2 + FMA and for AVX-512 (chosen at run time, as ATen chooses its own kernels). Internal to
// csrc/optim.
#pragma once

#include <cstdint>
#include <cstddef>
#include <functional>
#include <vector>

namespace shardopt::detail {

// The per-step constants of Adam/AdamW parameters with the same options and step count.
struct AdamScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled = false;  // AdamW: p *= 1 - lr * wd before the update; Adam: g += wd * p
  bool amsgrad = false;
  double sqrt_bias_correction2 = 1, step_size = 0;
  // The gradient scaler's unscale, folded in (Note [Unscaling in the step] in fused_step.cpp): the
  // gradient is multiplied by inv_scale as it is read (1: as it is). On CUDA the kernels read it,
  // and found_inf (nonzero: write nothing), from device memory instead (null: none).
  double inv_scale = 1;
  const float* device_inv_scale = nullptr;
  const float* device_found_inf = nullptr;
};

struct SgdScalars {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  bool first = false;  // the momentum buffer starts as the (decayed) gradient
  double inv_scale = 1;  // as in AdamScalars
  const float* device_inv_scale = nullptr;
  const float* device_found_inf = nullptr;
};

// One tensor's memory for a step: the parameter, its gradient and its state, each contiguous
// with `n` elements. `vmax` may be null without AMSGrad, `buf` without momentum.
template <class T>
struct AdamSegment {
  T* p;
  const T* g;
  T* m;
  T* v;
  T* vmax;
  int64_t n;
};
template <class T>
struct SgdSegment {
  T* p;
  const T* g;
  T* buf;
  int64_t n;
};

// One tensor's memory for a step on 8-bit state (Note [8-bit state] in state_codes.cpp): the fp32
// parameter and gradient (`n` elements), and each state tensor as codes (one byte per element)
// and scales (one per kStateBlock elements from the segment's start, which is a block boundary of
// the whole tensor). `vmax` may be null without AMSGrad.
struct Adam8Segment {
  float* p;
  const float* g;
  uint8_t* m;
  float* m_scale;
  uint8_t* v;
  float* v_scale;
  uint8_t* vmax;
  float* vmax_scale;
  int64_t n;
};
struct Sgd8Segment {
  float* p;
  const float* g;
  uint8_t* buf;
  float* buf_scale;
  int64_t n;
};

// One tensor's memory for a step on bf16 state (OSSOptions::state_format(StateFormat::kBFloat16)):
// the fp32 parameter and gradient, and each state tensor as bf16 bits, `n` elements each. Each
// block of kStateBlock elements is widened to fp32, stepped as on fp32 state, and rounded back to
// nearest even. `vmax` may be null without AMSGrad, `buf` without momentum.
struct Adam16Segment {
  float* p;
  const float* g;
  uint16_t* m;
  uint16_t* v;
  uint16_t* vmax;
  int64_t n;
};
struct Sgd16Segment {
  float* p;
  const float* g;
  uint16_t* buf;
  int64_t n;
};

// One set per instruction set. Each call steps every segment of the list with the same scalars,
// in one parallel region (parallel_segments).
#define SHARDOPT_FUSED_KERNELS(ns)                                                    \
  namespace ns {                                                                      \
  void adam(const AdamSegment<float>* segments, size_t count, const AdamScalars& s);  \
  void adam(const AdamSegment<double>* segments, size_t count, const AdamScalars& s); \
  void sgd(const SgdSegment<float>* segments, size_t count, const SgdScalars& s);     \
  void sgd(const SgdSegment<double>* segments, size_t count, const SgdScalars& s);    \
  void adam8(const Adam8Segment* segments, size_t count, const AdamScalars& s);       \
  void sgd8(const Sgd8Segment* segments, size_t count, const SgdScalars& s);          \
  void adam16(const Adam16Segment* segments, size_t count, const AdamScalars& s);     \
  void sgd16(const Sgd16Segment* segments, size_t count, const SgdScalars& s);        \
  float quantise_block(const float* values, int64_t n, const float* map, uint8_t* codes); \
  void code_block(const float* values, int64_t n, float scale, const float* map, uint8_t* codes); \
  void decode_block(const uint8_t* codes, int64_t n, float scale, const float* map, float* values); \
  }
SHARDOPT_FUSED_KERNELS(kernels_default)
SHARDOPT_FUSED_KERNELS(kernels_avx2)
SHARDOPT_FUSED_KERNELS(kernels_avx512)
#undef SHARDOPT_FUSED_KERNELS

// The 8-bit loops of the widest build this CPU runs (cpu_kernel_level()).
void adam8_step(const Adam8Segment* segments, size_t count, const AdamScalars& s);
void sgd8_step(const Sgd8Segment* segments, size_t count, const SgdScalars& s);
// The bf16-state loops of that build.
void adam16_step(const Adam16Segment* segments, size_t count, const AdamScalars& s);
void sgd16_step(const Sgd16Segment* segments, size_t count, const SgdScalars& s);
// state_codes.h's quantise_block in that build (the same bits, a vector at a time).
float quantise_block_fast(const float* values, int64_t n, const float* map, uint8_t* codes);
// Its codes for a given scale: code_of(values[i] / scale) for each value, in that build.
void code_block_fast(const float* values, int64_t n, float scale, const float* map, uint8_t* codes);
// state_codes.h's dequantise_block in that build (the same bits).
void decode_block_fast(const uint8_t* codes, int64_t n, float scale, const float* map, float* values);

// Runs body(segment, begin, end) over the elements of every segment (sizes[segment] each) in one
// parallel region on LibTorch's intra-op threads (Note [The fused step's threads] in
// fused_step.cpp): each segment is cut into chunks of whole 64-element blocks from its start, and
// the threads take chunks in order until none is left. Waits for all.
void parallel_segments(const std::vector<int64_t>& sizes, int64_t grain,
                       const std::function<void(size_t, int64_t, int64_t)>& body);

// The widest build this CPU runs: 3 for AVX-512 with VBMI (the AVX-512 build, whose 8-bit decoder
// then permutes bytes), 2 for AVX-512 (F, BW, VL, DQ), 1 for AVX2 + FMA, 0 otherwise; the
// environment variable SHARDOPT_FUSED_KERNELS=default|avx2|avx512 caps it (read when the first OSS is built, or at the first use).
int cpu_kernel_level();
// Caps it at `level` from now on (to compare the builds); -1: as the environment says.
void cap_cpu_kernels(int level);

}  // namespace shardopt::detail
