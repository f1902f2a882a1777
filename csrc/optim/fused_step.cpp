// The fused step: one pass over the memory of each run of parameters with equal options and step
// count, for Adam, AdamW and SGD.
#include <shardopt/optim/fused_step.h>
#include <shardopt/check.h>
#include <shardopt/compat.h>

#include "cuda/kernels_adapter.h"
#include "optim/adjacent.h"
#include "optim/fused_kernels.h"
#include "optim/fused_step_mixed.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <ATen/Config.h>

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>

namespace shardopt {

namespace {

namespace optim = torch::optim;
using detail::AdamScalars;
using detail::SgdScalars;

// The loops for this CPU: the widest build it runs.
template <class T>
void adam_kernel(const std::vector<detail::AdamSegment<T>>& segments, const AdamScalars& s) {
  switch (detail::cpu_kernel_level()) {
    case 3:
    case 2: return detail::kernels_avx512::adam(segments.data(), segments.size(), s);
    case 1: return detail::kernels_avx2::adam(segments.data(), segments.size(), s);
    default: return detail::kernels_default::adam(segments.data(), segments.size(), s);
  }
}

template <class T>
void sgd_kernel(const std::vector<detail::SgdSegment<T>>& segments, const SgdScalars& s) {
  switch (detail::cpu_kernel_level()) {
    case 3:
    case 2: return detail::kernels_avx512::sgd(segments.data(), segments.size(), s);
    case 1: return detail::kernels_avx2::sgd(segments.data(), segments.size(), s);
    default: return detail::kernels_default::sgd(segments.data(), segments.size(), s);
  }
}

// What the fused step runs on: a dense contiguous float/double CPU tensor, or an fp32 CUDA
// tensor where this build carries kernels/'s CUDA kernels.
bool dense_cpu_float(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || !t.is_contiguous()) return false;
  if (t.device().is_cuda()) return t.scalar_type() == at::kFloat && detail::cuda_kernels_built();
  return t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

// The scales of 8-bit codes `codes` (kept alive in `held`), as the 8-bit loops take them.
float* scale_data(const detail::StateScales& scales, const at::Tensor& codes, std::vector<at::Tensor>& held) {
  at::Tensor found = scales ? scales(codes) : at::Tensor();
  TORCH_INTERNAL_ASSERT(found.defined() && found.is_contiguous(), "8-bit state without its scales");
  held.push_back(found);
  return found.data_ptr<float>();
}

// A bf16 state tensor's memory as its bits (the fused step's bf16 loops).
uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// A state tensor the fused step takes beside parameter `p`: dense in p's dtype, or bf16 or 8-bit
// codes with their scales (`scales`) beside an fp32 CPU parameter
// (OSSOptions::state_format(StateFormat::kBFloat16 / kInt8)).
bool fits_state(const at::Tensor& t, const at::Tensor& p, const detail::StateScales& scales) {
  const bool narrow = t.defined() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kByte);
  if (narrow && p.scalar_type() == at::kFloat && p.device().is_cpu()) {
    if (t.scalar_type() == at::kByte && !(scales && scales(t).defined())) return false;
    return t.layout() == at::kStrided && t.is_contiguous() && t.device().is_cpu() && t.numel() == p.numel();
  }
  return dense_cpu_float(t) && t.scalar_type() == p.scalar_type();
}

bool amsgrad_of(const optim::OptimizerOptions& o) {
  if (const auto* a = dynamic_cast<const optim::AdamOptions*>(&o)) return a->amsgrad();
  if (const auto* w = dynamic_cast<const optim::AdamWOptions*>(&o)) return w->amsgrad();
  return false;
}

// What a step did before it knew whether found_inf skips it (CUDA): the state it made and the
// step counts it advanced, taken back when it does (Note [Unscaling in the step]).
struct Taken {
  std::vector<compat::StateKey> created;
  std::vector<optim::AdamParamState*> advanced;

