// The fused Adam / AdamW step over a list of segments (shardopt_adamw_*_segments): each segment bit
// for bit what the single-segment entry point gives it (itself checked against the CPU step in
// adamw_test.cpp), across several launches, with sizes that end inside a vector, empty segments,
// and segments that start at different alignments; nothing outside the segments written; a set
// found_inf skipping every launch; and the lists refused.
#include "support.h"

#include <string>

namespace shardopt_kernels_test {
namespace {

shardopt_adamw_hparams hparams(int amsgrad, int decoupled, int64_t step) {
  shardopt_adamw_hparams h = adamw_hparams();
  h.step = step;
  h.decoupled = decoupled;
  h.amsgrad = amsgrad;
  return h;
}

// Sizes that cover a chunk boundary (256 threads x a vector of 4 or 8), a vector's tail, one
// element and none; 70 segments make three launches of at most 32.
constexpr int64_t kSizes[] = {1, 3, 0, 4, 5, 7, 8, 9, 255, 1023, 1024, 1025, 2049, 4097, 70001};
constexpr int kSegments = 70;
constexpr size_t kGap = 5;  // elements between segments, which no call may write

int64_t size_of_segment(int k) { return kSizes[k % (sizeof(kSizes) / sizeof(kSizes[0]))]; }

// Buffer b of segment k starts this many elements after the previous one's end plus the gap: the
// same shift in every buffer for some segments (vectors after a head), different shifts for others
// (single elements throughout).
size_t shift_of(int k, int b) {
  switch (k % 3) {
    case 0: return 0;
    case 1: return 1;
    default: return b == 0 ? 3 : 0;
  }
}

// Six buffers (master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy), each one allocation that
// all segments are carved from, filled with random bits (the gaps too).
struct Lists {
  std::vector<size_t> offset[6];  // per buffer, per segment: the first element
  size_t total[6] = {};
  std::vector<float> host_float[5];  // master, grad (fp32), exp_avg, exp_avg_sq, max_exp_avg_sq
  std::vector<uint16_t> host_half[2];  // grad (bf16/fp16), copy

  Lists(shardopt_kernel_dtype grad) {
    for (int b = 0; b < 6; ++b) {
      size_t at = 0;
      for (int k = 0; k < kSegments; ++k) {
        at += shift_of(k, b);
        offset[b].push_back(at);
        at += static_cast<size_t>(size_of_segment(k)) + kGap;
      }
      total[b] = at;
    }
    host_float[0] = random_floats(total[0], -1, 1, 11);
    host_float[1] = random_floats(total[1], -1, 1, 12);
    host_float[2] = random_floats(total[2], -0.1f, 0.1f, 13);
    host_float[3] = random_floats(total[3], 0, 0.01f, 14);
    host_float[4] = random_floats(total[4], 0, 0.02f, 15);
    host_half[0].resize(total[1]);
    if (grad != SHARDOPT_KERNEL_FLOAT32) {
      for (size_t i = 0; i < total[1]; ++i) host_half[0][i] = round_to(grad, host_float[1][i]);
    }
    host_half[1].assign(total[5], 0x7bcd);
  }
};

// One copy of the lists on the device.
struct DeviceLists {
  DeviceArray<float> f[5];
  DeviceArray<uint16_t> grad_half, copy;

  ::testing::AssertionResult upload(const Lists& l) {
    for (int b = 0; b < 5; ++b) {
      if (f[b].allocate_and_upload(l.host_float[b], 0) != cudaSuccess) return ::testing::AssertionFailure() << "upload";
    }
    if (grad_half.allocate_and_upload(l.host_half[0], 0) != cudaSuccess ||
        copy.allocate_and_upload(l.host_half[1], 0) != cudaSuccess) {
      return ::testing::AssertionFailure() << "upload";
    }
    return ::testing::AssertionSuccess();
  }

