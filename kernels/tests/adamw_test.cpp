// The fused Adam / AdamW kernels against the CPU reference of the same math (support.h): fp32 and
// mixed precision, odd sizes, shifted and mismatched offsets, AMSGrad, maximize, unscale folded in,
// skip on inf, and the arguments refused.
#include "support.h"

#include <string>
#include <tuple>

namespace shardopt_kernels_test {
namespace {

// The variants each size and layout runs: AdamW, Adam with AMSGrad, AdamW ascending with AMSGrad
// late in training, Adam without weight decay.
std::vector<shardopt_adamw_hparams> variants() {
  std::vector<shardopt_adamw_hparams> out(4, adamw_hparams());
  out[1].decoupled = 0, out[1].amsgrad = 1, out[1].step = 3;
  out[2].amsgrad = 1, out[2].maximize = 1, out[2].step = 1000;
  out[3].decoupled = 0, out[3].weight_decay = 0, out[3].step = 2;
  return out;
}

// One step on the device and on the CPU from the same random state. copy == FLOAT32 runs the fp32
// entry point (grad must then be FLOAT32 too); otherwise the mixed one, whose copy must be the
// updated master rounded to nearest even. inv_scale: the unscale factor, or null.
void check_step(int64_t n, Layout layout, shardopt_kernel_dtype copy, shardopt_kernel_dtype grad,
                const shardopt_adamw_hparams& h, const float* inv_scale, cudaStream_t stream) {
  const size_t count = static_cast<size_t>(n);
  std::vector<float> master = random_floats(count, -1, 1, 1), m = random_floats(count, -0.1f, 0.1f, 2),
                     v = random_floats(count, 0, 0.01f, 3), vmax = random_floats(count, 0, 0.02f, 4),
                     grad_value = random_floats(count, -1, 1, 5);
  const float grad_scale = inv_scale != nullptr ? 1 / *inv_scale : 1.0f;
  std::vector<uint16_t> grad_bits(grad == SHARDOPT_KERNEL_FLOAT32 ? 0 : count);
  for (size_t i = 0; i < count; ++i) {
    grad_value[i] *= grad_scale;
    if (!grad_bits.empty()) grad_value[i] = value_of(grad, grad_bits[i] = round_to(grad, grad_value[i]));
  }

  DeviceArray<float> d_master, d_m, d_v, d_vmax, d_grad, d_inv_scale;
  DeviceArray<uint16_t> d_grad_bits, d_copy;
  ASSERT_CUDA(d_master.allocate_and_upload(master, offset_of(layout, 0)));
  ASSERT_CUDA(d_m.allocate_and_upload(m, offset_of(layout, 1)));
  ASSERT_CUDA(d_v.allocate_and_upload(v, offset_of(layout, 2)));
  ASSERT_CUDA(d_vmax.allocate_and_upload(vmax, offset_of(layout, 3)));
  if (grad_bits.empty()) {
    ASSERT_CUDA(d_grad.allocate_and_upload(grad_value, offset_of(layout, 4)));
  } else {
    ASSERT_CUDA(d_grad_bits.allocate_and_upload(grad_bits, offset_of(layout, 4)));
  }
  if (inv_scale != nullptr) {
    ASSERT_CUDA(d_inv_scale.allocate_and_upload({*inv_scale}, 0));
  }
  const float* scale_arg = inv_scale != nullptr ? d_inv_scale.data() : nullptr;

  if (copy == SHARDOPT_KERNEL_FLOAT32) {
    ASSERT_KERNEL_OK(shardopt_adamw_fp32(d_master.data(), d_grad.data(), d_m.data(), d_v.data(), d_vmax.data(), n, &h,
                                         scale_arg, nullptr, stream));
  } else {
    ASSERT_CUDA(d_copy.allocate(count, offset_of(layout, 5)));
    const void* grad_arg = grad_bits.empty() ? static_cast<const void*>(d_grad.data()) : d_grad_bits.data();
    ASSERT_KERNEL_OK(shardopt_adamw_mixed(d_copy.data(), copy, grad_arg, grad, d_master.data(), d_m.data(), d_v.data(),
                                          d_vmax.data(), n, &h, scale_arg, nullptr, stream));
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream));

