// The fused multi-segment norm against a double-precision CPU reference: segments of odd sizes at
// misaligned offsets in one call, every dtype and both kinds, inf and NaN in a segment's head, body
// and tail, no segments, many small segments, and the arguments refused.
#include "support.h"

#include <shardopt_kernels/norm.h>

#include <memory>
#include <string>

namespace shardopt_kernels_test {
namespace {

struct HostSegment {
  std::vector<float> values;  // each representable in the dtype under test
  size_t offset;              // elements into its own allocation
};

struct NormResult {
  float value = -1, found_inf = -1;
};

struct Reference {
  double sum_sq = 0, max_abs = 0;
  bool nonfinite = false;
  void add(float x) {
    sum_sq += static_cast<double>(x) * x;
    if (!std::isnan(x)) max_abs = std::max(max_abs, static_cast<double>(std::fabs(x)));
    nonfinite = nonfinite || !std::isfinite(x);
  }
  float value(shardopt_norm_kind kind) const {
    return static_cast<float>(kind == SHARDOPT_NORM_L2_SQUARED ? sum_sq : max_abs);
  }
};

class NormKernel : public KernelTest {
 protected:
  // Uploads the segments (fp32 values, or their bf16 / fp16 bits) and their descriptors, and runs
  // the norm on the test's stream.
  template <class Storage>
  void run(const std::vector<HostSegment>& segments, shardopt_kernel_dtype dtype, shardopt_norm_kind kind,
           NormResult* out) {
    std::vector<std::unique_ptr<DeviceArray<Storage>>> arrays;
    std::vector<shardopt_norm_segment> descriptors;
    for (const HostSegment& s : segments) {
      std::vector<Storage> host(s.values.size());
      for (size_t i = 0; i < host.size(); ++i) host[i] = encode<Storage>(dtype, s.values[i]);
      arrays.push_back(std::make_unique<DeviceArray<Storage>>());
      ASSERT_CUDA(arrays.back()->allocate_and_upload(host, s.offset));
      descriptors.push_back({arrays.back()->data(), static_cast<int64_t>(host.size())});
    }
    run_descriptors(descriptors, dtype, kind, out);
  }

