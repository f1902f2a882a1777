// The fused SGD kernels against the CPU reference of the same math (support.h): fp32 and mixed
// precision, odd sizes, shifted and mismatched offsets, momentum with dampening, Nesterov, the first
// step's buffer initialisation, maximize, unscale folded in, skip on inf, and the arguments refused.
#include "support.h"

#include <string>
#include <tuple>

namespace shardopt_kernels_test {
namespace {

shardopt_sgd_hparams sgd_hparams() {
  shardopt_sgd_hparams h{};
  h.lr = 0.1;
  return h;
}

// Plain SGD; momentum with dampening and weight decay; Nesterov ascending; both momentum kinds on
// their first step.
std::vector<shardopt_sgd_hparams> variants() {
  std::vector<shardopt_sgd_hparams> out(5, sgd_hparams());
  out[1].momentum = 0.9, out[1].dampening = 0.1, out[1].weight_decay = 1e-4;
  out[2].momentum = 0.9, out[2].nesterov = 1, out[2].weight_decay = 1e-4, out[2].maximize = 1;
  out[3] = out[1], out[3].first_step = 1;
  out[4] = out[2], out[4].first_step = 1;
  return out;
}

std::string trace_of(const shardopt_sgd_hparams& h, shardopt_kernel_dtype copy, shardopt_kernel_dtype grad) {
  return "copy dtype " + std::to_string(static_cast<int>(copy)) + ", grad dtype " +
         std::to_string(static_cast<int>(grad)) + ", momentum " + std::to_string(h.momentum) + ", dampening " +
         std::to_string(h.dampening) + ", nesterov " + std::to_string(h.nesterov) + ", maximize " +
         std::to_string(h.maximize) + ", first step " + std::to_string(h.first_step);
}

// One step on the device and on the CPU from the same random state. copy == FLOAT32 runs the fp32
// entry point; otherwise the mixed one. On a first step the device's momentum buffer holds NaN
// before the step: the kernel must not read it.
void check_step(int64_t n, Layout layout, shardopt_kernel_dtype copy, shardopt_kernel_dtype grad,
                const shardopt_sgd_hparams& h, const float* inv_scale, cudaStream_t stream) {
  SCOPED_TRACE(trace_of(h, copy, grad));
  const size_t count = static_cast<size_t>(n);
  std::vector<float> master = random_floats(count, -1, 1, 11), grad_value = random_floats(count, -1, 1, 12),
                     buf = random_floats(count, -1, 1, 13);
  if (h.first_step) std::fill(buf.begin(), buf.end(), NAN);
  const std::vector<float> buf_before = buf;
  const float grad_scale = inv_scale != nullptr ? 1 / *inv_scale : 1.0f;
  std::vector<uint16_t> grad_bits(grad == SHARDOPT_KERNEL_FLOAT32 ? 0 : count);
  for (size_t i = 0; i < count; ++i) {
    grad_value[i] *= grad_scale;
    if (!grad_bits.empty()) grad_value[i] = value_of(grad, grad_bits[i] = round_to(grad, grad_value[i]));
  }

  DeviceArray<float> d_master, d_buf, d_grad, d_inv_scale;
  DeviceArray<uint16_t> d_grad_bits, d_copy;
  ASSERT_CUDA(d_master.allocate_and_upload(master, offset_of(layout, 0)));
  ASSERT_CUDA(d_buf.allocate_and_upload(buf, offset_of(layout, 1)));
  if (grad_bits.empty()) {
    ASSERT_CUDA(d_grad.allocate_and_upload(grad_value, offset_of(layout, 2)));
  } else {
    ASSERT_CUDA(d_grad_bits.allocate_and_upload(grad_bits, offset_of(layout, 2)));
  }
  if (inv_scale != nullptr) {
    ASSERT_CUDA(d_inv_scale.allocate_and_upload({*inv_scale}, 0));
  }
  const float* scale_arg = inv_scale != nullptr ? d_inv_scale.data() : nullptr;

  if (copy == SHARDOPT_KERNEL_FLOAT32) {
    ASSERT_KERNEL_OK(shardopt_sgd_fp32(d_master.data(), d_grad.data(), d_buf.data(), n, &h, scale_arg, nullptr, stream));
  } else {
    ASSERT_CUDA(d_copy.allocate(count, offset_of(layout, 3)));
    const void* grad_arg = grad_bits.empty() ? static_cast<const void*>(d_grad.data()) : d_grad_bits.data();
    ASSERT_KERNEL_OK(shardopt_sgd_mixed(d_copy.data(), copy, grad_arg, grad, d_master.data(), d_buf.data(), n, &h,
                                        scale_arg, nullptr, stream));
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream));

