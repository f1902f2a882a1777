// Bandwidth of the kernels on one GPU, each iteration timed with CUDA events (manual time):
//   - AdamWFp32:        the fused step in fp32 (reads param, grad, exp_avg, exp_avg_sq; writes three)
//   - AdamWMixedBf16:   bf16 parameters and gradients, fp32 master and state, the bf16 copy written
//   - CopyReference:    cudaMemcpyAsync device to device of as many bytes as the fp32 step moves
//   - StreamReference:  a plain kernel with the fp32 step's traffic (four arrays read, three written)
//   - NormFp32/NormBf16: the L2 norm of one segment
// Each reports GB/s (bytes moved per second) as a counter. The two references are the floor the
// steps are judged against: the copy engine's rate and a kernel doing nothing but the step's loads
// and stores. Sizes that do not fit in free device memory are left out, with a line on stderr.
#include <shardopt_kernels/adamw.h>
#include <shardopt_kernels/norm.h>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

namespace {

constexpr int kThreads = 256;

// Fills `halves` 16-bit words with 0x3F80 | (7 hashed bits): read as bf16, fp16 or (in pairs)
// fp32, every element is a finite number between 1 and 2, and no two neighbours need be equal
// (timing on zeros can flatter a kernel).
__global__ void fill_numbers(uint16_t* p, size_t halves) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < halves; i += stride) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u;
    h ^= h >> 15;
    p[i] = static_cast<uint16_t>(0x3F80u | (h & 0x7Fu));
  }
}

// Device buffers of finite numbers (fill_numbers) for one benchmark, freed when it ends.
class DeviceBuffers {
 public:
  explicit DeviceBuffers(std::initializer_list<size_t> bytes) {
    for (size_t b : bytes) {
      void* p = nullptr;
      bool filled = cudaMalloc(&p, b) == cudaSuccess;
      if (filled) {
        fill_numbers<<<1024, kThreads>>>(static_cast<uint16_t*>(p), b / 2);
        filled = cudaGetLastError() == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
      }
      if (!filled) {
        if (p != nullptr) cudaFree(p);
        cudaGetLastError();
        ok_ = false;
        return;
      }
      buffers_.push_back(p);
    }
  }
  ~DeviceBuffers() {
    for (void* p : buffers_) cudaFree(p);
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;

  bool ok() const { return ok_; }
  template <class T>
  T* get(size_t k) const {
    return static_cast<T*>(buffers_[k]);
  }

 private:
  std::vector<void*> buffers_;
  bool ok_ = true;
};

// One stream and two events for timing, released when the benchmark ends.
class Timing {
 public:
  Timing() {
    cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~Timing() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }
  Timing(const Timing&) = delete;
  Timing& operator=(const Timing&) = delete;

  cudaStream_t stream() const { return stream_; }

  // Runs `launch` once to warm up, then once per iteration between two events; `launch` returns
  // an error message, empty on success. Reports GB/s for `bytes` moved per launch.
  void run(benchmark::State& state, double bytes, const std::function<std::string()>& launch) {
    std::string error = launch();
    if (error.empty() && cudaStreamSynchronize(stream_) != cudaSuccess) error = cudaGetErrorString(cudaGetLastError());
    if (!error.empty()) return state.SkipWithError(error.c_str());
    double seconds = 0;
    for (auto _ : state) {
      cudaEventRecord(start_, stream_);
      error = launch();
      cudaEventRecord(stop_, stream_);
      float ms = 0;
      if (error.empty() &&
          (cudaEventSynchronize(stop_) != cudaSuccess || cudaEventElapsedTime(&ms, start_, stop_) != cudaSuccess)) {
        error = cudaGetErrorString(cudaGetLastError());
      }
      if (!error.empty()) {
        state.SkipWithError(error.c_str());
        break;
      }
      state.SetIterationTime(ms / 1e3);
      seconds += ms / 1e3;
    }
    if (!error.empty()) return;
    state.counters["GB/s"] = bytes * static_cast<double>(state.iterations()) / seconds / 1e9;
    state.counters["bytes"] = bytes;
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

std::string status_message(shardopt_kernel_status status) {
  if (status == SHARDOPT_KERNEL_OK) return {};
  std::string message = shardopt_kernel_status_string(status);
  if (status == SHARDOPT_KERNEL_CUDA_ERROR) {
    message += std::string(": ") + cudaGetErrorString(static_cast<cudaError_t>(shardopt_kernel_last_cuda_error()));
  }
  return message;
}

std::string launch_message() {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? std::string() : std::string(cudaGetErrorString(error));
}

constexpr double kAdamBytesPerParam = 28;  // fp32: 16 read + 12 written; mixed: 14 + 14

shardopt_adamw_hparams adamw_hparams() {
  shardopt_adamw_hparams h{};
  h.lr = 1e-3;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = 0.01;
  h.step = 1;
  h.decoupled = 1;
  return h;
}

void adamw_fp32(benchmark::State& state) {
  const int64_t n = state.range(0);
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  DeviceBuffers b({bytes, bytes, bytes, bytes});
  if (!b.ok()) return state.SkipWithError("cudaMalloc failed");
  const shardopt_adamw_hparams h = adamw_hparams();
  Timing timing;
  timing.run(state, kAdamBytesPerParam * static_cast<double>(n), [&] {
    return status_message(shardopt_adamw_fp32(b.get<float>(0), b.get<float>(1), b.get<float>(2), b.get<float>(3),
                                              nullptr, n, &h, nullptr, nullptr, timing.stream()));
  });
}

void adamw_mixed_bf16(benchmark::State& state) {
  const int64_t n = state.range(0);
  const size_t half = static_cast<size_t>(n) * 2, full = static_cast<size_t>(n) * 4;
  DeviceBuffers b({half, half, full, full, full});
  if (!b.ok()) return state.SkipWithError("cudaMalloc failed");
  const shardopt_adamw_hparams h = adamw_hparams();
  Timing timing;
  timing.run(state, kAdamBytesPerParam * static_cast<double>(n), [&] {
    return status_message(shardopt_adamw_mixed(b.get<void>(0), SHARDOPT_KERNEL_BFLOAT16, b.get<void>(1),
                                               SHARDOPT_KERNEL_BFLOAT16, b.get<float>(2), b.get<float>(3),
                                               b.get<float>(4), nullptr, n, &h, nullptr, nullptr, timing.stream()));
  });
}

// Half of the fp32 step's bytes copied: as many bytes read and written as the step moves.
void copy_reference(benchmark::State& state) {
  const int64_t n = state.range(0);
  const size_t bytes = static_cast<size_t>(kAdamBytesPerParam / 2) * static_cast<size_t>(n);
  DeviceBuffers b({bytes, bytes});
  if (!b.ok()) return state.SkipWithError("cudaMalloc failed");
  Timing timing;
  timing.run(state, 2.0 * static_cast<double>(bytes), [&] {
    const cudaError_t error =
        cudaMemcpyAsync(b.get<void>(1), b.get<void>(0), bytes, cudaMemcpyDeviceToDevice, timing.stream());
    return error == cudaSuccess ? std::string() : std::string(cudaGetErrorString(error));
  });
}

__device__ __forceinline__ float4 plus(float4 a, float4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }

// The fp32 step's loads and stores (16-byte accesses) with an add in place of its math.
__global__ void __launch_bounds__(kThreads)
    stream_like_adamw(float4* __restrict__ p, const float4* __restrict__ g, float4* __restrict__ m,
                      float4* __restrict__ v, int64_t vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    const float4 gi = g[i];
    const float4 pi = p[i], mi = m[i], vi = v[i];
    p[i] = plus(pi, gi);
    m[i] = plus(mi, gi);
    v[i] = plus(vi, gi);
  }
}

void stream_reference(benchmark::State& state) {
  const int64_t n = state.range(0);  // a multiple of 4
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  DeviceBuffers b({bytes, bytes, bytes, bytes});
  if (!b.ok()) return state.SkipWithError("cudaMalloc failed");
  int device = 0, multiprocessors = 0, per_multiprocessor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, stream_like_adamw, kThreads, 0);
  const int64_t wanted = (n / 4 + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, int64_t{multiprocessors} * per_multiprocessor));
  Timing timing;
  timing.run(state, kAdamBytesPerParam * static_cast<double>(n), [&] {
    stream_like_adamw<<<blocks, kThreads, 0, timing.stream()>>>(b.get<float4>(0), b.get<float4>(1), b.get<float4>(2),
                                                                b.get<float4>(3), n / 4);
    return launch_message();
  });
}

