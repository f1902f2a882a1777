// Shards of more than 2^31 elements: 64-bit indexing in the step and in the norm, with elements past
// 2^31 in the vector body and in the tail. Each test needs several GB of device memory and skips,
// naming the bytes, where cudaMalloc refuses them.
#include "support.h"

#include <shardopt_kernels/norm.h>

#include <memory>
#include <new>

namespace shardopt_kernels_test {
namespace {

constexpr int64_t kLarge = (int64_t{1} << 31) + 17;

// Allocates `count` elements at `offset`, or skips the test naming the bytes it needed.
#define ALLOCATE_OR_SKIP(array, count, offset, total_bytes)                                                  \
  do {                                                                                                       \
    const cudaError_t allocated_ = (array).allocate((count), (offset));                                      \
    if (allocated_ == cudaErrorMemoryAllocation) {                                                           \
      cudaGetLastError();                                                                                    \
      GTEST_SKIP() << "needs " << (total_bytes) << " bytes of device memory: cudaMalloc refused "           \
                   << ((count) + (offset)) * sizeof(*(array).data()) << " bytes";                            \
    }                                                                                                        \
    ASSERT_CUDA(allocated_);                                                                                 \
  } while (0)

// Values from the index, recomputed on the host when checking; counters instead of divisions.
struct Pattern {
  uint32_t a = 0, b = 0;
  float param() const { return static_cast<float>(a) * 1e-6f - 0.5f; }
  float grad() const { return static_cast<float>(b) * 1e-5f - 0.3f; }
  void next() {
    a = a + 1 == 1000003 ? 0 : a + 1;
    b = b + 7 >= 65537 ? b + 7 - 65537 : b + 7;
  }
};

class LargeShard : public KernelTest {};

TEST_F(LargeShard, SgdStepsEveryElementOfAShardPastTwoToThe31) {
  const size_t n = static_cast<size_t>(kLarge);
  const size_t device_bytes = 2 * (n + 1) * sizeof(float);
  DeviceArray<float> param, grad;
  ALLOCATE_OR_SKIP(param, n, 1, device_bytes);
  ALLOCATE_OR_SKIP(grad, n, 1, device_bytes);
  std::unique_ptr<float[]> host(new (std::nothrow) float[n]);
  if (!host) GTEST_SKIP() << "needs " << n * sizeof(float) << " bytes of host memory";

  Pattern pattern;
  for (size_t i = 0; i < n; ++i, pattern.next()) host[i] = pattern.param();
  ASSERT_CUDA(cudaMemcpy(param.data(), host.get(), n * sizeof(float), cudaMemcpyHostToDevice));
  pattern = Pattern{};
  for (size_t i = 0; i < n; ++i, pattern.next()) host[i] = pattern.grad();
  ASSERT_CUDA(cudaMemcpy(grad.data(), host.get(), n * sizeof(float), cudaMemcpyHostToDevice));

  shardopt_sgd_hparams h{};
  h.lr = 0.5;
  h.weight_decay = 0.01;
  ASSERT_KERNEL_OK(shardopt_sgd_fp32(param.data(), grad.data(), nullptr, kLarge, &h, nullptr, nullptr, stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  ASSERT_CUDA(cudaMemcpy(host.get(), param.data(), n * sizeof(float), cudaMemcpyDeviceToHost));

  const SgdReference reference(h);
  size_t bad = 0, first_bad = 0;
  pattern = Pattern{};
  for (size_t i = 0; i < n; ++i, pattern.next()) {
    float want = pattern.param();
    reference.step(want, pattern.grad(), nullptr);
    if (!close_to(host[i], want, 1e-6) && bad++ == 0) first_bad = i;
  }
  EXPECT_EQ(bad, 0u) << "first wrong element: " << first_bad;
}

// bf16 0x3f3f (0.74609375) everywhere, from a byte-wise memset, then two planted values.
TEST_F(LargeShard, NormReadsEveryElementOfASegmentPastTwoToThe31) {
  const size_t n = static_cast<size_t>(kLarge);
  DeviceArray<uint16_t> data;
  ALLOCATE_OR_SKIP(data, n, 1, (n + 1) * sizeof(uint16_t));
  ASSERT_CUDA(cudaMemset(data.data() - 1, 0x3f, (n + 1) * sizeof(uint16_t)));
  auto plant = [&](size_t index, uint16_t bits) {
    return cudaMemcpy(data.data() + index, &bits, sizeof bits, cudaMemcpyHostToDevice);
  };
  const size_t in_body = (size_t{1} << 31) + 3, last = n - 1;  // with a 7-element head: body, then tail
  ASSERT_CUDA(plant(in_body, bf16_round(3.0f)));
  ASSERT_CUDA(plant(last, bf16_round(2.5f)));

  DeviceArray<shardopt_norm_segment> segment;
  ASSERT_CUDA(segment.allocate_and_upload({{data.data(), kLarge}}, 0));
  size_t bytes = 0;
  ASSERT_KERNEL_OK(shardopt_norm_workspace_bytes(&bytes));
  DeviceArray<unsigned char> workspace;
  DeviceArray<float> results;
  ASSERT_CUDA(workspace.allocate(bytes));
  ASSERT_CUDA(results.allocate(2));
  auto norm = [&](shardopt_norm_kind kind, float* value, float* found_inf) {
    ASSERT_KERNEL_OK(shardopt_norm(segment.data(), 1, SHARDOPT_KERNEL_BFLOAT16, kind, workspace.data(), bytes,
                                   results.data(), results.data() + 1, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    std::vector<float> host;
    ASSERT_CUDA(results.download(host));
    *value = host[0];
    *found_inf = host[1];
  };

  const double fill = bf16_value(0x3f3f);
  const double want_sum = static_cast<double>(n - 2) * fill * fill + 3.0 * 3.0 + 2.5 * 2.5;
  float value = 0, found_inf = -1;
  norm(SHARDOPT_NORM_L2_SQUARED, &value, &found_inf);
  EXPECT_TRUE(close_to(value, static_cast<float>(want_sum), 1e-6)) << value << " against " << want_sum;
  EXPECT_EQ(found_inf, 0.0f);
  norm(SHARDOPT_NORM_INF, &value, &found_inf);
  EXPECT_EQ(value, 3.0f) << "the element at 2^31 + 3";
  EXPECT_EQ(found_inf, 0.0f);

  ASSERT_CUDA(plant(last, 0x7f80));  // +inf
  norm(SHARDOPT_NORM_INF, &value, &found_inf);
  EXPECT_EQ(value, INFINITY) << "the last element, 2^31 + 16";
  EXPECT_EQ(found_inf, 1.0f);
}

}  // namespace
}  // namespace shardopt_kernels_test
