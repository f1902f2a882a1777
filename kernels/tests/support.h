// What the kernel tests share: the device check every test starts with, device arrays, CPU
// references of the kernels' math (the operations of csrc/optim/fused_kernels.inc, in its order),
// bf16 / fp16 rounding, random data and comparisons.
#pragma once

#include <shardopt_kernels/adamw.h>
#include <shardopt_kernels/sgd.h>
#include <shardopt_kernels/status.h>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace shardopt_kernels_test {

// ---- the device ------------------------------------------------------------------------------------

// Called by each test, never before main: the binary lists its tests on machines without a GPU.
inline bool cuda_device_present() {
  int count = 0;
  const bool present = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  if (!present) cudaGetLastError();
  return present;
}

// Every kernel test derives from this: skipped without a device, with a stream of its own otherwise.
class KernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_present()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

inline ::testing::AssertionResult cuda_ok(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << call << ": " << cudaGetErrorString(error);
}

inline ::testing::AssertionResult kernel_ok(shardopt_kernel_status status, const char* call) {
  if (status == SHARDOPT_KERNEL_OK) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure() << call << ": " << shardopt_kernel_status_string(status);
  if (status == SHARDOPT_KERNEL_CUDA_ERROR) {
    failure << " (" << cudaGetErrorString(static_cast<cudaError_t>(shardopt_kernel_last_cuda_error())) << ")";
  }
  return failure;
}

#define ASSERT_CUDA(call) ASSERT_TRUE(::shardopt_kernels_test::cuda_ok((call), #call))
#define ASSERT_KERNEL_OK(call) ASSERT_TRUE(::shardopt_kernels_test::kernel_ok((call), #call))

// `count` elements of T on the device, starting `offset` elements into a cudaMalloc'ed (256-byte
// aligned) allocation: offset 1 gives the misaligned pointer of a shard at an odd element.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (base_ != nullptr) cudaFree(base_);
  }

  cudaError_t allocate(size_t count, size_t offset = 0) {
    count_ = count;
    offset_ = offset;
    return cudaMalloc(reinterpret_cast<void**>(&base_), (count + offset) * sizeof(T));
  }
  cudaError_t upload(const std::vector<T>& host) {
    return cudaMemcpy(data(), host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t allocate_and_upload(const std::vector<T>& host, size_t offset) {
    const cudaError_t error = allocate(host.size(), offset);
    return error != cudaSuccess ? error : upload(host);
  }
  cudaError_t download(std::vector<T>& host) const {
    host.resize(count_);
    return cudaMemcpy(host.data(), data(), count_ * sizeof(T), cudaMemcpyDeviceToHost);
  }
  T* data() const { return base_ + offset_; }

 private:
  T* base_ = nullptr;
  size_t count_ = 0, offset_ = 0;
};

// AdamW at lr 1e-2, weight decay 0.05, step 1: what the AdamW kernel tests start from.
inline shardopt_adamw_hparams adamw_hparams() {
  shardopt_adamw_hparams h{};
  h.lr = 1e-2;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = 0.05;
  h.step = 1;
  h.decoupled = 1;
  return h;
}

// ---- bf16 and fp16 on the host (bit patterns in uint16_t) -------------------------------------------

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

inline uint16_t bf16_round(float x) {
  const uint32_t b = bits_of(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline uint16_t fp16_round(float x) {
  const uint32_t b = bits_of(x);
  const uint32_t sign = (b >> 16) & 0x8000u, magnitude = b & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);           // NaN
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);          // rounds past 65504
  if (magnitude >= 0x38800000u) {                                                      // normal: rebias 127 -> 15
    const uint32_t r = magnitude - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  // Subnormal (or zero): whole multiples of 2^-24, rounded to nearest even; 1024 is the smallest normal.
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(std::fabs(x) * 16777216.0f)));
}
inline float fp16_value(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  if (exponent == 31) return mantissa != 0 ? std::nanf("") : sign * INFINITY;
  return sign * std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
}

inline uint16_t round_to(shardopt_kernel_dtype dtype, float x) {
  return dtype == SHARDOPT_KERNEL_BFLOAT16 ? bf16_round(x) : fp16_round(x);
}
inline float value_of(shardopt_kernel_dtype dtype, uint16_t h) {
  return dtype == SHARDOPT_KERNEL_BFLOAT16 ? bf16_value(h) : fp16_value(h);
}

// ---- CPU references ---------------------------------------------------------------------------------
// The test target is compiled with -ffp-contract=off: each * and + below rounds on its own.

