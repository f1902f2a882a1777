// 8-bit optimizer state (Note [8-bit state] in csrc/optim/state_codes.cpp) against torchao 0.18
// (tests/python/state_codes_reference.py, run with the project's Python): the dynamic maps, codes
// and scales bit for bit; AdamW on 8-bit moments ends far nearer torchao's AdamW8bit than
// torchao's ends to fp32 AdamW; a tensor stepped in pieces cut on block boundaries (as ranks hold
// it) gives the bits of the whole; SGD's 8-bit momentum stays near fp32 SGD's.
#include "optim/fused_kernels.h"
#include "optim/state_codes.h"

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using detail::kStateBlock;

// Runs state_codes_reference.py `command` and loads what it wrote.
c10::IValue reference(const std::string& command) {
  const std::string out = ::testing::TempDir() + "state_codes_" + command + "_" + std::to_string(::getpid()) + ".pt";
  const std::string cmd = std::string(SHARDOPT_PYTHON_EXE) + " " + SHARDOPT_SOURCE_DIR +
                          "/tests/python/state_codes_reference.py " + command + " " + out;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(out.c_str());
  return torch::pickle_load(bytes);
}

c10::IValue at_key(const c10::IValue& dict, const std::string& key) { return dict.toGenericDict().at(key); }

std::vector<at::Tensor> tensors(const c10::IValue& list) {
  std::vector<at::Tensor> out;
  for (const auto& v : list.toListRef()) out.push_back(v.toTensor());
  return out;
}

TEST(StateCodes, MapsCodesAndScalesAreTorchaosBitForBit) {
  const c10::IValue ref = reference("codes");
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (bool is_signed : {true, false}) {
    const at::Tensor want = at_key(at_key(ref, "maps"), is_signed ? "signed" : "unsigned").toTensor();
    const auto& map = detail::dynamic_map(is_signed);
    ASSERT_EQ(want.numel(), 256);
    EXPECT_TRUE(at::equal(at::from_blob(const_cast<float*>(map.data()), {256}), want)) << "signed " << is_signed;
  }
  const auto values = tensors(at_key(ref, "values"));
  const auto coded = at_key(ref, "coded").toListRef();
  int compared = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    for (const auto& item : coded[i].toGenericDict()) {
      const bool is_signed = item.key().toStringRef() == "signed";
      const auto [codes, scales] = detail::quantise(values[i], is_signed);
      const std::string what = "value " + std::to_string(i) + " " + item.key().toStringRef();
      EXPECT_TRUE(at::equal(codes, at_key(item.value(), "codes").toTensor())) << what;
      EXPECT_TRUE(at::equal(scales, at_key(item.value(), "scales").toTensor())) << what;
      EXPECT_TRUE(at::equal(detail::dequantise(codes, scales, is_signed), at_key(item.value(), "decoded").toTensor()))
          << what;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 5);
}

// body(level, is_signed, map) in every build this CPU runs (cap_cpu_kernels) with both maps;
// returns how many builds ran.
template <class Body>
int in_every_build_with_both_maps(const Body& body) {
  detail::cap_cpu_kernels(-1);
  const int widest = detail::cpu_kernel_level();
  for (int level = 0; level <= widest; ++level) {
    detail::cap_cpu_kernels(level);
    for (bool is_signed : {true, false}) body(level, is_signed, detail::dynamic_map(is_signed).data());
  }
  detail::cap_cpu_kernels(-1);
  return widest + 1;
}