  void undo(optim::Optimizer& opt) const {
    for (auto* st : advanced) st->step(st->step() - 1);
    for (const auto& key : created) opt.state().erase(key);
  }
};

template <class State>
State& state_of(optim::Optimizer& opt, const at::Tensor& p, const std::function<std::unique_ptr<State>()>& make,
                Taken& taken) {
  auto& state = opt.state();
  auto it = state.find(compat::state_key(p));
  if (it == state.end()) {
    it = state.emplace(compat::state_key(p), make()).first;
    taken.created.push_back(compat::state_key(p));
  }
  return static_cast<State&>(*it->second);
}

const at::Tensor& grad_of(const detail::Gradients& grads, const at::Tensor& p) {
  static const at::Tensor none;
  auto it = grads.find(p.unsafeGetTensorImpl());
  return it == grads.end() ? none : it->second;
}

const at::Tensor* copy_of(const detail::LowPrecisionCopies& copies, const at::Tensor& p) {
  auto it = copies.find(p.unsafeGetTensorImpl());
  return it == copies.end() ? nullptr : &it->second;
}

// A state tensor of `p` for `kind`: its slot from `allocate` (zeroed), or a new zeroed tensor.
at::Tensor new_state(const detail::StateAllocator& allocate, const at::Tensor& p, const char* kind) {
  at::Tensor t = allocate ? allocate(p, kind) : at::Tensor();
  return t.defined() ? t : at::zeros_like(p, at::MemoryFormat::Preserve);
}

template <class Options>
AdamScalars adam_scalars(const Options& o, bool decoupled, int64_t step) {
  AdamScalars s;
  s.lr = o.lr();
  s.beta1 = std::get<0>(o.betas());
  s.beta2 = std::get<1>(o.betas());
  s.eps = o.eps();
  s.weight_decay = o.weight_decay();
  s.decoupled = decoupled;
  s.amsgrad = o.amsgrad();
  const double bc1 = 1 - std::pow(s.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(s.beta2, static_cast<double>(step));
  s.sqrt_bias_correction2 = std::sqrt(bc2);
  s.step_size = s.lr / bc1;
  return s;
}

struct AdamEntry {
  at::Tensor p, g, m, v, vmax;
  at::Tensor copy;  // mixed precision on CUDA: the low-precision range p's update is written to
  std::array<at::Tensor*, 6> operands() { return {&p, &g, &m, &v, &vmax, &copy}; }
};

template <class T>
detail::AdamSegment<T> adam_segment(const AdamEntry& e) {
  return {e.p.data_ptr<T>(), e.g.data_ptr<T>(), e.m.data_ptr<T>(), e.v.data_ptr<T>(),
          e.vmax.defined() ? e.vmax.data_ptr<T>() : nullptr, e.p.numel()};
}

// One run: parameters with the same options and step count, adjacent ones joined (Note [Adjacent
// tensors in one pass]). All CPU tensors of a dtype go through one parallel region; the CUDA
// segments go to kernels/ as one list (a launch per 32). Returns the segments stepped.
int64_t adam_run(std::vector<AdamEntry> run, const AdamScalars& s, int64_t step, const detail::StateScales& scales) {
  at::NoGradGuard no_grad;
  for (const auto& e : run) {
    // The state's tensors change in place: versions follow, as with torch's own step.
    e.p.unsafeGetTensorImpl()->bump_version();
    if (e.copy.defined()) e.copy.unsafeGetTensorImpl()->bump_version();
  }
  run = detail::joined_adjacent(std::move(run));
  std::vector<detail::AdamSegment<float>> f32;
  std::vector<detail::AdamSegment<double>> f64;
  std::vector<detail::Adam16Segment> bf16;
  std::vector<detail::Adam8Segment> coded;
  std::vector<at::Tensor> held;  // the coded segments' scales
  std::vector<detail::CudaAdamOperands> cuda;
  for (const auto& e : run) {
    if (e.copy.defined() || e.p.is_cuda()) {
      cuda.push_back({e.p, e.g, e.m, e.v, e.vmax, e.copy});
    } else if (e.m.scalar_type() == at::kByte) {
      float* const m_scale = scale_data(scales, e.m, held);
      float* const v_scale = scale_data(scales, e.v, held);
      float* const vmax_scale = e.vmax.defined() ? scale_data(scales, e.vmax, held) : nullptr;
      coded.push_back({e.p.data_ptr<float>(), e.g.data_ptr<float>(), e.m.data_ptr<uint8_t>(), m_scale,
                       e.v.data_ptr<uint8_t>(), v_scale, e.vmax.defined() ? e.vmax.data_ptr<uint8_t>() : nullptr,
                       vmax_scale, e.p.numel()});
    } else if (e.m.scalar_type() == at::kBFloat16) {
      bf16.push_back({e.p.data_ptr<float>(), e.g.data_ptr<float>(), bf16_bits(e.m), bf16_bits(e.v),
                      e.vmax.defined() ? bf16_bits(e.vmax) : nullptr, e.p.numel()});
    } else if (e.p.scalar_type() == at::kFloat) {
      f32.push_back(adam_segment<float>(e));
    } else {
      f64.push_back(adam_segment<double>(e));
    }
  }
  if (!f32.empty()) adam_kernel(f32, s);
  if (!f64.empty()) adam_kernel(f64, s);
  if (!bf16.empty()) detail::adam16_step(bf16.data(), bf16.size(), s);
  if (!coded.empty()) detail::adam8_step(coded.data(), coded.size(), s);
  if (!cuda.empty()) detail::cuda_adam(cuda, s, step);
  return static_cast<int64_t>(run.size());
}

// The unscale and skip flag of a step (Note [Unscaling in the step]), as the kernels take them.
struct Scaling {
  double inv_scale = 1;
  const float* device_inv_scale = nullptr;
  const float* device_found_inf = nullptr;

  template <class Scalars>
  Scalars applied(Scalars s) const {
    s.inv_scale = inv_scale;
    s.device_inv_scale = device_inv_scale;
    s.device_found_inf = device_found_inf;
    return s;
  }
};

template <class Options>
int64_t adam_like_step(optim::Optimizer& opt, bool decoupled, const detail::FusedStepInputs& in, const Scaling& scaling,
                       Taken& taken) {
  const auto& allocate = in.allocate;
  int64_t segments = 0;
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    // The parameters with a gradient, by their step count after this step: one pass per run.
    std::map<int64_t, std::vector<AdamEntry>> runs;
    for (auto& p : group.params()) {
      const at::Tensor& g = grad_of(in.grads, p);
      if (!g.defined()) continue;
      auto& st = state_of<optim::AdamParamState>(opt, p, [&] {
        auto s = std::make_unique<optim::AdamParamState>();
        s->step(0);
        s->exp_avg(new_state(allocate, p, "exp_avg"));
        s->exp_avg_sq(new_state(allocate, p, "exp_avg_sq"));
        if (o.amsgrad()) s->max_exp_avg_sq(new_state(allocate, p, "max_exp_avg_sq"));
        return s;
      }, taken);
      st.step(st.step() + 1);
      taken.advanced.push_back(&st);
      const at::Tensor* copy = copy_of(in.copies, p);
      runs[st.step()].push_back({p, g, st.exp_avg(), st.exp_avg_sq(), o.amsgrad() ? st.max_exp_avg_sq() : at::Tensor(),
                                 copy ? *copy : at::Tensor()});
    }
    for (auto& [step, run] : runs) {
      segments += adam_run(std::move(run), scaling.applied(adam_scalars(o, decoupled, step)), step, in.scales);
    }
  }
  return segments;
}

struct SgdEntry {
  at::Tensor p, g, buf;
  std::array<at::Tensor*, 3> operands() { return {&p, &g, &buf}; }
};

// As adam_run.
int64_t sgd_run(std::vector<SgdEntry> run, const SgdScalars& s, const detail::StateScales& scales) {
  at::NoGradGuard no_grad;
  for (const auto& e : run) e.p.unsafeGetTensorImpl()->bump_version();
  run = detail::joined_adjacent(std::move(run));
  std::vector<detail::SgdSegment<float>> f32;
  std::vector<detail::SgdSegment<double>> f64;
  std::vector<detail::Sgd16Segment> bf16;
  std::vector<detail::Sgd8Segment> coded;
  std::vector<at::Tensor> held;  // the coded segments' scales
  for (const auto& e : run) {
    if (e.p.is_cuda()) {
      detail::cuda_sgd(e.p, e.g, e.buf, s);
    } else if (e.buf.defined() && e.buf.scalar_type() == at::kByte) {
      coded.push_back({e.p.data_ptr<float>(), e.g.data_ptr<float>(), e.buf.data_ptr<uint8_t>(),
                       scale_data(scales, e.buf, held), e.p.numel()});
    } else if (e.buf.defined() && e.buf.scalar_type() == at::kBFloat16) {
      bf16.push_back({e.p.data_ptr<float>(), e.g.data_ptr<float>(), bf16_bits(e.buf), e.p.numel()});
    } else if (e.p.scalar_type() == at::kFloat) {
      f32.push_back({e.p.data_ptr<float>(), e.g.data_ptr<float>(), e.buf.defined() ? e.buf.data_ptr<float>() : nullptr,
                     e.p.numel()});
    } else {
      f64.push_back({e.p.data_ptr<double>(), e.g.data_ptr<double>(),
                     e.buf.defined() ? e.buf.data_ptr<double>() : nullptr, e.p.numel()});
    }
  }
  if (!f32.empty()) sgd_kernel(f32, s);
  if (!f64.empty()) sgd_kernel(f64, s);
  if (!bf16.empty()) detail::sgd16_step(bf16.data(), bf16.size(), s);
  if (!coded.empty()) detail::sgd8_step(coded.data(), coded.size(), s);
  return static_cast<int64_t>(run.size());
}

int64_t sgd_step(optim::Optimizer& opt, const detail::FusedStepInputs& in, const Scaling& scaling, Taken& taken) {
  int64_t segments = 0;
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const optim::SGDOptions&>(group.options());
    // Two runs: momentum buffers that start as the gradient now, and the others.
    std::vector<SgdEntry> runs[2];
    for (auto& p : group.params()) {
      const at::Tensor& g = grad_of(in.grads, p);
      if (!g.defined()) continue;
      at::Tensor buf;
      bool first = false;
      if (o.momentum() != 0) {
        auto& state = opt.state();
        auto it = state.find(compat::state_key(p));
        first = it == state.end();
        if (first) {
          auto st = std::make_unique<optim::SGDParamState>();
          st->momentum_buffer(new_state(in.allocate, p, "momentum_buffer"));
          it = state.emplace(compat::state_key(p), std::move(st)).first;
          taken.created.push_back(compat::state_key(p));
        }
        buf = static_cast<optim::SGDParamState&>(*it->second).momentum_buffer();
      }
      runs[first ? 1 : 0].push_back({p, g, buf});
    }
    for (int first = 0; first < 2; ++first) {
      if (runs[first].empty()) continue;
      SgdScalars s;
      s.lr = o.lr();
      s.momentum = o.momentum();
      s.dampening = o.dampening();
      s.weight_decay = o.weight_decay();
      s.nesterov = o.nesterov();
      s.first = first == 1;
      segments += sgd_run(std::move(runs[first]), scaling.applied(s), in.scales);
    }
  }
  return segments;
}

}  // namespace