  void run_descriptors(const std::vector<shardopt_norm_segment>& descriptors, shardopt_kernel_dtype dtype,
                       shardopt_norm_kind kind, NormResult* out) {
    DeviceArray<shardopt_norm_segment> d_descriptors;
    if (!descriptors.empty()) {
      ASSERT_CUDA(d_descriptors.allocate_and_upload(descriptors, 0));
    }
    size_t bytes = 0;
    ASSERT_KERNEL_OK(shardopt_norm_workspace_bytes(&bytes));
    DeviceArray<unsigned char> workspace;
    DeviceArray<float> results;
    ASSERT_CUDA(workspace.allocate(bytes));
    ASSERT_CUDA(results.allocate_and_upload({-7.0f, -7.0f}, 0));
    ASSERT_KERNEL_OK(shardopt_norm(descriptors.empty() ? nullptr : d_descriptors.data(),
                                   static_cast<int64_t>(descriptors.size()), dtype, kind, workspace.data(), bytes,
                                   results.data(), results.data() + 1, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    std::vector<float> host;
    ASSERT_CUDA(results.download(host));
    out->value = host[0];
    out->found_inf = host[1];
  }

  template <class Storage>
  static Storage encode(shardopt_kernel_dtype dtype, float x) {
    if constexpr (std::is_same_v<Storage, float>) {
      return x;
    } else {
      return round_to(dtype, x);
    }
  }

  // Runs `segments` in `dtype` with both kinds and checks value and flag against the reference.
  void check(const std::vector<HostSegment>& segments, shardopt_kernel_dtype dtype) {
    Reference reference;
    for (const HostSegment& s : segments) {
      for (float x : s.values) reference.add(x);
    }
    for (auto kind : {SHARDOPT_NORM_L2_SQUARED, SHARDOPT_NORM_INF}) {
      SCOPED_TRACE("dtype " + std::to_string(static_cast<int>(dtype)) + ", kind " + std::to_string(static_cast<int>(kind)));
      NormResult got;
      if (dtype == SHARDOPT_KERNEL_FLOAT32) {
        run<float>(segments, dtype, kind, &got);
      } else {
        run<uint16_t>(segments, dtype, kind, &got);
      }
      EXPECT_EQ(got.found_inf, reference.nonfinite ? 1.0f : 0.0f);
      const float want = reference.value(kind);
      if (kind == SHARDOPT_NORM_INF) {
        EXPECT_EQ(got.value, want);
      } else {
        EXPECT_TRUE(close_to(got.value, want, 1e-6)) << got.value << " against " << want;
      }
    }
  }
};

// Values in [-2, 2) representable in `dtype`.
std::vector<float> values_in(shardopt_kernel_dtype dtype, size_t n, uint32_t seed) {
  std::vector<float> v = random_floats(n, -2, 2, seed);
  if (dtype != SHARDOPT_KERNEL_FLOAT32) {
    for (float& x : v) x = value_of(dtype, round_to(dtype, x));
  }
  return v;
}

// Sizes and offsets: a single element, a few, odd sizes below and above a chunk, an empty segment,
// one with only a misaligned head and tail, and one aligned whole chunk.
std::vector<HostSegment> odd_segments(shardopt_kernel_dtype dtype) {
  const size_t sizes[] = {1, 3, 1023, 1000003, 0, 17, 4096};
  const size_t offsets[] = {0, 1, 3, 1, 1, 7, 0};
  std::vector<HostSegment> out;
  for (size_t k = 0; k < 7; ++k) out.push_back({values_in(dtype, sizes[k], 100 + static_cast<uint32_t>(k)), offsets[k]});
  return out;
}

const shardopt_kernel_dtype kDtypes[] = {SHARDOPT_KERNEL_FLOAT32, SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_KERNEL_FLOAT16};

TEST_F(NormKernel, OddSegmentsInEveryDtypeAndKind) {
  for (auto dtype : kDtypes) check(odd_segments(dtype), dtype);
}

TEST_F(NormKernel, InfOrNanAnywhereSetsFoundInf) {
  for (auto dtype : kDtypes) {
    struct Plant {
      size_t segment, index;
      float value;
      const char* where;
    };
    const Plant plants[] = {{1, 0, INFINITY, "inf in a misaligned head"},
                            {3, 500001, NAN, "NaN in the body of a large segment"},
                            {2, 1022, -INFINITY, "-inf in the tail"},
                            {0, 0, NAN, "NaN as a whole segment"}};
    for (const Plant& plant : plants) {
      SCOPED_TRACE(plant.where);
      auto segments = odd_segments(dtype);
      segments[plant.segment].values[plant.index] = plant.value;
      check(segments, dtype);
    }
  }
}

TEST_F(NormKernel, NoSegmentsGiveZero) {
  for (auto kind : {SHARDOPT_NORM_L2_SQUARED, SHARDOPT_NORM_INF}) {
    NormResult got;
    run_descriptors({}, SHARDOPT_KERNEL_BFLOAT16, kind, &got);
    EXPECT_EQ(got.value, 0.0f);
    EXPECT_EQ(got.found_inf, 0.0f);
  }
}

// More segments than blocks: chunk 0 of segment s goes to block s mod gridDim.x, wrapping around.
TEST_F(NormKernel, ThousandsOfSmallSegmentsCarvedFromOneBuffer) {
  const size_t segments = 5000;
  std::vector<float> values = values_in(SHARDOPT_KERNEL_FLOAT32, segments * 301, 7);
  DeviceArray<float> buffer;
  ASSERT_CUDA(buffer.allocate_and_upload(values, 0));
  std::vector<shardopt_norm_segment> descriptors;
  Reference reference;
  size_t at = 0;
  for (size_t s = 0; s < segments; ++s) {
    const size_t skip = s % 5, count = (s * 37) % 297;
    at += skip;
    descriptors.push_back({buffer.data() + at, static_cast<int64_t>(count)});
    for (size_t i = 0; i < count; ++i) reference.add(values[at + i]);
    at += count;
  }
  ASSERT_LE(at, values.size());
  for (auto kind : {SHARDOPT_NORM_L2_SQUARED, SHARDOPT_NORM_INF}) {
    NormResult got;
    run_descriptors(descriptors, SHARDOPT_KERNEL_FLOAT32, kind, &got);
    EXPECT_TRUE(close_to(got.value, reference.value(kind), 1e-6)) << got.value << " against " << reference.value(kind);
    EXPECT_EQ(got.found_inf, 0.0f);
  }
}

TEST_F(NormKernel, BadArgumentsAreRefusedAndNothingRuns) {
  size_t bytes = 0;
  ASSERT_KERNEL_OK(shardopt_norm_workspace_bytes(&bytes));
  EXPECT_GT(bytes, 0u);
  EXPECT_EQ(shardopt_norm_workspace_bytes(nullptr), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  DeviceArray<unsigned char> workspace;
  DeviceArray<float> results, data;
  DeviceArray<shardopt_norm_segment> segments;
  ASSERT_CUDA(workspace.allocate(bytes + 16));
  ASSERT_CUDA(results.allocate(2));
  ASSERT_CUDA(data.allocate(8));
  ASSERT_CUDA(segments.allocate_and_upload({{data.data(), 8}}, 0));
  float* r = results.data();
  auto call = [&](int64_t count, shardopt_kernel_dtype dtype, int kind, void* ws, size_t ws_bytes, float* result,
                  float* found) {
    return shardopt_norm(segments.data(), count, dtype, static_cast<shardopt_norm_kind>(kind), ws, ws_bytes, result,
                         found, stream_);
  };
  EXPECT_EQ(call(1, SHARDOPT_KERNEL_FLOAT32, 0, workspace.data(), bytes, r, r + 1), SHARDOPT_KERNEL_OK);
  EXPECT_EQ(call(-1, SHARDOPT_KERNEL_FLOAT32, 0, workspace.data(), bytes, r, r + 1), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(1, SHARDOPT_KERNEL_FLOAT32, 0, workspace.data(), bytes - 1, r, r + 1), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(1, SHARDOPT_KERNEL_FLOAT32, 0, workspace.data() + 4, bytes, r, r + 1), SHARDOPT_KERNEL_INVALID_ARGUMENT)
      << "a workspace that is not 16-byte aligned";
  EXPECT_EQ(call(1, SHARDOPT_KERNEL_FLOAT32, 0, nullptr, bytes, r, r + 1), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(1, SHARDOPT_KERNEL_FLOAT32, 0, workspace.data(), bytes, r, r), SHARDOPT_KERNEL_INVALID_ARGUMENT)
      << "result and found_inf are one float";
  EXPECT_EQ(call(1, SHARDOPT_KERNEL_FLOAT32, 0, workspace.data(), bytes, nullptr, r + 1), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(1, static_cast<shardopt_kernel_dtype>(9), 0, workspace.data(), bytes, r, r + 1),
            SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(call(1, SHARDOPT_KERNEL_FLOAT32, 2, workspace.data(), bytes, r, r + 1), SHARDOPT_KERNEL_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_norm(nullptr, 1, SHARDOPT_KERNEL_FLOAT32, SHARDOPT_NORM_INF, workspace.data(), bytes, r, r + 1,
                          stream_),
            SHARDOPT_KERNEL_INVALID_ARGUMENT)
      << "one segment but no descriptors";
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace shardopt_kernels_test