// The step's builds code a block a vector at a time: the same scale and codes as the scalar
// quantise_block (the one checked against torchao above), in every build this CPU runs, for
// blocks of every length, values exactly halfway between two codes, zeros, and NaNs.
TEST(StateCodes, EveryBuildCodesABlockAsTheScalarCodeDoes) {
  std::vector<std::vector<float>> blocks;
  for (int64_t n : {kStateBlock, kStateBlock - 1, int64_t{100}, int64_t{7}, int64_t{1}}) {
    const at::Tensor t = testing::seeded_randn({n}, 40 + n) * 3.0;
    blocks.emplace_back(t.data_ptr<float>(), t.data_ptr<float>() + n);
  }
  for (bool is_signed : {true, false}) {
    const auto& map = detail::dynamic_map(is_signed);
    std::vector<float> halfway{1.0f};  // the block's maximum: every value below is value / 1
    for (int c = 0; c + 1 < 256; c += 3) halfway.push_back(map[c] + (map[c + 1] - map[c]) * 0.5f);
    blocks.push_back(halfway);
  }
  blocks.push_back(std::vector<float>(kStateBlock, 0.0f));
  blocks.push_back({1.0f, std::nanf(""), -2.0f});
  blocks.push_back(blocks[0]);
  blocks.back()[37] = std::nanf("");  // a NaN among the vectors, not in the tail
  int compared = 0;
  const int builds = in_every_build_with_both_maps([&](int level, bool is_signed, const float* map) {
    for (size_t b = 0; b < blocks.size(); ++b) {
      std::vector<float> v = blocks[b];
      if (!is_signed) for (float& x : v) x = std::fabs(x);
      const auto n = static_cast<int64_t>(v.size());
      std::vector<uint8_t> want(v.size()), got(v.size());
      const float s1 = detail::quantise_block(v.data(), n, map, want.data());
      const float s2 = detail::quantise_block_fast(v.data(), n, map, got.data());
      EXPECT_TRUE(s1 == s2 || (std::isnan(s1) && std::isnan(s2))) << "level " << level << ", block " << b;
      if (!std::isnan(s1)) EXPECT_EQ(want, got) << "level " << level << ", block " << b << ", signed " << is_signed;
      ++compared;
    }
  });
  RecordProperty("builds", builds);
  EXPECT_EQ(compared, builds * 2 * static_cast<int>(blocks.size()));
}

// Every build decodes every code, in blocks of every length, to the scalar decoder's values.
TEST(StateCodes, EveryBuildDecodesABlockAsTheScalarCodeDoes) {
  std::vector<uint8_t> codes(kStateBlock);
  for (int64_t j = 0; j < kStateBlock; ++j) codes[j] = static_cast<uint8_t>((j * 97 + 11) % 256);  // each code once
  int compared = 0, differ = 0;
  const int builds = in_every_build_with_both_maps([&](int level, bool, const float* map) {
    for (int64_t n : {kStateBlock, kStateBlock - 1, int64_t{17}, int64_t{16}, int64_t{1}}) {
      for (float scale : {1.0f, 0.0371f, 3.5e-7f}) {
        std::vector<float> want(n), got(n, -99.0f);
        detail::dequantise_block(codes.data(), n, scale, map, want.data());
        detail::decode_block_fast(codes.data(), n, scale, map, got.data());
        for (int64_t j = 0; j < n; ++j) {
          if (std::memcmp(&want[j], &got[j], sizeof(float)) == 0 || ++differ > 3) continue;
          ADD_FAILURE() << "level " << level << ", code " << int(codes[j]) << ", n " << n << ": " << want[j] << " vs "
                        << got[j];
        }
        ++compared;
      }
    }
  });
  EXPECT_EQ(differ, 0);
  RecordProperty("builds", builds);
  EXPECT_EQ(compared, builds * 2 * 5 * 3);
}