// Note [The fused step's threads]
// The step's ranges run on LibTorch's own intra-op threads. With an OpenMP build of LibTorch
// (the PyPI wheel), those are the team of the libgomp that LibTorch loaded, which this library
// reaches through libgomp's entry point for a parallel region (GOMP_parallel, what a compiler
// emits for `#pragma omp parallel`), looked up in the process: at::parallel_for's OpenMP loop is
// a header template, and this library is not compiled with OpenMP (clang would bring a second
// runtime, LLVM's, beside LibTorch's). Threads of another pool beside the OpenMP team fight it
// for the cores: after every parallel ATen operator, the team's threads spin a while waiting for
// the next, and on two cores a helper from the inter-op pool then barely runs. Without OpenMP
// (or without the symbol), the helpers come from the inter-op pool (at::launch). Either way
// every tensor of a run (parameters stepped with the same scalars) is cut into chunks of whole
// 64-element blocks (each starts aligned as the tensor does), about 8 per thread over the whole
// run, taken in order by whichever thread is free, so a thread that starts late takes fewer
// instead of holding back a fixed share. A run is one parallel region: the threads meet once per
// run, not once per tensor. The bodies are plain loops: LibTorch's
// thread-local state is not carried into the team's threads, so a body must not call ATen.
namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