  const SgdReference reference(h);
  for (size_t i = 0; i < count; ++i) {
    reference.step(master[i], effective_grad(grad_value[i], inv_scale, h.maximize != 0),
                   h.momentum != 0 ? &buf[i] : nullptr);
  }
  std::vector<float> got;
  ASSERT_CUDA(d_master.download(got));
  EXPECT_TRUE(all_close("master", got, master));
  if (copy != SHARDOPT_KERNEL_FLOAT32) {
    std::vector<uint16_t> copy_bits, rounded(count);
    ASSERT_CUDA(d_copy.download(copy_bits));
    for (size_t i = 0; i < count; ++i) rounded[i] = round_to(copy, got[i]);
    EXPECT_TRUE(same_bits("low-precision copy (against the master rounded to nearest even)", copy_bits, rounded));
  }
  ASSERT_CUDA(d_buf.download(got));
  EXPECT_TRUE(h.momentum != 0 ? all_close("momentum_buf", got, buf) : same_bits("momentum_buf (unused)", got, buf_before));
}

class SgdKernel : public KernelTest, public ::testing::WithParamInterface<std::tuple<int64_t, Layout>> {
 protected:
  int64_t n() const { return std::get<0>(GetParam()); }
  Layout layout() const { return std::get<1>(GetParam()); }
};

TEST_P(SgdKernel, Fp32MatchesTheCpuStep) {
  for (const auto& h : variants()) {
    check_step(n(), layout(), SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32, h, nullptr, stream_);
  }
}

TEST_P(SgdKernel, MixedPrecisionMatchesTheCpuStepAndRoundsTheCopy) {
  const auto all = variants();
  for (auto copy : {SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_FLOAT16}) {
    for (auto grad : {copy, SHARDOPT_KERNEL_FLOAT32}) {
      for (const auto& h : {all[1], all[4]}) check_step(n(), layout(), copy, grad, h, nullptr, stream_);
    }
  }
}

TEST_P(SgdKernel, UnscaleFoldsIntoTheStep) {
  const float inv_scale = 1.0f / 4096;
  for (const auto& h : variants()) {
    check_step(n(), layout(), SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32, h, &inv_scale, stream_);
  }
  check_step(n(), layout(), SHARDOPT_KERNEL_FLOAT16, SHARDOPT_KERNEL_FLOAT32, variants()[2], &inv_scale, stream_);
}

INSTANTIATE_TEST_SUITE_P(SizesAndLayouts, SgdKernel,
                         ::testing::Combine(::testing::Values<int64_t>(1, 3, 1023, 1000003),
                                            ::testing::Values(Layout::kAligned, Layout::kShifted, Layout::kMismatched)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" + name_of(std::get<1>(info.param));
                         });

class SgdSkipOnInf : public KernelTest {};

TEST_F(SgdSkipOnInf, FoundInfLeavesEveryBufferUntouched) {
  const size_t n = 2053;
  const std::vector<float> master = random_floats(n, -1, 1, 14), buf = random_floats(n, -1, 1, 15),
                           grad = random_floats(n, -1, 1, 16);
  const std::vector<uint16_t> copy(n, 0x3c00);
  DeviceArray<float> d_master, d_buf, d_grad, d_found_inf;
  DeviceArray<uint16_t> d_copy;
  ASSERT_CUDA(d_master.allocate_and_upload(master, 0));
  ASSERT_CUDA(d_buf.allocate_and_upload(buf, 0));
  ASSERT_CUDA(d_grad.allocate_and_upload(grad, 0));
  ASSERT_CUDA(d_copy.allocate_and_upload(copy, 0));
  ASSERT_CUDA(d_found_inf.allocate_and_upload({1.0f}, 0));
  auto h = variants()[1];
  ASSERT_KERNEL_OK(shardopt_sgd_fp32(d_master.data(), d_grad.data(), d_buf.data(), n, &h, nullptr, d_found_inf.data(),
                                     stream_));
  ASSERT_KERNEL_OK(shardopt_sgd_mixed(d_copy.data(), SHARDOPT_KERNEL_FLOAT16, d_grad.data(), SHARDOPT_KERNEL_FLOAT32,
                                      d_master.data(), d_buf.data(), n, &h, nullptr, d_found_inf.data(), stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  std::vector<float> got;
  std::vector<uint16_t> got_copy;
  ASSERT_CUDA(d_master.download(got));
  EXPECT_TRUE(same_bits("master", got, master));
  ASSERT_CUDA(d_buf.download(got));
  EXPECT_TRUE(same_bits("momentum_buf", got, buf));
  ASSERT_CUDA(d_copy.download(got_copy));
  EXPECT_TRUE(same_bits("copy", got_copy, copy));
}

class SgdArguments : public KernelTest {};

TEST_F(SgdArguments, BadArgumentsAreRefusedAndNothingRuns) {
  const size_t n = 64;
  DeviceArray<float> p, g, b;
  for (auto* a : {&p, &g, &b}) ASSERT_CUDA(a->allocate(n));
  auto call = [&](float* buf, const shardopt_sgd_hparams& h) {
    return shardopt_sgd_fp32(p.data(), g.data(), buf, n, &h, nullptr, nullptr, stream_);
  };
  const auto plain = variants()[0], momentum = variants()[1], nesterov = variants()[2];
  EXPECT_EQ(call(nullptr, plain), SHARDOPT_KERNEL_OK) << "no momentum, no buffer";
  EXPECT_EQ(call(b.data(), momentum), SHARDOPT_KERNEL_OK);
  EXPECT_EQ(call(nullptr, momentum), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "momentum needs its buffer";
  EXPECT_EQ(call(p.data(), momentum), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "the buffer overlaps the parameters";
  std::vector<shardopt_sgd_hparams> bad{nesterov, nesterov, plain, plain, plain, plain};
  bad[0].dampening = 0.1;  // Nesterov needs zero dampening
  bad[1].momentum = 0;     // and a momentum
  bad[2].lr = -1;
  bad[3].momentum = -0.5;
  bad[4].weight_decay = NAN;
  bad[5].dampening = INFINITY;
  for (size_t k = 0; k < bad.size(); ++k) {
    EXPECT_EQ(call(b.data(), bad[k]), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "hyper-parameters " << k;
  }
  EXPECT_EQ(shardopt_sgd_mixed(b.data(), SHARDOPT_KERNEL_FLOAT16, g.data(), SHARDOPT_KERNEL_BFLOAT16, p.data(), nullptr,
                               n, &plain, nullptr, nullptr, stream_),
            SHARDOPT_KERNEL_INVALID_ARGUMENT)
      << "a bf16 gradient with an fp16 copy";
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace shardopt_kernels_test