// The vector builds find codes by table (Note [Codes by table]): for every float next to a cell's
// threshold, every map value and halfway point, and a million values spread over every magnitude
// of both signs, the code the table gives equals the binary search's.
TEST(StateCodes, TheTableGivesTheSearchsCodeForEveryValueTried) {
  detail::cap_cpu_kernels(-1);
  const int widest = detail::cpu_kernel_level();
  for (int level = 0; level <= widest; ++level)
  for (bool is_signed : {true, false}) {
    detail::cap_cpu_kernels(level);
    const float* map = detail::dynamic_map(is_signed).data();
    const detail::CodeTable* table = detail::code_table(map);
    ASSERT_NE(table, nullptr);
    std::vector<float> xs;
    int boundaries = 0;
    for (float t : table->threshold) {
      if (std::isinf(t)) continue;
      ++boundaries;
      for (float x : {t, std::nextafter(t, -2.0f), std::nextafter(t, 2.0f)}) xs.push_back(x);
    }
    for (int c = 0; c < 256; ++c) {
      xs.push_back(map[c]);
      if (c + 1 < 256) xs.push_back(map[c] + (map[c + 1] - map[c]) * 0.5f);
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const at::Tensor uniform = at::rand({500000}, gen) * 2 - 1;
    const at::Tensor magnitudes = at::pow(10.0, at::rand({500000}, gen) * -12);  // 1e-12 .. 1
    const at::Tensor signs = at::where(at::rand({500000}, gen) < 0.5, -1.0, 1.0);
    const at::Tensor spread = (magnitudes * signs).to(at::kFloat).contiguous();
    xs.insert(xs.end(), uniform.data_ptr<float>(), uniform.data_ptr<float>() + uniform.numel());
    xs.insert(xs.end(), spread.data_ptr<float>(), spread.data_ptr<float>() + spread.numel());
    xs.insert(xs.end(), {0.0f, -0.0f, 1e-38f, -1e-38f, 1e-45f, -1.0f, 1.0f});
    // Blocks led by 1.0: the scale is 1 and every value is coded as it is.
    int64_t differ = 0, tried = 0;
    for (size_t at = 0; at < xs.size(); at += kStateBlock - 1) {
      std::vector<float> block{1.0f};
      for (size_t j = at; j < std::min(xs.size(), at + kStateBlock - 1); ++j) {
        block.push_back(is_signed ? xs[j] : std::fabs(xs[j]));
      }
      const auto n = static_cast<int64_t>(block.size());
      std::vector<uint8_t> want(block.size()), got(block.size());
      ASSERT_EQ(detail::quantise_block(block.data(), n, map, want.data()), 1.0f);
      ASSERT_EQ(detail::quantise_block_fast(block.data(), n, map, got.data()), 1.0f);
      for (int64_t j = 0; j < n; ++j) {
        differ += want[j] != got[j];
        if (want[j] != got[j] && differ < 5) ADD_FAILURE() << "x " << block[j] << ": " << int(want[j]) << " vs " << int(got[j]);
      }
      tried += n;
    }
    EXPECT_EQ(differ, 0) << "level " << level << ", signed " << is_signed;
    EXPECT_GT(tried, 1000000);
    // Beyond the scale (magnitudes of 1 to infinity, NaN) and below the table's smallest cell.
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> edges{1.5f, 2.0f, 3.0f, 1e30f, inf, nan, 5.9e-8f, 6e-8f, 1e-9f, 0.0f};
    for (size_t j = 0, n = edges.size(); j < n; ++j) edges.push_back(-edges[j]);
    std::vector<uint8_t> edge_codes(edges.size());
    detail::code_block_fast(edges.data(), static_cast<int64_t>(edges.size()), 1.0f, map, edge_codes.data());
    for (size_t j = 0; j < edges.size(); ++j) {
      EXPECT_EQ(int(edge_codes[j]), detail::code_of(edges[j], map)) << "x " << edges[j] << ", level " << level;
    }
    EXPECT_GT(boundaries, 200) << "signed " << is_signed;  // the map's boundaries, nearly one per code
  }
  detail::cap_cpu_kernels(-1);
}

// AdamW's scalars for step `t` (1-based), as the fused step computes them.
detail::AdamScalars adamw_scalars(const std::vector<double>& o, int64_t t) {
  detail::AdamScalars s;
  s.lr = o[0], s.beta1 = o[1], s.beta2 = o[2], s.eps = o[3], s.weight_decay = o[4];
  s.decoupled = true;
  s.step_size = s.lr / (1 - std::pow(s.beta1, static_cast<double>(t)));
  s.sqrt_bias_correction2 = std::sqrt(1 - std::pow(s.beta2, static_cast<double>(t)));
  return s;
}

// 8-bit moments of `numel` elements: codes and scales, zero.
struct Moments {
  at::Tensor m, m_scale, v, v_scale;
  explicit Moments(int64_t numel)
      : m(at::zeros({numel}, at::kByte)), m_scale(at::zeros({detail::state_blocks(numel)})),
        v(at::zeros({numel}, at::kByte)), v_scale(at::zeros({detail::state_blocks(numel)})) {}
  // The segment of elements [begin, end) (begin a block boundary) of parameter p.
  detail::Adam8Segment segment(at::Tensor& p, const at::Tensor& g, int64_t begin, int64_t end) {
    const int64_t b = begin / kStateBlock;
    return {p.data_ptr<float>() + begin, g.data_ptr<float>() + begin, m.data_ptr<uint8_t>() + begin,
            m_scale.data_ptr<float>() + b, v.data_ptr<uint8_t>() + begin, v_scale.data_ptr<float>() + b,
            nullptr, nullptr, end - begin};
  }
};

TEST(StateCodes, AdamWOn8BitMomentsEndsFarNearerTorchaosAdamW8bitThanTorchaosEndsToFp32) {
  const c10::IValue ref = reference("adamw8");
  ASSERT_FALSE(::testing::Test::HasFailure());
  std::vector<double> options;
  for (const auto& v : at_key(ref, "options").toListRef()) options.push_back(v.toDouble());
  auto params = tensors(at_key(ref, "init"));
  for (auto& p : params) p = p.contiguous().clone();
  std::vector<Moments> moments;
  for (const auto& p : params) moments.emplace_back(p.numel());
  const auto steps = at_key(ref, "grads").toListRef();
  for (size_t t = 0; t < steps.size(); ++t) {
    const auto grads = tensors(steps[t]);
    std::vector<detail::Adam8Segment> segments;
    for (size_t i = 0; i < params.size(); ++i) segments.push_back(moments[i].segment(params[i], grads[i], 0, params[i].numel()));
    detail::adam8_step(segments.data(), segments.size(), adamw_scalars(options, static_cast<int64_t>(t) + 1));
  }
  const auto torchao = tensors(at_key(ref, "torchao")), fp32 = tensors(at_key(ref, "fp32"));
  double ours_to_torchao = 0, torchao_to_fp32 = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    ours_to_torchao = std::max(ours_to_torchao, (params[i] - torchao[i]).abs().max().item<double>());
    torchao_to_fp32 = std::max(torchao_to_fp32, (torchao[i] - fp32[i]).abs().max().item<double>());
  }
  RecordProperty("ours_to_torchao", std::to_string(ours_to_torchao));
  RecordProperty("torchao_to_fp32", std::to_string(torchao_to_fp32));
  EXPECT_GT(torchao_to_fp32, 1e-4) << "8-bit state changed nothing in torchao";
  EXPECT_LT(ours_to_torchao, 0.05 * torchao_to_fp32) << "ours to torchao " << ours_to_torchao << ", torchao to fp32 "
                                                     << torchao_to_fp32;
}