GompParallel gomp_parallel() {
#if AT_PARALLEL_OPENMP
  static const auto fn = reinterpret_cast<GompParallel>(dlvsym(RTLD_DEFAULT, "GOMP_parallel", "GOMP_4.0"));
  return fn;
#else
  return nullptr;
#endif
}

struct Chunks {
  int64_t n, chunk;
  const std::function<void(int64_t, int64_t)>* body;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::exception_ptr error;

  void work() {
    try {
      for (int64_t begin = next.fetch_add(chunk); begin < n; begin = next.fetch_add(chunk)) {
        (*body)(begin, std::min(n, begin + chunk));
      }
    } catch (...) {
      next.store(n);  // the others stop taking chunks
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
    }
  }
};

}  // namespace

void detail::parallel_segments(const std::vector<int64_t>& sizes, int64_t grain,
                               const std::function<void(size_t, int64_t, int64_t)>& body) {
  int64_t n = 0;
  for (int64_t size : sizes) n += size;
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (tasks <= 1 || at::in_parallel_region()) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      if (sizes[s] > 0) body(s, 0, sizes[s]);
    }
    return;
  }
  // The work items: each segment cut into chunks of whole 64-element blocks from its start.
  const int64_t chunk = std::max<int64_t>(grain, (n / (tasks * 8) + 63) / 64 * 64);
  struct Item {
    size_t segment;
    int64_t begin, end;
  };
  std::vector<Item> items;
  for (size_t s = 0; s < sizes.size(); ++s) {
    for (int64_t begin = 0; begin < sizes[s]; begin += chunk) items.push_back({s, begin, std::min(sizes[s], begin + chunk)});
  }
  const std::function<void(int64_t, int64_t)> run_items = [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) body(items[k].segment, items[k].begin, items[k].end);
  };
  Chunks chunks;
  chunks.n = static_cast<int64_t>(items.size());
  chunks.chunk = 1;
  chunks.body = &run_items;
  if (GompParallel parallel = gomp_parallel()) {
    // Every thread of the team (this one included) takes items; returns when all are done. The
    // whole team (num_threads 0), as ATen's regions ask for: a smaller one makes libgomp end the
    // surplus threads and the next full region start them again (PyTorch issue 32008); threads
    // beyond `tasks` find no item left.
    parallel([](void* c) { static_cast<Chunks*>(c)->work(); }, &chunks, 0, 0);
  } else {
    std::condition_variable done;
    int64_t left = tasks - 1;
    for (int64_t t = 1; t < tasks; ++t) {
      at::launch([&] {
        chunks.work();
        std::lock_guard<std::mutex> lock(chunks.mu);
        if (--left == 0) done.notify_one();
      });
    }
    chunks.work();
    std::unique_lock<std::mutex> lock(chunks.mu);
    done.wait(lock, [&] { return left == 0; });
  }
  if (chunks.error) std::rethrow_exception(chunks.error);
}