// The gradient as the step sees it: unscaled, then negated to maximize.
inline float effective_grad(float g, const float* inv_scale, bool maximize) {
  if (inv_scale != nullptr) g = g * *inv_scale;
  return maximize ? -g : g;
}

struct AdamReference {
  explicit AdamReference(const shardopt_adamw_hparams& h) : h_(h) {
    const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
    const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
    b1 = static_cast<float>(h.beta1);
    one_minus_b1 = static_cast<float>(1 - h.beta1);
    b2 = static_cast<float>(h.beta2);
    one_minus_b2 = static_cast<float>(1 - h.beta2);
    wd = static_cast<float>(h.weight_decay);
    decay = static_cast<float>(1 - h.lr * h.weight_decay);
    inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
    eps = static_cast<float>(h.eps);
    neg_step = static_cast<float>(-(h.lr / bc1));
  }

  // fused_kernels.inc's adam_impl, one element at a time.
  void step(float& p, float g, float& m, float& v, float& vmax) const {
    if (h_.weight_decay != 0) {
      if (h_.decoupled) {
        p = p * decay;
      } else {
        g = std::fma(p, wd, g);
      }
    }
    m = std::fma(g, one_minus_b1, m * b1);
    v = v * b2;
    v = v + one_minus_b2 * g * g;
    float denom;
    if (h_.amsgrad) {
      vmax = (std::isnan(vmax) || std::isnan(v)) ? NAN : std::max(vmax, v);
      denom = std::fma(std::sqrt(vmax), inv_sqrt_bc2, eps);
    } else {
      denom = std::fma(std::sqrt(v), inv_sqrt_bc2, eps);
    }
    p = p + neg_step * m / denom;
  }

  shardopt_adamw_hparams h_;
  float b1, one_minus_b1, b2, one_minus_b2, wd, decay, inv_sqrt_bc2, eps, neg_step;
};

struct SgdReference {
  explicit SgdReference(const shardopt_sgd_hparams& h)
      : h_(h),
        wd(static_cast<float>(h.weight_decay)),
        mom(static_cast<float>(h.momentum)),
        keep(static_cast<float>(1 - h.dampening)),
        neg_lr(static_cast<float>(-h.lr)) {}

  // fused_kernels.inc's sgd_impl, one element at a time; buf is null without momentum.
  void step(float& p, float g, float* buf) const {
    float d = g;
    if (h_.weight_decay != 0) d = std::fma(p, wd, d);
    if (buf != nullptr) {
      const float b = h_.first_step ? d : std::fma(d, keep, *buf * mom);
      *buf = b;
      d = h_.nesterov ? std::fma(b, mom, d) : b;
    }
    p = std::fma(d, neg_lr, p);
  }

  shardopt_sgd_hparams h_;
  float wd, mom, keep, neg_lr;
};

// ---- data and comparisons --------------------------------------------------------------------------

inline std::vector<float> random_floats(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

inline bool close_to(float got, float want, double rel) {
  if (std::isnan(got) || std::isnan(want)) return std::isnan(got) && std::isnan(want);
  if (got == want) return true;
  return std::fabs(static_cast<double>(got) - want) <= rel * std::max(std::fabs(got), std::fabs(want));
}

// Every element within `rel` (relative) of the reference; on failure, the first mismatch and how many.
inline ::testing::AssertionResult all_close(const char* what, const std::vector<float>& got,
                                            const std::vector<float>& want, double rel = 1e-6) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!close_to(got[i], want[i], rel) && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " elements differ; first at "
                                       << first << ": " << got[first] << " against " << want[first];
}

template <class T>
::testing::AssertionResult same_bits(const char* what, const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << what << ": element " << i << " of " << got.size() << " changed";
    }
  }
  return ::testing::AssertionSuccess();
}

// Where each buffer of a step starts: all at one offset (vectors after a head of single elements,
// or vectors throughout), or at different offsets (no common alignment: single elements).
enum class Layout { kAligned, kShifted, kMismatched };

inline size_t offset_of(Layout layout, int buffer) {
  switch (layout) {
    case Layout::kAligned: return 0;
    case Layout::kShifted: return 1;
    case Layout::kMismatched: return buffer == 0 ? 1 : 0;
  }
  return 0;
}

inline const char* name_of(Layout layout) {
  switch (layout) {
    case Layout::kAligned: return "aligned";
    case Layout::kShifted: return "shifted";
    case Layout::kMismatched: return "mismatched";
  }
  return "?";
}

}  // namespace shardopt_kernels_test