void norm(benchmark::State& state, shardopt_kernel_dtype dtype, size_t element_bytes) {
  const int64_t n = state.range(0);
  size_t workspace_bytes = 0;
  shardopt_norm_workspace_bytes(&workspace_bytes);
  DeviceBuffers b({static_cast<size_t>(n) * element_bytes, sizeof(shardopt_norm_segment), workspace_bytes, 8});
  if (!b.ok()) return state.SkipWithError("cudaMalloc failed");
  const shardopt_norm_segment segment{b.get<void>(0), n};
  cudaMemcpy(b.get<shardopt_norm_segment>(1), &segment, sizeof segment, cudaMemcpyHostToDevice);
  Timing timing;
  timing.run(state, static_cast<double>(n) * static_cast<double>(element_bytes), [&] {
    return status_message(shardopt_norm(b.get<shardopt_norm_segment>(1), 1, dtype, SHARDOPT_NORM_L2_SQUARED,
                                        b.get<void>(2), workspace_bytes, b.get<float>(3), b.get<float>(3) + 1,
                                        timing.stream()));
  });
}

// Registers each benchmark at each size whose buffers fit in `free_bytes`; notes the others.
void register_all(size_t free_bytes) {
  struct Entry {
    const char* name;
    double bytes_per_param;  // device memory
    std::function<void(benchmark::State&)> run;
  };
  const std::vector<Entry> entries = {
      {"AdamWFp32", 16, adamw_fp32},
      {"AdamWMixedBf16", 16, adamw_mixed_bf16},
      {"CopyReference", kAdamBytesPerParam, copy_reference},
      {"StreamReference", 16, stream_reference},
      {"NormFp32", 4, [](benchmark::State& s) { norm(s, SHARDOPT_KERNEL_FLOAT32, 4); }},
      {"NormBf16", 2, [](benchmark::State& s) { norm(s, SHARDOPT_KERNEL_BFLOAT16, 2); }},
  };
  const int64_t sizes[] = {int64_t{1} << 20, int64_t{16} << 20, 100'000'000, 1'000'000'000};
  for (const Entry& e : entries) {
    for (int64_t n : sizes) {
      const double needed = e.bytes_per_param * static_cast<double>(n) + (64 << 20);
      if (needed > static_cast<double>(free_bytes)) {
        std::fprintf(stderr, "kernels_bench: %s/%lld left out: needs %.1f GB, %.1f GB free\n", e.name,
                     static_cast<long long>(n), needed / 1e9, static_cast<double>(free_bytes) / 1e9);
        continue;
      }
      benchmark::RegisterBenchmark(e.name, e.run)->Arg(n)->UseManualTime()->Unit(benchmark::kMillisecond);
    }
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
  if (cudaGetDeviceProperties(&properties, 0) != cudaSuccess || cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    std::fprintf(stderr, "kernels_bench: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  benchmark::AddCustomContext("device", properties.name);
  register_all(free_bytes);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