namespace {

// The gradients of `optimizer`'s parameters, as their .grad holds them.
detail::FusedStepInputs own_gradients(const optim::Optimizer& optimizer) {
  detail::FusedStepInputs in;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) in.grads.emplace(p.unsafeGetTensorImpl(), p.grad());
    }
  }
  return in;
}

}  // namespace

std::string fused_step_unsupported(const optim::Optimizer& optimizer) {
  return detail::fused_step_unsupported(optimizer, own_gradients(optimizer));
}

void fused_step(optim::Optimizer& optimizer) { detail::fused_step(optimizer, own_gradients(optimizer)); }

// Note [Unscaling in the step]
// ShardedGradScaler::step() without an unscale_() before it gives the fused step the scale's
// inverse and the found-inf flag all ranks agreed on (one-element fp32 tensors on the stepped
// tensors' device) instead of unscaling the gradients in a pass of their own. Each kernel
// multiplies a gradient by inv_scale as it reads it: the one fp32 multiply of ATen's unscale, so
// the step equals unscale-then-step bit for bit, and the gradients stay scaled, as PyTorch's
// fused optimizers leave them. A nonzero flag skips the step. On the CPU the host reads both
// before stepping, so a skipped step makes no state. On CUDA the kernels read them from device
// memory and write nothing when the flag is set, so no launch waits on the host; the host reads
// the flag after the launches, to take back what it did before knowing: the step counts it
// advanced and the state it made.
detail::FusedStepResult detail::fused_step(optim::Optimizer& optimizer, const FusedStepInputs& in) {
  Scaling scaling;
  const bool on_device = in.found_inf.defined() && in.found_inf.is_cuda();
  if (in.found_inf.defined() && !on_device && in.found_inf.item<float>() != 0) return {false, 0};
  if (in.inv_scale.defined()) {
    if (in.inv_scale.is_cuda()) {
      scaling.device_inv_scale = in.inv_scale.data_ptr<float>();
    } else {
      scaling.inv_scale = in.inv_scale.item<float>();
    }
  }
  if (on_device) scaling.device_found_inf = in.found_inf.data_ptr<float>();
  Taken taken;
  int64_t segments = 0;
  if (dynamic_cast<optim::AdamW*>(&optimizer)) {
    segments = adam_like_step<optim::AdamWOptions>(optimizer, /*decoupled=*/true, in, scaling, taken);
  } else if (dynamic_cast<optim::Adam*>(&optimizer)) {
    segments = adam_like_step<optim::AdamOptions>(optimizer, /*decoupled=*/false, in, scaling, taken);
  } else if (dynamic_cast<optim::SGD*>(&optimizer)) {
    segments = sgd_step(optimizer, in, scaling, taken);
  } else {
    SHARDOPT_CHECK(false, "fused_step: ", fused_step_unsupported(optimizer, in));
  }
  if (on_device && in.found_inf.item<float>() != 0) {
    taken.undo(optimizer);
    return {false, segments};
  }
  return {true, segments};
}

