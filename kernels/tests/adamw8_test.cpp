// The Adam / AdamW kernel on 8-bit moments against a CPU reference of the same scheme (decode,
// support.h's Adam step, the block's absolute maximum, the binary search for each code): the same
// parameters, codes and scales bit for bit, with short last blocks, AMSGrad, maximize, the unscale
// folded in; nothing written on a skipped step; the arguments refused.
#include "support.h"

#include <shardopt_kernels/adamw8.h>

#include <array>
#include <string>

namespace shardopt_kernels_test {
namespace {

constexpr int64_t kBlock = SHARDOPT_ADAMW8_BLOCK;

// A dynamic map as bitsandbytes' create_dynamic_map builds it (7 exponent bits): 256 ascending
// values in [-1, 1] (signed) or [0, 1]; the kernel takes whatever map it is given.
std::array<float, 256> dynamic_map(bool is_signed) {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    for (int k = 0; k + 1 < items; ++k) {
      const double lo = 0.1 + 0.9 * k / (items - 1), hi = 0.1 + 0.9 * (k + 1) / (items - 1);
      const double mean = (lo + hi) / 2 * std::pow(10.0, i - 6);
      data.push_back(static_cast<float>(mean));
      if (is_signed) data.push_back(static_cast<float>(-mean));
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  std::copy(data.begin(), data.end(), map.begin());
  return map;
}

// state_codes.cpp's code_of: the largest code whose value is at most x, then up when x is at
// least halfway to the next value.
int code_of(float x, const std::array<float, 256>& map) {
  int c = x >= map[128] ? 128 : 0;
  for (int step = 64; step >= 1; step /= 2) c += x >= map[c + step] ? step : 0;
  const int up = std::min(c + 1, 255);
  const float down = map[c];
  return x - down >= (map[up] - down) * 0.5f ? up : c;
}

// One moment's codes and scales.
struct Codes {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

// Random codes and positive scales: a valid 8-bit state of n elements.
Codes random_codes(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Codes c{std::vector<uint8_t>(n), std::vector<float>((n + kBlock - 1) / kBlock)};
  for (auto& x : c.codes) x = static_cast<uint8_t>(rng() & 255);
  std::uniform_real_distribution<float> scale(1e-4f, 1e-1f);
  for (float& s : c.scales) s = scale(rng);
  return c;
}

// Each block of `values` coded again: scale = the largest magnitude (at least 1e-12), code =
// code_of(value / scale).
void code_blocks(const std::vector<float>& values, const std::array<float, 256>& map, Codes& out) {
  const int64_t n = static_cast<int64_t>(values.size());
  for (int64_t b = 0; b * kBlock < n; ++b) {
    float absmax = 0.0f;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) absmax = std::max(absmax, std::fabs(values[i]));
    const float scale = std::max(absmax, 1e-12f);
    out.scales[b] = scale;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
      out.codes[i] = static_cast<uint8_t>(code_of(values[i] / scale, map));
    }
  }
}

std::vector<float> decoded(const Codes& c, const std::array<float, 256>& map) {
  std::vector<float> out(c.codes.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = map[c.codes[i]] * c.scales[i / kBlock];
  return out;
}

// The device copy of one moment.
struct DeviceCodes {
  DeviceArray<uint8_t> codes;
  DeviceArray<float> scales;
  cudaError_t upload(const Codes& c) {
    cudaError_t e = codes.allocate_and_upload(c.codes, 0);
    return e != cudaSuccess ? e : scales.allocate_and_upload(c.scales, 0);
  }
  cudaError_t download(Codes& c) const {
    cudaError_t e = codes.download(c.codes);
    return e != cudaSuccess ? e : scales.download(c.scales);
  }
};

class AdamW8Kernel : public KernelTest {
 protected:
  void SetUp() override {
    KernelTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_CUDA(signed_map_.allocate_and_upload(std::vector<float>(maps_[0].begin(), maps_[0].end()), 0));
    ASSERT_CUDA(unsigned_map_.allocate_and_upload(std::vector<float>(maps_[1].begin(), maps_[1].end()), 0));
  }

  // One step of `h` on the device and on the CPU from the same random state, compared bit for
  // bit; with `skip`, found_inf is set and nothing may change.
  void check(int64_t n, const shardopt_adamw_hparams& h, const float* inv_scale, bool skip) {
    const auto& smap = maps_[0];
    const auto& umap = maps_[1];
    std::vector<float> p = random_floats(n, -1, 1, 11), g = random_floats(n, -1, 1, 12);
    Codes m = random_codes(n, 13), v = random_codes(n, 14), vmax = random_codes(n, 15);
    DeviceArray<float> d_p, d_g, d_inv_scale, d_found_inf;
    DeviceCodes d_m, d_v, d_vmax;
    ASSERT_CUDA(d_p.allocate_and_upload(p, 0));
    ASSERT_CUDA(d_g.allocate_and_upload(g, 0));
    ASSERT_CUDA(d_m.upload(m));
    ASSERT_CUDA(d_v.upload(v));
    ASSERT_CUDA(d_vmax.upload(vmax));
    if (inv_scale != nullptr) ASSERT_CUDA(d_inv_scale.allocate_and_upload({*inv_scale}, 0));
    if (skip) ASSERT_CUDA(d_found_inf.allocate_and_upload({1.0f}, 0));
    const shardopt_adamw8_segment segment{d_p.data(),          d_g.data(),           d_m.codes.data(),
                                          d_m.scales.data(),   d_v.codes.data(),     d_v.scales.data(),
                                          d_vmax.codes.data(), d_vmax.scales.data(), n};
    ASSERT_KERNEL_OK(shardopt_adamw8(&segment, &h, signed_map_.data(), unsigned_map_.data(),
                                     inv_scale != nullptr ? d_inv_scale.data() : nullptr,
                                     skip ? d_found_inf.data() : nullptr, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));

    const std::vector<float> p_before = p;
    const Codes m_before = m, v_before = v, vmax_before = vmax;
    if (!skip) {
      const AdamReference reference(h);
      std::vector<float> mv = decoded(m, smap), vv = decoded(v, umap), xv = decoded(vmax, umap);
      for (int64_t i = 0; i < n; ++i) {
        reference.step(p[i], effective_grad(g[i], inv_scale, h.maximize != 0), mv[i], vv[i], xv[i]);
      }
      code_blocks(mv, smap, m);
      code_blocks(vv, umap, v);
      if (h.amsgrad) code_blocks(xv, umap, vmax);
    }
    std::vector<float> got_p;
    Codes got_m, got_v, got_vmax;
    ASSERT_CUDA(d_p.download(got_p));
    ASSERT_CUDA(d_m.download(got_m));
    ASSERT_CUDA(d_v.download(got_v));
    ASSERT_CUDA(d_vmax.download(got_vmax));
    EXPECT_TRUE(same_bits("param", got_p, p));
    EXPECT_TRUE(same_bits("exp_avg codes", got_m.codes, m.codes));
    EXPECT_TRUE(same_bits("exp_avg scales", got_m.scales, m.scales));
    EXPECT_TRUE(same_bits("exp_avg_sq codes", got_v.codes, v.codes));
    EXPECT_TRUE(same_bits("exp_avg_sq scales", got_v.scales, v.scales));
    EXPECT_TRUE(same_bits("max_exp_avg_sq codes", got_vmax.codes, vmax.codes));
    EXPECT_TRUE(same_bits("max_exp_avg_sq scales", got_vmax.scales, vmax.scales));
    if (!skip && n >= kBlock) {
      EXPECT_FALSE(same_bits("param", got_p, p_before)) << "the step changed no parameter";
      EXPECT_FALSE(same_bits("exp_avg codes", got_m.codes, m_before.codes)) << "the step changed no code";
    }
  }

  const std::array<std::array<float, 256>, 2> maps_{dynamic_map(true), dynamic_map(false)};
  DeviceArray<float> signed_map_, unsigned_map_;
};

std::string trace_of(int64_t n, const shardopt_adamw_hparams& h) {
  return "n " + std::to_string(n) + ", decoupled " + std::to_string(h.decoupled) + ", amsgrad " +
         std::to_string(h.amsgrad) + ", maximize " + std::to_string(h.maximize) + ", step " + std::to_string(h.step);
}

TEST_F(AdamW8Kernel, MatchesTheCpuStepBitForBit) {
  std::vector<shardopt_adamw_hparams> variants(4, adamw_hparams());
  variants[1].decoupled = 0, variants[1].amsgrad = 1, variants[1].step = 3;
  variants[2].amsgrad = 1, variants[2].maximize = 1, variants[2].step = 1000;
  variants[3].weight_decay = 0, variants[3].step = 2;
  for (int64_t n : {int64_t{1}, kBlock - 1, kBlock, 7 * kBlock + 45, int64_t{1000003}}) {
    for (const auto& h : variants) {
      SCOPED_TRACE(trace_of(n, h));
      check(n, h, nullptr, false);
    }
  }
}

TEST_F(AdamW8Kernel, UnscaleFoldsIntoTheStep) {
  const float inv_scale = 1.0f / 1024;
  check(5 * kBlock + 3, adamw_hparams(), &inv_scale, false);
}

TEST_F(AdamW8Kernel, ASkippedStepWritesNothing) { check(3 * kBlock + 17, adamw_hparams(), nullptr, true); }

TEST_F(AdamW8Kernel, RefusesBadArguments) {
  const int64_t n = 2 * kBlock;
  DeviceArray<float> p, g, ms, vs;
  DeviceArray<uint8_t> m, v;
  ASSERT_CUDA(p.allocate(n));
  ASSERT_CUDA(g.allocate(n));
  ASSERT_CUDA(m.allocate(n));
  ASSERT_CUDA(v.allocate(n));
  ASSERT_CUDA(ms.allocate(2));
  ASSERT_CUDA(vs.allocate(2));
  const shardopt_adamw_hparams h = adamw_hparams();
  const shardopt_adamw8_segment good{p.data(), g.data(), m.data(), ms.data(), v.data(), vs.data(), nullptr, nullptr, n};
  ASSERT_KERNEL_OK(shardopt_adamw8(&good, &h, signed_map_.data(), unsigned_map_.data(), nullptr, nullptr, stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  auto refused = [&](shardopt_adamw8_segment s, const shardopt_adamw_hparams& hp, const float* smap) {
    return shardopt_adamw8(&s, &hp, smap, unsigned_map_.data(), nullptr, nullptr, stream_) ==
           SHARDOPT_KERNEL_INVALID_ARGUMENT;
  };
  shardopt_adamw8_segment s = good;
  s.n = -1;
  EXPECT_TRUE(refused(s, h, signed_map_.data())) << "n < 0";
  s = good, s.exp_avg = nullptr;
  EXPECT_TRUE(refused(s, h, signed_map_.data())) << "no exp_avg codes";
  s = good, s.exp_avg_sq_scale = nullptr;
  EXPECT_TRUE(refused(s, h, signed_map_.data())) << "no exp_avg_sq scales";
  s = good, s.param = reinterpret_cast<float*>(reinterpret_cast<char*>(p.data()) + 1);
  EXPECT_TRUE(refused(s, h, signed_map_.data())) << "a misaligned parameter";
  s = good, s.grad = p.data();
  EXPECT_TRUE(refused(s, h, signed_map_.data())) << "the gradient over the parameter";
  EXPECT_TRUE(refused(good, h, nullptr)) << "no signed map";
  shardopt_adamw_hparams amsgrad = h;
  amsgrad.amsgrad = 1;
  EXPECT_TRUE(refused(good, amsgrad, signed_map_.data())) << "AMSGrad without its running maximum";
  shardopt_adamw_hparams bad = h;
  bad.beta1 = 1.5;
  EXPECT_TRUE(refused(good, bad, signed_map_.data())) << "beta1 out of range";
  EXPECT_EQ(shardopt_adamw8(nullptr, &h, signed_map_.data(), unsigned_map_.data(), nullptr, nullptr, stream_),
            SHARDOPT_KERNEL_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace shardopt_kernels_test
