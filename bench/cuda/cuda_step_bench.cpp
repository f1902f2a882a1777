// The optimizer step on one GPU, each iteration timed with CUDA events (manual time), on random
// data (never zeros), rotating over enough copies of the buffers that they do not sit in L2:
//
//   Copy/n                  ATen's device-to-device copy moving the bytes an fp32 AdamW step moves
//                           (28 per element, read + written): the bandwidth the steps are judged by
//   AdamWFp32/{Shardopt,Aten}/n
//                           kernels/'s fused step against at::_fused_adamw_ on the same flat
//                           tensors (parameter, gradient, exp_avg, exp_avg_sq)
//   AdamW8/Shardopt/n       kernels/'s step on 8-bit moments (shardopt_kernels/adamw8.h: codes of
//                           the dynamic maps and a scale per 256 elements), to set beside
//                           AdamWFp32/Shardopt/n: 16 bytes an element read + written, against 28
//   AdamWMixed{Bf16,Fp32}Grad/{Shardopt,Aten}/n
//                           bf16 parameters, fp32 master and state, gradients in bf16 or fp32:
//                           kernels/'s mixed step (the bf16 copy written in the same pass) against
//                           the best ATen composition of the same update: the gradient upcast (bf16
//                           gradients only: at::_fused_adamw_ refuses a gradient whose dtype is not
//                           the parameter's), at::_fused_adamw_ on the master, and the cast into the
//                           bf16 parameter
//   Norm{Fp32,Bf16}/{Shardopt,Aten}/n
//                           the L2 norm over 8 segments: kernels/'s two-stage norm (with its
//                           non-finite flag) against at::_foreach_norm and the norm of those norms
//   OssStep/{Oss,TorchOptim,AtenFused}/gpt2
//                           the whole step over GPT-2 small's 148 parameters (124M elements): OSS
//                           (world 1, NCCL) against torch::optim::AdamW::step and against
//                           at::_fused_adamw_ over the same list
//   OssStep/{OssMixed,AtenMixed}/gpt2
//                           the same with bf16 parameters and gradients and fp32 masters: OSS
//                           under MixedPrecision(bf16) against ATen's composition (gradients
//                           upcast, at::_fused_adamw_ on the masters, the masters cast into the
//                           parameters, each a multi-tensor call)
// Every OssStep benchmark also reports `launches`: the kernels one step launches, counted by the
// Kineto profiler around one step after the warm-up (memory copies and sets not counted), and
// `host_ms`: the host's time to enqueue one step.
//   TrainStep/{ShardedDdp,TorchOptim}/mlp
//                           a whole training step of a 33.6M-parameter MLP: OSS + ShardedDDP
//                           (world 1, NCCL) against the module with torch::optim::AdamW
//
// Every benchmark reports GB/s: the bytes its update must move (TrainStep: the optimizer's), per
// second. On a machine without a CUDA device the program prints "no CUDA device" and exits with
// status 1.
#include "models/gpt2.h"
#include <shardopt/comm/process_group.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include "csrc/optim/state_codes.h"
#include <shardopt_kernels/adamw.h>
#include <shardopt_kernels/adamw8.h>
#include <shardopt_kernels/norm.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <kineto/ActivityType.h>

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace {

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Copies of a benchmark's buffers: enough that together they are four times the L2 cache.
int64_t copies_for(double bytes_per_copy) {
  int device = 0, l2 = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  return std::max<int64_t>(1, static_cast<int64_t>(4.0 * l2 / bytes_per_copy + 1));
}

// Runs `launch(copy)` once per copy to warm up, then once per iteration (copy = iteration modulo
// `copies`) between two events on the current stream; reports GB/s for `bytes` moved per launch.
void run(benchmark::State& state, double bytes, int64_t copies, const std::function<void(int64_t)>& launch) {
  try {
    for (int64_t c = 0; c < copies; ++c) launch(c);
    AT_CUDA_CHECK(cudaStreamSynchronize(stream()));
    cudaEvent_t start = nullptr, stop = nullptr;
    AT_CUDA_CHECK(cudaEventCreate(&start));
    AT_CUDA_CHECK(cudaEventCreate(&stop));
    double seconds = 0;
    int64_t i = 0;
    for (auto _ : state) {
      AT_CUDA_CHECK(cudaEventRecord(start, stream()));
      launch(i++ % copies);
      AT_CUDA_CHECK(cudaEventRecord(stop, stream()));
      AT_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      AT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      state.SetIterationTime(ms / 1e3);
      seconds += ms / 1e3;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    state.counters["GB/s"] = bytes * static_cast<double>(state.iterations()) / seconds / 1e9;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
}

void check(shardopt_kernel_status status) {
  TORCH_CHECK(status == SHARDOPT_KERNEL_OK, shardopt_kernel_status_string(status), " (",
              cudaGetErrorString(static_cast<cudaError_t>(shardopt_kernel_last_cuda_error())), ")");
}

at::Tensor uniform(int64_t n, at::ScalarType dtype, double lo, double hi) {
  return at::empty({n}, at::TensorOptions().device(at::kCUDA).dtype(dtype)).uniform_(lo, hi);
}

constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kWeightDecay = 0.01, kEps = 1e-8;

shardopt_adamw_hparams hparams(int64_t step) {
  shardopt_adamw_hparams h{};
  h.lr = kLr;
  h.beta1 = kBeta1;
  h.beta2 = kBeta2;
  h.eps = kEps;
  h.weight_decay = kWeightDecay;
  h.step = step;
  h.decoupled = 1;
  return h;
}

void aten_adamw(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                const at::Tensor& step) {
  at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, kLr, kBeta1, kBeta2, kWeightDecay, kEps, false, false);
}

// One copy of an AdamW step's buffers: parameter (param dtype), gradient (grad dtype), and the
// fp32 master (mixed only), exp_avg, exp_avg_sq, an fp32 gradient for ATen's composition, step.
struct AdamBuffers {
  AdamBuffers(int64_t n, at::ScalarType param_dtype, at::ScalarType grad_dtype, bool mixed) {
    p = uniform(n, param_dtype, -1, 1);
    g = uniform(n, grad_dtype, -1e-2, 1e-2);
    m = uniform(n, at::kFloat, -1e-3, 1e-3);
    v = uniform(n, at::kFloat, 0, 1e-4);
    if (mixed) {
      master = p.to(at::kFloat);
      if (grad_dtype != at::kFloat) g32 = at::empty({n}, m.options());
    }
    step = at::zeros({}, m.options());
  }
  at::Tensor p, g, m, v, master, g32, step;
};

constexpr double kAdamBytes = 28;  // per element: fp32 16 read + 12 written; mixed 14 + 14

void copy_bench(benchmark::State& state) {
  const int64_t n = state.range(0), words = n * static_cast<int64_t>(kAdamBytes) / 8;  // 14n bytes each way
  std::vector<std::pair<at::Tensor, at::Tensor>> sets;
  const int64_t copies = copies_for(2.0 * words * 4);
  for (int64_t c = 0; c < copies; ++c) sets.emplace_back(uniform(words, at::kFloat, -1, 1), uniform(words, at::kFloat, -1, 1));
  run(state, 8.0 * words, copies, [&](int64_t c) { sets[c].second.copy_(sets[c].first); });
}

void adamw_fp32_bench(benchmark::State& state, bool ours) {
  const int64_t n = state.range(0);
  const int64_t copies = copies_for(16.0 * n);
  std::vector<AdamBuffers> sets;
  for (int64_t c = 0; c < copies; ++c) sets.emplace_back(n, at::kFloat, at::kFloat, false);
  int64_t step = 0;
  run(state, kAdamBytes * n, copies, [&](int64_t c) {
    const AdamBuffers& b = sets[c];
    if (!ours) return aten_adamw(b.p, b.g, b.m, b.v, b.step);
    const shardopt_adamw_hparams h = hparams(1 + step++ / copies);
    check(shardopt_adamw_fp32(b.p.data_ptr<float>(), b.g.data_ptr<float>(), b.m.data_ptr<float>(), b.v.data_ptr<float>(),
                              nullptr, n, &h, nullptr, nullptr, stream()));
  });
}

void adamw8_bench(benchmark::State& state) {
  const int64_t n = state.range(0), blocks = (n + SHARDOPT_ADAMW8_BLOCK - 1) / SHARDOPT_ADAMW8_BLOCK;
  auto map_of = [](bool is_signed) {
    const auto& map = shardopt::detail::dynamic_map(is_signed);
    return at::from_blob(const_cast<float*>(map.data()), {256}, at::kFloat).to(at::kCUDA);
  };
  const at::Tensor signed_map = map_of(true), unsigned_map = map_of(false);
  struct Buffers {
    at::Tensor p, g, m, m_scale, v, v_scale;
  };
  const int64_t copies = copies_for(10.0 * n);
  std::vector<Buffers> sets;
  for (int64_t c = 0; c < copies; ++c) {
    auto codes = [&] { return at::randint(0, 256, {n}, at::TensorOptions().device(at::kCUDA).dtype(at::kByte)); };
    sets.push_back({uniform(n, at::kFloat, -1, 1), uniform(n, at::kFloat, -1e-2, 1e-2), codes(),
                    uniform(blocks, at::kFloat, 1e-4, 1e-3), codes(), uniform(blocks, at::kFloat, 1e-6, 1e-5)});
  }
  int64_t step = 0;
  run(state, 16.0 * n, copies, [&](int64_t c) {
    Buffers& b = sets[c];
    const shardopt_adamw_hparams h = hparams(1 + step++ / copies);
    const shardopt_adamw8_segment segment{b.p.data_ptr<float>(),  b.g.data_ptr<float>(),     b.m.data_ptr<uint8_t>(),
                                          b.m_scale.data_ptr<float>(), b.v.data_ptr<uint8_t>(), b.v_scale.data_ptr<float>(),
                                          nullptr, nullptr, n};
    check(shardopt_adamw8(&segment, &h, signed_map.data_ptr<float>(), unsigned_map.data_ptr<float>(), nullptr, nullptr,
                          stream()));
  });
}

enum class Mixed { kShardopt, kAten };

void adamw_mixed_bench(benchmark::State& state, at::ScalarType grad_dtype, Mixed how) {
  const bool ours = how == Mixed::kShardopt;
  const int64_t n = state.range(0);
  const double grad_bytes = grad_dtype == at::kFloat ? 4 : 2;
  const int64_t copies = copies_for((2 + grad_bytes + 12 + (ours ? 0 : 4)) * n);
  std::vector<AdamBuffers> sets;
  for (int64_t c = 0; c < copies; ++c) sets.emplace_back(n, at::kBFloat16, grad_dtype, true);
  // ours: 2 + 4 + 4 + 4 (grad + master, m, v) read with a bf16 gradient, 4 + 4 + 4 + 2 written.
  const double bytes = (grad_bytes + 12) + 14;
  int64_t step = 0;
  run(state, bytes * n, copies, [&](int64_t c) {
    const AdamBuffers& b = sets[c];
    if (ours) {
      const shardopt_adamw_hparams h = hparams(1 + step++ / copies);
      check(shardopt_adamw_mixed(b.p.data_ptr(), SHARDOPT_KERNEL_BFLOAT16, b.g.data_ptr(),
                                 grad_dtype == at::kFloat ? SHARDOPT_KERNEL_FLOAT32 : SHARDOPT_KERNEL_BFLOAT16,
                                 b.master.data_ptr<float>(), b.m.data_ptr<float>(), b.v.data_ptr<float>(), nullptr, n,
                                 &h, nullptr, nullptr, stream()));
      return;
    }
    const at::Tensor g = b.g32.defined() ? b.g32.copy_(b.g) : b.g;
    aten_adamw(b.master, g, b.m, b.v, b.step);
    b.p.copy_(b.master);
  });
}

void norm_bench(benchmark::State& state, at::ScalarType dtype, bool ours) {
  const int64_t n = state.range(0), segments = 8;
  const double element = dtype == at::kFloat ? 4 : 2;
  const int64_t copies = copies_for(element * n);
  std::vector<std::vector<at::Tensor>> sets;
  std::vector<at::Tensor> descriptors;
  for (int64_t c = 0; c < copies; ++c) {
    const at::Tensor flat = uniform(n, dtype, -1, 1);
    sets.push_back(flat.chunk(segments));
    std::vector<shardopt_norm_segment> host;
    for (const auto& t : sets.back()) host.push_back({t.data_ptr(), t.numel()});
    at::Tensor d = at::empty({static_cast<int64_t>(host.size() * sizeof(shardopt_norm_segment))}, at::kByte);
    std::memcpy(d.data_ptr(), host.data(), host.size() * sizeof(shardopt_norm_segment));
    descriptors.push_back(d.to(at::kCUDA));
  }
  size_t workspace_bytes = 0;
  check(shardopt_norm_workspace_bytes(&workspace_bytes));
  const at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, at::TensorOptions().device(at::kCUDA).dtype(at::kByte));
  const at::Tensor out = at::empty({2}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  const auto kind = dtype == at::kFloat ? SHARDOPT_KERNEL_FLOAT32 : SHARDOPT_KERNEL_BFLOAT16;
  at::Tensor total;
  run(state, element * n, copies, [&](int64_t c) {
    if (ours) {
      check(shardopt_norm(static_cast<const shardopt_norm_segment*>(descriptors[c].data_ptr()), segments, kind,
                          SHARDOPT_NORM_L2_SQUARED, workspace.data_ptr(), workspace_bytes, out.data_ptr<float>(),
                          out.data_ptr<float>() + 1, stream()));
    } else {
      total = at::linalg_vector_norm(at::stack(at::_foreach_norm(sets[c], 2)), 2);
    }
  });
}

// GPT-2 small's parameters: embeddings, 12 blocks, the final layer norm (124M elements).
std::vector<at::Tensor> gpt2_parameters() {
  std::vector<at::Tensor> params;
  for (const auto& [name, shape] : shardopt::models::gpt2_shapes()) {
    at::Tensor p = at::empty(shape, at::TensorOptions().device(at::kCUDA)).uniform_(-0.1, 0.1).requires_grad_();
    p.mutable_grad() = at::empty_like(p).uniform_(-1e-2, 1e-2);
    params.push_back(p);
  }
  return params;
}

enum class Stepper { kOss, kTorchOptim, kAtenFused, kOssMixed, kAtenMixed };

// The kernels `fn` launches on the device, counted by the Kineto profiler (memory copies and sets
// are other activities, not counted).
int64_t kernel_launches(const std::function<void()>& fn) {
  namespace prof = torch::profiler::impl;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  const std::set<prof::ActivityType> activities{prof::ActivityType::CPU, prof::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  fn();
  AT_CUDA_CHECK(cudaDeviceSynchronize());
  const auto result = torch::autograd::profiler::disableProfiler();
  int64_t kernels = 0;
  for (const auto& e : result->events()) {
    kernels += e.activityType() == static_cast<uint8_t>(libkineto::ActivityType::CONCURRENT_KERNEL);
  }
  return kernels;
}

// The host's time to enqueue one step (the median of 21, each after the device is idle): where it
// exceeds the device's, the device waits on the host and the step's time is the host's.
double host_enqueue_ms(const std::function<void(int64_t)>& step) {
  std::vector<double> ms;
  for (int k = 0; k < 21; ++k) {
    AT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto start = std::chrono::steady_clock::now();
    step(0);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  AT_CUDA_CHECK(cudaDeviceSynchronize());
  std::nth_element(ms.begin(), ms.begin() + 10, ms.end());
  return ms[10];
}

void oss_step_bench(benchmark::State& state, Stepper stepper) {
  try {
    const bool mixed = stepper == Stepper::kOssMixed || stepper == Stepper::kAtenMixed;
    std::vector<at::Tensor> params = gpt2_parameters();
    if (mixed) {  // bf16 parameters and gradients
      for (auto& p : params) {
        const at::Tensor g = p.grad().to(at::kBFloat16);
        p = p.detach().to(at::kBFloat16).requires_grad_();
        p.mutable_grad() = g;
      }
    }
    int64_t n = 0;
    for (const auto& p : params) n += p.numel();
    std::vector<at::Tensor> masters, wide_grads;
    const torch::optim::AdamWOptions options = torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay);
    std::function<void(int64_t)> step;
    std::shared_ptr<shardopt::ProcessGroup> group;
    std::unique_ptr<shardopt::OSS> oss;
    std::unique_ptr<torch::optim::AdamW> plain;
    std::vector<at::Tensor> grads, ms, vs, steps;
    if (stepper == Stepper::kOss || stepper == Stepper::kOssMixed) {
      group = shardopt::init_process_group(c10::make_intrusive<c10d::HashStore>(),
                                           shardopt::InitOptions().backend("nccl").rank(0).world_size(1));
      shardopt::OSSOptions oss_options;
      if (mixed) oss_options.mixed_precision(shardopt::MixedPrecision().param_dtype(at::kBFloat16));
      oss = std::make_unique<shardopt::OSS>(params, shardopt::optimizer<torch::optim::AdamW>(options), group,
                                            oss_options);
      step = [&](int64_t) { oss->step(); };
    } else if (stepper == Stepper::kAtenMixed) {
      for (const auto& p : params) {
        masters.push_back(p.detach().to(at::kFloat));
        wide_grads.push_back(at::empty_like(masters.back()));
        grads.push_back(p.grad());
        ms.push_back(at::zeros_like(masters.back()));
        vs.push_back(at::zeros_like(masters.back()));
        steps.push_back(at::zeros({}, masters.back().options()));
      }
      std::vector<at::Tensor> bf16_params;
      for (const auto& p : params) bf16_params.push_back(p.detach());
      step = [&, bf16_params](int64_t) {
        at::NoGradGuard no_grad;
        at::_foreach_copy_(wide_grads, grads);
        at::_fused_adamw_(masters, wide_grads, ms, vs, {}, steps, kLr, kBeta1, kBeta2, kWeightDecay, kEps, false,
                          false);
        at::_foreach_copy_(bf16_params, masters);
      };
    } else if (stepper == Stepper::kTorchOptim) {
      plain = std::make_unique<torch::optim::AdamW>(params, options);
      step = [&](int64_t) { plain->step(); };
    } else {
      for (const auto& p : params) {
        grads.push_back(p.grad());
        ms.push_back(at::zeros_like(p));
        vs.push_back(at::zeros_like(p));
        steps.push_back(at::zeros({}, p.options()));
      }
      step = [&](int64_t) {
        at::NoGradGuard no_grad;
        at::_fused_adamw_(params, grads, ms, vs, {}, steps, kLr, kBeta1, kBeta2, kWeightDecay, kEps, false, false);
      };
    }
    step(0);  // warm-up: the first step makes the state (and OSS its slabs)
    state.counters["launches"] = static_cast<double>(kernel_launches([&] { step(0); }));
    state.counters["host_ms"] = host_enqueue_ms(step);
    // (mixed: the bytes of an fp32 AdamW element, as the other OssStep runs, so GB/s compares)
    run(state, kAdamBytes * n, 1, step);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
}

// A whole training step (zero_grad, forward, backward, step) of an MLP of 4 blocks of
// 1024 -> 4096 -> 1024 (33.6M parameters) on a batch of 256: OSS + ShardedDDP (world 1, NCCL)
// against the module with torch::optim::AdamW.
void train_step_bench(benchmark::State& state, bool sharded) {
  try {
    torch::manual_seed(0);
    torch::nn::Sequential model;
    for (int block = 0; block < 4; ++block) {
      model->push_back(torch::nn::Linear(1024, 4096));
      model->push_back(torch::nn::GELU());
      model->push_back(torch::nn::Linear(4096, 1024));
    }
    model->to(at::kCUDA);
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    const at::Tensor x = at::randn({256, 1024}, at::kCUDA), y = at::randn({256, 1024}, at::kCUDA);
    const torch::optim::AdamWOptions options = torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay);
    std::function<void(int64_t)> step;
    std::shared_ptr<shardopt::ProcessGroup> group;
    std::unique_ptr<shardopt::OSS> oss;
    std::unique_ptr<shardopt::ShardedDDP> ddp;
    std::unique_ptr<torch::optim::AdamW> plain;
    if (sharded) {
      group = shardopt::init_process_group(c10::make_intrusive<c10d::HashStore>(),
                                           shardopt::InitOptions().backend("nccl").rank(0).world_size(1));
      oss = std::make_unique<shardopt::OSS>(model->parameters(), shardopt::optimizer<torch::optim::AdamW>(options), group);
      ddp = std::make_unique<shardopt::ShardedDDP>(model.ptr(), *oss);
      step = [&](int64_t) {
        ddp->zero_grad(true);
        ddp->forward(x).sub(y).pow(2).mean().backward();
        oss->step();
      };
    } else {
      plain = std::make_unique<torch::optim::AdamW>(model->parameters(), options);
      step = [&](int64_t) {
        plain->zero_grad();
        model->forward(x).sub(y).pow(2).mean().backward();
        plain->step();
      };
    }
    run(state, kAdamBytes * n, 1, step);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
}

void register_all(size_t free_bytes) {
  const int64_t sizes[] = {int64_t{1} << 20, int64_t{16} << 20, 100'000'000, 400'000'000, 1'000'000'000};
  struct Entry {
    std::string name;
    double bytes_per_element;  // device memory of one copy
    std::function<void(benchmark::State&)> run;
  };
  const std::vector<Entry> entries = {
      {"Copy", kAdamBytes, copy_bench},
      {"AdamWFp32/Shardopt", 16, [](benchmark::State& s) { adamw_fp32_bench(s, true); }},
      {"AdamWFp32/Aten", 16, [](benchmark::State& s) { adamw_fp32_bench(s, false); }},
      {"AdamW8/Shardopt", 10, adamw8_bench},
      {"AdamWMixedBf16Grad/Shardopt", 16, [](benchmark::State& s) { adamw_mixed_bench(s, at::kBFloat16, Mixed::kShardopt); }},
      {"AdamWMixedBf16Grad/Aten", 20, [](benchmark::State& s) { adamw_mixed_bench(s, at::kBFloat16, Mixed::kAten); }},
      {"AdamWMixedFp32Grad/Shardopt", 18, [](benchmark::State& s) { adamw_mixed_bench(s, at::kFloat, Mixed::kShardopt); }},
      {"AdamWMixedFp32Grad/Aten", 18, [](benchmark::State& s) { adamw_mixed_bench(s, at::kFloat, Mixed::kAten); }},
      {"NormFp32/Shardopt", 4, [](benchmark::State& s) { norm_bench(s, at::kFloat, true); }},
      {"NormFp32/Aten", 4, [](benchmark::State& s) { norm_bench(s, at::kFloat, false); }},
      {"NormBf16/Shardopt", 2, [](benchmark::State& s) { norm_bench(s, at::kBFloat16, true); }},
      {"NormBf16/Aten", 2, [](benchmark::State& s) { norm_bench(s, at::kBFloat16, false); }},
  };
  for (const Entry& e : entries) {
    for (int64_t n : sizes) {
      const double needed = e.bytes_per_element * static_cast<double>(n) * 1.1 + (512 << 20);
      if (needed > static_cast<double>(free_bytes)) {
        std::fprintf(stderr, "cuda_step_bench: %s/%lld left out: needs %.1f GB, %.1f GB free\n", e.name.c_str(),
                     static_cast<long long>(n), needed / 1e9, static_cast<double>(free_bytes) / 1e9);
        continue;
      }
      benchmark::RegisterBenchmark(e.name.c_str(), e.run)->Arg(n)->UseManualTime()->Unit(benchmark::kMillisecond);
    }
  }
  for (const auto& [name, stepper] : std::vector<std::pair<std::string, Stepper>>{
           {"OssStep/Oss/gpt2", Stepper::kOss}, {"OssStep/TorchOptim/gpt2", Stepper::kTorchOptim},
           {"OssStep/AtenFused/gpt2", Stepper::kAtenFused}, {"OssStep/OssMixed/gpt2", Stepper::kOssMixed},
           {"OssStep/AtenMixed/gpt2", Stepper::kAtenMixed}}) {
    const Stepper s = stepper;
    benchmark::RegisterBenchmark(name.c_str(), [s](benchmark::State& state) { oss_step_bench(state, s); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const bool sharded : {true, false}) {
    benchmark::RegisterBenchmark(sharded ? "TrainStep/ShardedDdp/mlp" : "TrainStep/TorchOptim/mlp",
                                 [sharded](benchmark::State& state) { train_step_bench(state, sharded); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp properties{};
  size_t free_bytes = 0, total_bytes = 0;
  AT_CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));
  AT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  benchmark::AddCustomContext("device", properties.name);
  register_all(free_bytes);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