  shardopt_adamw_segment segment(const Lists& l, int k, bool mixed, shardopt_kernel_dtype grad) const {
    shardopt_adamw_segment s{};
    const void* g = grad == SHARDOPT_KERNEL_FLOAT32 ? static_cast<const void*>(f[1].data() + l.offset[1][k])
                                                     : static_cast<const void*>(grad_half.data() + l.offset[1][k]);
    s.param = mixed ? static_cast<void*>(copy.data() + l.offset[5][k]) : static_cast<void*>(f[0].data() + l.offset[0][k]);
    s.grad = g;
    s.master = mixed ? f[0].data() + l.offset[0][k] : nullptr;
    s.exp_avg = f[2].data() + l.offset[2][k];
    s.exp_avg_sq = f[3].data() + l.offset[3][k];
    s.max_exp_avg_sq = f[4].data() + l.offset[4][k];
    s.n = size_of_segment(k);
    return s;
  }
};

::testing::AssertionResult same_buffers(const DeviceLists& a, const DeviceLists& b) {
  static const char* const kNames[] = {"master/parameter", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  for (int k = 0; k < 5; ++k) {
    std::vector<float> x, y;
    if (a.f[k].download(x) != cudaSuccess || b.f[k].download(y) != cudaSuccess) {
      return ::testing::AssertionFailure() << "download";
    }
    auto same = same_bits(kNames[k], x, y);
    if (!same) return same;
  }
  std::vector<uint16_t> x, y;
  if (a.copy.download(x) != cudaSuccess || b.copy.download(y) != cudaSuccess) {
    return ::testing::AssertionFailure() << "download";
  }
  return same_bits("copy", x, y);
}

class AdamWSegments : public KernelTest {
 protected:
  // The list call on one copy, a single-segment call per segment on another, then every element of
  // every buffer compared (the gaps, and the whole copy outside the segments, included).
  void check(shardopt_kernel_dtype copy, shardopt_kernel_dtype grad, const shardopt_adamw_hparams& h,
             const float* inv_scale) {
    const bool mixed = copy != SHARDOPT_KERNEL_FLOAT32;
    const Lists lists(grad);
    DeviceLists listed, single;
    ASSERT_TRUE(listed.upload(lists));
    ASSERT_TRUE(single.upload(lists));
    std::vector<shardopt_adamw_segment> segments;
    for (int k = 0; k < kSegments; ++k) segments.push_back(listed.segment(lists, k, mixed, grad));
    if (mixed) {
      ASSERT_KERNEL_OK(shardopt_adamw_mixed_segments(segments.data(), kSegments, copy, grad, &h, inv_scale, nullptr,
                                                     stream_));
    } else {
      ASSERT_KERNEL_OK(shardopt_adamw_fp32_segments(segments.data(), kSegments, &h, inv_scale, nullptr, stream_));
    }
    for (int k = 0; k < kSegments; ++k) {
      const shardopt_adamw_segment s = single.segment(lists, k, mixed, grad);
      if (mixed) {
        ASSERT_KERNEL_OK(shardopt_adamw_mixed(s.param, copy, s.grad, grad, s.master, s.exp_avg, s.exp_avg_sq,
                                              s.max_exp_avg_sq, s.n, &h, inv_scale, nullptr, stream_));
      } else {
        ASSERT_KERNEL_OK(shardopt_adamw_fp32(static_cast<float*>(s.param), static_cast<const float*>(s.grad),
                                             s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq, s.n, &h, inv_scale, nullptr,
                                             stream_));
      }
    }
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    EXPECT_TRUE(same_buffers(listed, single));
    // The step ran at all: the first segment's first element moved.
    std::vector<float> before = lists.host_float[0], after;
    ASSERT_CUDA(listed.f[0].download(after));
    EXPECT_NE(bits_of(after[lists.offset[0][0]]), bits_of(before[lists.offset[0][0]]));
  }
};

TEST_F(AdamWSegments, Fp32ListMatchesTheStepOfEachSegment) {
  for (const auto& h : {hparams(0, 1, 1), hparams(1, 0, 7), hparams(1, 1, 1000)}) {
    SCOPED_TRACE("amsgrad " + std::to_string(h.amsgrad) + ", decoupled " + std::to_string(h.decoupled));
    check(SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32, h, nullptr);
  }
  DeviceArray<float> inv_scale;
  ASSERT_CUDA(inv_scale.allocate_and_upload({1.0f / 512}, 0));
  check(SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32, hparams(0, 1, 3), inv_scale.data());
}

TEST_F(AdamWSegments, MixedListMatchesTheStepOfEachSegment) {
  const std::pair<shardopt_kernel_dtype, shardopt_kernel_dtype> pairs[] = {
      {SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_BFLOAT16},
      {SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_FLOAT32},
      {SHARDOPT_KERNEL_FLOAT16, SHARDOPT_KERNEL_FLOAT16},
      {SHARDOPT_KERNEL_FLOAT16, SHARDOPT_KERNEL_FLOAT32}};
  for (const auto& [copy, grad] : pairs) {
    SCOPED_TRACE("copy dtype " + std::to_string(copy) + ", grad dtype " + std::to_string(grad));
    check(copy, grad, hparams(0, 1, 2), nullptr);
    check(copy, grad, hparams(1, 0, 5), nullptr);
  }
}

// A set found_inf leaves every buffer of every launch untouched.
TEST_F(AdamWSegments, FoundInfSkipsEveryLaunch) {
  const Lists lists(SHARDOPT_KERNEL_FLOAT32);
  DeviceLists listed, untouched;
  ASSERT_TRUE(listed.upload(lists));
  ASSERT_TRUE(untouched.upload(lists));
  DeviceArray<float> found_inf;
  ASSERT_CUDA(found_inf.allocate_and_upload({1.0f}, 0));
  std::vector<shardopt_adamw_segment> segments;
  for (int k = 0; k < kSegments; ++k) segments.push_back(listed.segment(lists, k, true, SHARDOPT_KERNEL_FLOAT32));
  const auto h = hparams(1, 1, 4);
  ASSERT_KERNEL_OK(shardopt_adamw_mixed_segments(segments.data(), kSegments, SHARDOPT_KERNEL_BFLOAT16,
                                                 SHARDOPT_KERNEL_FLOAT32, &h, nullptr, found_inf.data(), stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  EXPECT_TRUE(same_buffers(listed, untouched));
}

TEST_F(AdamWSegments, BadListsAreRefusedAndNothingRuns) {
  const size_t n = 64;
  DeviceArray<float> p, g, m, v, x;
  for (auto* a : {&p, &g, &m, &v, &x}) ASSERT_CUDA(a->allocate(2 * n));
  const auto h = hparams(0, 1, 1);
  const shardopt_adamw_segment first{p.data(), g.data(), nullptr, m.data(), v.data(), nullptr, n};
  const shardopt_adamw_segment second{p.data() + n, g.data() + n, nullptr, m.data() + n, v.data() + n, nullptr, n};
  auto call = [&](std::vector<shardopt_adamw_segment> list) {
    return shardopt_adamw_fp32_segments(list.data(), static_cast<int64_t>(list.size()), &h, nullptr, nullptr, stream_);
  };
  EXPECT_EQ(call({first, second}), SHARDOPT_KERNEL_OK);
  EXPECT_EQ(call({}), SHARDOPT_KERNEL_OK) << "an empty list";
  EXPECT_EQ(call({first, shardopt_adamw_segment{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0}}),
            SHARDOPT_KERNEL_OK)
      << "an empty segment needs no buffers";
  EXPECT_EQ(shardopt_adamw_fp32_segments(nullptr, 1, &h, nullptr, nullptr, stream_), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_adamw_fp32_segments(&first, -1, &h, nullptr, nullptr, stream_), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_adamw_fp32_segments(&first, 1, nullptr, nullptr, nullptr, stream_),
            SHARDOPT_KERNEL_INVALID_ARGUMENT);
  auto overlapping = second;
  overlapping.param = p.data() + n - 1;
  EXPECT_EQ(call({first, overlapping}), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "parameters of two segments overlap";
  auto grad_in_state = second;
  grad_in_state.grad = m.data();
  EXPECT_EQ(call({first, grad_in_state}), SHARDOPT_KERNEL_INVALID_ARGUMENT)
      << "one segment's gradient is another's exp_avg";
  auto negative = second;
  negative.n = -1;
  EXPECT_EQ(call({first, negative}), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  auto with_master = second;
  with_master.master = x.data();
  EXPECT_EQ(call({first, with_master}), SHARDOPT_KERNEL_INVALID_ARGUMENT) << "the fp32 step takes no master";
  auto missing_state = second;
  missing_state.exp_avg_sq = nullptr;
  EXPECT_EQ(call({first, missing_state}), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  const auto amsgrad = hparams(1, 1, 1);
  EXPECT_EQ(shardopt_adamw_fp32_segments(&first, 1, &amsgrad, nullptr, nullptr, stream_),
            SHARDOPT_KERNEL_INVALID_ARGUMENT)
      << "AMSGrad needs max_exp_avg_sq";
  const shardopt_adamw_segment mixed{x.data(), g.data(), p.data(), m.data(), v.data(), nullptr, n};
  EXPECT_EQ(shardopt_adamw_mixed_segments(&mixed, 1, SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_FLOAT32, &h, nullptr,
                                          nullptr, stream_),
            SHARDOPT_KERNEL_OK);
  EXPECT_EQ(shardopt_adamw_mixed_segments(&mixed, 1, SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_FLOAT32, &h, nullptr,
                                          nullptr, stream_),
            SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace shardopt_kernels_test