  const AdamReference reference(h);
  const std::vector<float> vmax_before = vmax;
  for (size_t i = 0; i < count; ++i) {
    reference.step(master[i], effective_grad(grad_value[i], inv_scale, h.maximize != 0), m[i], v[i], vmax[i]);
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
  ASSERT_CUDA(d_m.download(got));
  EXPECT_TRUE(all_close("exp_avg", got, m));
  ASSERT_CUDA(d_v.download(got));
  EXPECT_TRUE(all_close("exp_avg_sq", got, v));
  ASSERT_CUDA(d_vmax.download(got));
  EXPECT_TRUE(h.amsgrad ? all_close("max_exp_avg_sq", got, vmax) : same_bits("max_exp_avg_sq (unused)", got, vmax_before));
}

struct DtypePair {
  shardopt_kernel_dtype copy, grad;
};
const DtypePair kMixedPairs[] = {{SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_BFLOAT16},
                                 {SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_FLOAT32},
                                 {SHARDOPT_KERNEL_FLOAT16, SHARDOPT_KERNEL_FLOAT16},
                                 {SHARDOPT_KERNEL_FLOAT16, SHARDOPT_KERNEL_FLOAT32}};

std::string trace_of(const shardopt_adamw_hparams& h, DtypePair pair) {
  return "copy dtype " + std::to_string(static_cast<int>(pair.copy)) + ", grad dtype " +
         std::to_string(static_cast<int>(pair.grad)) + ", decoupled " +
         std::to_string(h.decoupled) + ", amsgrad " + std::to_string(h.amsgrad) + ", maximize " +
         std::to_string(h.maximize) + ", step " + std::to_string(h.step);
}

class AdamWKernel : public KernelTest, public ::testing::WithParamInterface<std::tuple<int64_t, Layout>> {
 protected:
  int64_t n() const { return std::get<0>(GetParam()); }
  Layout layout() const { return std::get<1>(GetParam()); }
};

TEST_P(AdamWKernel, Fp32MatchesTheCpuStep) {
  for (const auto& h : variants()) {
    SCOPED_TRACE(trace_of(h, {SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32}));
    check_step(n(), layout(), SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32, h, nullptr, stream_);
  }
}

TEST_P(AdamWKernel, MixedPrecisionMatchesTheCpuStepAndRoundsTheCopy) {
  const auto all = variants();
  for (const DtypePair& pair : kMixedPairs) {
    for (const auto& h : {all[0], all[2]}) {
      SCOPED_TRACE(trace_of(h, pair));
      check_step(n(), layout(), pair.copy, pair.grad, h, nullptr, stream_);
    }
  }
}

TEST_P(AdamWKernel, UnscaleFoldsIntoTheStep) {
  const float inv_scale = 1.0f / 1024;
  const auto h = variants()[1];
  check_step(n(), layout(), SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32, h, &inv_scale, stream_);
  for (const DtypePair& pair : kMixedPairs) {
    SCOPED_TRACE(trace_of(h, pair));
    check_step(n(), layout(), pair.copy, pair.grad, h, &inv_scale, stream_);
  }
}

INSTANTIATE_TEST_SUITE_P(SizesAndLayouts, AdamWKernel,
                         ::testing::Combine(::testing::Values<int64_t>(1, 3, 1023, 1000003),
                                            ::testing::Values(Layout::kAligned, Layout::kShifted, Layout::kMismatched)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" + name_of(std::get<1>(info.param));
                         });

class AdamWSkipOnInf : public KernelTest {};

// A set found_inf leaves parameters, copy and state bit for bit; a clear one lets the step run.
TEST_F(AdamWSkipOnInf, FoundInfLeavesEveryBufferUntouched) {
  const size_t n = 4099;
  const std::vector<float> master = random_floats(n, -1, 1, 7), m = random_floats(n, -0.1f, 0.1f, 8),
                           v = random_floats(n, 0, 0.01f, 9), grad = random_floats(n, -1, 1, 10);
  const std::vector<uint16_t> copy(n, 0x3f80);
  DeviceArray<float> d_master, d_m, d_v, d_vmax, d_grad, d_found_inf;
  DeviceArray<uint16_t> d_copy;
  ASSERT_CUDA(d_master.allocate_and_upload(master, 1));
  ASSERT_CUDA(d_m.allocate_and_upload(m, 1));
  ASSERT_CUDA(d_v.allocate_and_upload(v, 1));
  ASSERT_CUDA(d_vmax.allocate_and_upload(v, 1));
  ASSERT_CUDA(d_grad.allocate_and_upload(grad, 1));
  ASSERT_CUDA(d_copy.allocate_and_upload(copy, 1));
  ASSERT_CUDA(d_found_inf.allocate_and_upload({1.0f}, 0));
  auto h = adamw_hparams();
  h.amsgrad = 1;
  ASSERT_KERNEL_OK(shardopt_adamw_fp32(d_master.data(), d_grad.data(), d_m.data(), d_v.data(), d_vmax.data(), n, &h,
                                       nullptr, d_found_inf.data(), stream_));
  ASSERT_KERNEL_OK(shardopt_adamw_mixed(d_copy.data(), SHARDOPT_KERNEL_BFLOAT16, d_grad.data(), SHARDOPT_KERNEL_FLOAT32,
                                        d_master.data(), d_m.data(), d_v.data(), d_vmax.data(), n, &h, nullptr,
                                        d_found_inf.data(), stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  std::vector<float> got;
  std::vector<uint16_t> got_copy;
  ASSERT_CUDA(d_master.download(got));
  EXPECT_TRUE(same_bits("master", got, master));
  ASSERT_CUDA(d_m.download(got));
  EXPECT_TRUE(same_bits("exp_avg", got, m));
  ASSERT_CUDA(d_v.download(got));
  EXPECT_TRUE(same_bits("exp_avg_sq", got, v));
  ASSERT_CUDA(d_vmax.download(got));
  EXPECT_TRUE(same_bits("max_exp_avg_sq", got, v));
  ASSERT_CUDA(d_copy.download(got_copy));
  EXPECT_TRUE(same_bits("copy", got_copy, copy));

  ASSERT_CUDA(d_found_inf.upload({0.0f}));
  ASSERT_KERNEL_OK(shardopt_adamw_fp32(d_master.data(), d_grad.data(), d_m.data(), d_v.data(), d_vmax.data(), n, &h,
                                       nullptr, d_found_inf.data(), stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  std::vector<float> want = master, want_m = m, want_v = v, want_vmax = v;
  const AdamReference reference(h);
  for (size_t i = 0; i < n; ++i) reference.step(want[i], grad[i], want_m[i], want_v[i], want_vmax[i]);
  ASSERT_CUDA(d_master.download(got));
  EXPECT_TRUE(all_close("master after a clear found_inf", got, want));
}

class AdamWArguments : public KernelTest {};

TEST_F(AdamWArguments, BadArgumentsAreRefusedAndNothingRuns) {
  const size_t n = 64;
  DeviceArray<float> p, g, m, v, x;
  for (auto* a : {&p, &g, &m, &v, &x}) ASSERT_CUDA(a->allocate(n + 1));
  const auto h = adamw_hparams();
  auto call = [&](float* param, const float* grad, int64_t count, const shardopt_adamw_hparams* hp) {
    return shardopt_adamw_fp32(param, grad, m.data(), v.data(), x.data(), count, hp, nullptr, nullptr, stream_);
  };
  EXPECT_EQ(call(p.data(), g.data(), n, &h), SHARDOPT_KERNEL_OK);
  EXPECT_EQ(call(nullptr, nullptr, 0, &h), SHARDOPT_KERNEL_OK) << "an empty segment needs no buffers";
  EXPECT_EQ(call(nullptr, g.data(), n, &h), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(p.data(), g.data(), -1, &h), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(p.data(), g.data(), n, nullptr), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(p.data(), p.data(), n, &h), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "grad overlaps param";
  EXPECT_EQ(call(p.data(), p.data() + n / 2, n / 2 + 1, &h), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "one shared element";
  const float* misaligned = reinterpret_cast<const float*>(reinterpret_cast<const char*>(g.data()) + 2);
  EXPECT_EQ(call(p.data(), misaligned, n - 1, &h), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  std::vector<shardopt_adamw_hparams> bad(6, h);
  bad[0].step = 0;
  bad[1].beta1 = 1;
  bad[2].beta2 = -0.1;
  bad[3].lr = NAN;
  bad[4].eps = -1;
  bad[5].weight_decay = INFINITY;
  for (size_t k = 0; k < bad.size(); ++k) {
    EXPECT_EQ(call(p.data(), g.data(), n, &bad[k]), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "hyper-parameters " << k;
  }
  auto amsgrad = h;
  amsgrad.amsgrad = 1;
  EXPECT_EQ(shardopt_adamw_fp32(p.data(), g.data(), m.data(), v.data(), nullptr, n, &amsgrad, nullptr, nullptr, stream_),
            SHARDOPT_KERNEL_INVALID_ARGUMENT)
      << "AMSGrad needs max_exp_avg_sq";
  auto mixed = [&](shardopt_kernel_dtype copy, shardopt_kernel_dtype grad) {
    return shardopt_adamw_mixed(x.data(), copy, g.data(), grad, p.data(), m.data(), v.data(), nullptr, n, &h, nullptr,
                                nullptr, stream_);
  };
  EXPECT_EQ(mixed(SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_BFLOAT16), SHARDOPT_KERNEL_OK);
  EXPECT_EQ(mixed(SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(mixed(SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_FLOAT16), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(mixed(static_cast<shardopt_kernel_dtype>(7), SHARDOPT_KERNEL_FLOAT32), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace shardopt_kernels_test