at::Tensor detail::found_non_finite(const std::vector<at::Tensor>& tensors, at::Device device) {
  at::NoGradGuard no_grad;
  at::Tensor found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> by_kind;
  for (const auto& t : tensors) {
    if (t.numel() > 0) by_kind[{t.device().str(), t.scalar_type()}].push_back(t);
  }
  for (const auto& [kind, list] : by_kind) {
    // kernels/'s norm gives {largest magnitude, any inf/NaN}; the inf norm is NaN or inf with them.
    const at::Tensor fused = cuda_norm(list, /*inf=*/true);
    const at::Tensor flag = fused.defined()
                                ? fused.narrow(0, 1, 1)
                                : at::stack(at::_foreach_norm(list, INFINITY)).isfinite().logical_not().any().reshape({1});
    found.add_(flag.to(found.options()));
  }
  return found;
}

bool detail::adam_like(const optim::Optimizer& optimizer) {
  return dynamic_cast<const optim::Adam*>(&optimizer) != nullptr || dynamic_cast<const optim::AdamW*>(&optimizer) != nullptr;
}

std::string detail::fused_step_unsupported(const optim::Optimizer& optimizer, const FusedStepInputs& in) {
  const bool adam = dynamic_cast<const optim::Adam*>(&optimizer) != nullptr;
  const bool adamw = dynamic_cast<const optim::AdamW*>(&optimizer) != nullptr;
  const bool sgd = dynamic_cast<const optim::SGD*>(&optimizer) != nullptr;
  if (!adam && !adamw && !sgd) return "the optimizer is not torch::optim::Adam, AdamW or SGD";
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const at::Tensor& g = grad_of(in.grads, p);
      if (!g.defined()) continue;
      if (in.inv_scale.defined() && (in.inv_scale.device() != p.device() || in.found_inf.device() != p.device())) {
        return "the gradient scale is not on every stepped tensor's device";
      }
      if (const at::Tensor* copy = copy_of(in.copies, p)) {
        const bool low = copy->scalar_type() == at::kBFloat16 || copy->scalar_type() == at::kHalf;
        if (!(adam || adamw) || !low || !detail::cuda_kernels_built() || !p.is_cuda() ||
            p.scalar_type() != at::kFloat || !p.is_contiguous() || !copy->is_contiguous() ||
            copy->device() != p.device() || copy->numel() != p.numel() || !g.is_contiguous() ||
            g.device() != p.device() || g.numel() != p.numel() ||
            (g.scalar_type() != at::kFloat && g.scalar_type() != copy->scalar_type())) {
          return "a master weight, its gradient or its parameter copy does not fit the mixed CUDA step";
        }
      } else if (!dense_cpu_float(p) || !dense_cpu_float(g) || p.scalar_type() != g.scalar_type() ||
                 p.device() != g.device()) {
        return "a parameter or its gradient is not a dense contiguous float/double CPU tensor (or fp32 CUDA tensor, "
               "with the CUDA kernels built) of the same dtype and device";
      }
      auto it = optimizer.state().find(compat::state_key(p));
      if (it == optimizer.state().end()) continue;
      if (adam || adamw) {
        const auto& st = static_cast<const optim::AdamParamState&>(*it->second);
        if (!fits_state(st.exp_avg(), p, in.scales) || !fits_state(st.exp_avg_sq(), p, in.scales) ||
            st.exp_avg().scalar_type() != st.exp_avg_sq().scalar_type()) {
          return "an Adam state tensor is not dense";
        }
        if (amsgrad_of(group.options()) && (!fits_state(st.max_exp_avg_sq(), p, in.scales) ||
                                            st.max_exp_avg_sq().scalar_type() != st.exp_avg().scalar_type())) {
          return "an AMSGrad state tensor is not dense";
        }
      } else {
        const auto& buf = static_cast<const optim::SGDParamState&>(*it->second).momentum_buffer();
        if (buf.defined() && !fits_state(buf, p, in.scales)) return "a momentum buffer is not dense";
      }
    }
  }
  return {};
}

}  // namespace shardopt