// Each block has one holder: a tensor stepped as pieces cut on block boundaries, with those pieces
// in any order and any grouping, gives the bits of the whole tensor stepped at once, step after step.
TEST(StateCodes, PiecesCutOnBlockBoundariesStepLikeTheWholeTensor) {
  const int64_t n = 9 * kStateBlock + 77;  // a short last block
  at::Tensor whole = testing::seeded_randn({n}, 3), pieces = whole.clone();
  Moments a(n), b(n);
  for (int64_t t = 1; t <= 4; ++t) {
    const at::Tensor g = testing::seeded_randn({n}, 100 + t) * (t % 2 ? 1e-3 : 10.0);
    detail::AdamScalars s = adamw_scalars({1e-2, 0.9, 0.99, 1e-8, 0.1}, t);
    auto one = a.segment(whole, g, 0, n);
    detail::adam8_step(&one, 1, s);
    // As three ranks would hold it: blocks 0-3, 4, and 5 to the end; the last first.
    std::vector<detail::Adam8Segment> cut{b.segment(pieces, g, 5 * kStateBlock, n),
                                          b.segment(pieces, g, 0, 4 * kStateBlock),
                                          b.segment(pieces, g, 4 * kStateBlock, 5 * kStateBlock)};
    detail::adam8_step(cut.data(), cut.size(), s);
    ASSERT_TRUE(at::equal(whole, pieces)) << "step " << t;
    ASSERT_TRUE(at::equal(a.m, b.m) && at::equal(a.m_scale, b.m_scale) && at::equal(a.v, b.v) &&
                at::equal(a.v_scale, b.v_scale))
        << "step " << t;
  }
}

// SGD with Nesterov momentum on an 8-bit buffer against torch::optim::SGD's fp32 one: the buffer
// decodes to within a fraction of its block's scale, and the parameters stay close.
TEST(StateCodes, SgdOn8BitMomentumStaysNearFp32Sgd) {
  const int64_t n = 16 * kStateBlock;
  at::Tensor p = testing::seeded_randn({n}, 5);
  at::Tensor ref = p.clone().requires_grad_();
  torch::optim::SGD sgd({ref}, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01));
  at::Tensor buf = at::zeros({n}, at::kByte), scales = at::zeros({detail::state_blocks(n)});
  for (int64_t t = 0; t < 10; ++t) {
    const at::Tensor g = testing::seeded_randn({n}, 200 + t);
    ref.mutable_grad() = g.clone();
    sgd.step();
    detail::SgdScalars s;
    s.lr = 0.05, s.momentum = 0.9, s.weight_decay = 0.01, s.nesterov = true, s.first = t == 0;
    detail::Sgd8Segment segment{p.data_ptr<float>(), g.data_ptr<float>(), buf.data_ptr<uint8_t>(),
                                scales.data_ptr<float>(), n};
    detail::sgd8_step(&segment, 1, s);
  }
  const at::Tensor want = static_cast<torch::optim::SGDParamState&>(*sgd.state().begin()->second).momentum_buffer();
  const at::Tensor got = detail::dequantise(buf, scales, /*is_signed=*/true);
  // The signed map's widest gap is about 0.014 of the scale (near +-1); the buffers differ by
  // their rounding, compounded over ten steps.
  const at::Tensor block_scale = scales.repeat_interleave(kStateBlock);
  EXPECT_LT(((got - want).abs() / block_scale).max().item<double>(), 0.05);
  const double moved = (ref.detach() - testing::seeded_randn({n}, 5)).abs().max().item<double>();
  EXPECT_LT((p - ref.detach()).abs().max().item<double>(), 0.02 * moved);
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

// State that leaves a rank decoded (fp32) and is coded again must come back with its codes and its
// scales (Note [Codes of decoded codes]): quantise() alone gives a block whose largest magnitude
// was negative a smaller scale (the signed map ends at about -0.993, not -1); recode() does not,
// and codes fp32 values that are no decoded codes as quantise() does.
TEST(StateCodes, RecodingDecodedCodesGivesBackTheirCodesAndScales) {
  const int64_t n = 40 * kStateBlock + 3;
  for (const bool is_signed : {true, false}) {
    at::Tensor x = testing::seeded_randn({n}, 21) * at::exp(testing::seeded_randn({n}, 22) * 3);
    if (!is_signed) x = x * x;
    const auto [codes, scales] = detail::quantise(x, is_signed);
    const at::Tensor decoded = detail::dequantise(codes, scales, is_signed);
    const auto [again, again_scales] = detail::recode(decoded, is_signed);
    EXPECT_TRUE(again.equal(codes)) << (is_signed ? "signed" : "unsigned");
    EXPECT_TRUE(again_scales.equal(scales)) << (is_signed ? "signed" : "unsigned");
    const auto [plain, plain_scales] = detail::quantise(x, is_signed);
    const auto [fresh, fresh_scales] = detail::recode(x, is_signed);
    EXPECT_TRUE(fresh.equal(plain) && fresh_scales.equal(plain_scales)) << "fp32 values coded otherwise";
    if (is_signed) {
      const auto [naive, naive_scales] = detail::quantise(decoded, is_signed);
      EXPECT_FALSE(naive_scales.equal(scales)) << "no block's largest magnitude was negative: nothing tested";
    }
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
