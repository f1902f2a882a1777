// The fused step: one pass over each parameter's memory for Adam, AdamW and SGD.
#include <shardopt/optim/fused_step.h>
#include <shardopt/check.h>
#include <shardopt/compat.h>

#include "cuda/kernels_adapter.h"
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

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>

namespace shardopt {

namespace {

namespace optim = torch::optim;
using detail::AdamScalars;
using detail::SgdScalars;

// The loops for this CPU: the widest build it runs.
template <class T>
void adam_kernel(T* p, const T* g, T* m, T* v, T* vmax, int64_t n, const AdamScalars& s) {
  switch (detail::cpu_kernel_level()) {
    case 2: return detail::kernels_avx512::adam(p, g, m, v, vmax, n, s);
    case 1: return detail::kernels_avx2::adam(p, g, m, v, vmax, n, s);
    default: return detail::kernels_default::adam(p, g, m, v, vmax, n, s);
  }
}

template <class T>
void sgd_kernel(T* p, const T* g, T* buf, int64_t n, const SgdScalars& s) {
  switch (detail::cpu_kernel_level()) {
    case 2: return detail::kernels_avx512::sgd(p, g, buf, n, s);
    case 1: return detail::kernels_avx2::sgd(p, g, buf, n, s);
    default: return detail::kernels_default::sgd(p, g, buf, n, s);
  }
}

// What the fused step runs on: a dense contiguous float/double CPU tensor, or an fp32 CUDA
// tensor where this build carries kernels/'s CUDA kernels.
bool dense_cpu_float(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || !t.is_contiguous()) return false;
  if (t.device().is_cuda()) return t.scalar_type() == at::kFloat && detail::cuda_kernels_built();
  return t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

bool amsgrad_of(const optim::OptimizerOptions& o) {
  if (const auto* a = dynamic_cast<const optim::AdamOptions*>(&o)) return a->amsgrad();
  if (const auto* w = dynamic_cast<const optim::AdamWOptions*>(&o)) return w->amsgrad();
  return false;
}

template <class State>
State& state_of(optim::Optimizer& opt, const at::Tensor& p, const std::function<std::unique_ptr<State>()>& make) {
  auto& state = opt.state();
  auto it = state.find(compat::state_key(p));
  if (it == state.end()) it = state.emplace(compat::state_key(p), make()).first;
  return static_cast<State&>(*it->second);
}

const at::Tensor* copy_of(const detail::LowPrecisionCopies& copies, const at::Tensor& p) {
  auto it = copies.find(p.unsafeGetTensorImpl());
  return it == copies.end() ? nullptr : &it->second;
}

template <class Options>
void adam_like_step(optim::Optimizer& opt, bool decoupled, const detail::LowPrecisionCopies& copies) {
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& st = state_of<optim::AdamParamState>(opt, p, [&] {
        auto s = std::make_unique<optim::AdamParamState>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        return s;
      });
      st.step(st.step() + 1);
      AdamScalars s;
      s.lr = o.lr();
      s.beta1 = std::get<0>(o.betas());
      s.beta2 = std::get<1>(o.betas());
      s.eps = o.eps();
      s.weight_decay = o.weight_decay();
      s.decoupled = decoupled;
      s.amsgrad = o.amsgrad();
      const double bc1 = 1 - std::pow(s.beta1, static_cast<double>(st.step()));
      const double bc2 = 1 - std::pow(s.beta2, static_cast<double>(st.step()));
      s.sqrt_bias_correction2 = std::sqrt(bc2);
      s.step_size = s.lr / bc1;
      at::NoGradGuard no_grad;
      const at::Tensor grad = p.grad(), m = st.exp_avg(), v = st.exp_avg_sq();
      const at::Tensor vmax = s.amsgrad ? st.max_exp_avg_sq() : at::Tensor();
      if (const at::Tensor* copy = copy_of(copies, p)) {
        detail::cuda_adam_mixed(*copy, grad, p, m, v, vmax, s, st.step());
        p.unsafeGetTensorImpl()->bump_version();
        copy->unsafeGetTensorImpl()->bump_version();
        continue;
      }
      if (p.is_cuda()) {
        detail::cuda_adam(p, grad, m, v, vmax, s, st.step());
        p.unsafeGetTensorImpl()->bump_version();
        continue;
      }
      AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "shardopt_fused_adam", [&] {
        adam_kernel<scalar_t>(p.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                              v.data_ptr<scalar_t>(), vmax.defined() ? vmax.data_ptr<scalar_t>() : nullptr, p.numel(), s);
      });
      // The state's tensors changed in place: versions follow, as with torch's own step.
      p.unsafeGetTensorImpl()->bump_version();
    }
  }
}

void sgd_step(optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const optim::SGDOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      SgdScalars s;
      s.lr = o.lr();
      s.momentum = o.momentum();
      s.dampening = o.dampening();
      s.weight_decay = o.weight_decay();
      s.nesterov = o.nesterov();
      at::Tensor buf;
      if (s.momentum != 0) {
        auto& state = opt.state();
        auto it = state.find(compat::state_key(p));
        s.first = it == state.end();
        if (s.first) {
          auto st = std::make_unique<optim::SGDParamState>();
          st->momentum_buffer(at::empty_like(p, at::MemoryFormat::Contiguous));
          it = state.emplace(compat::state_key(p), std::move(st)).first;
        }
        buf = static_cast<optim::SGDParamState&>(*it->second).momentum_buffer();
      }
      at::NoGradGuard no_grad;
      if (p.is_cuda()) {
        detail::cuda_sgd(p, p.grad(), buf, s);
        p.unsafeGetTensorImpl()->bump_version();
        continue;
      }
      AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "shardopt_fused_sgd", [&] {
        sgd_kernel<scalar_t>(p.data_ptr<scalar_t>(), p.grad().data_ptr<scalar_t>(),
                             buf.defined() ? buf.data_ptr<scalar_t>() : nullptr, p.numel(), s);
      });
      p.unsafeGetTensorImpl()->bump_version();
    }
  }
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
// (or without the symbol), the helpers come from the inter-op pool (at::launch). Either way the
// range is cut into chunks of whole 64-element blocks (each starts aligned as the tensor does),
// about 8 per thread, taken in order by whichever thread is free, so a thread that starts late
// takes fewer instead of holding back a fixed share. The bodies are plain loops: LibTorch's
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

void detail::parallel_ranges(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (tasks <= 1 || at::in_parallel_region()) {
    body(0, n);
    return;
  }
  Chunks chunks;
  chunks.n = n;
  chunks.chunk = std::max<int64_t>(grain, (n / (tasks * 8) + 63) / 64 * 64);
  chunks.body = &body;
  if (GompParallel parallel = gomp_parallel()) {
    // Every thread of the team (this one included) takes chunks; returns when all are done. The
    // whole team (num_threads 0), as ATen's regions ask for: a smaller one makes libgomp end the
    // surplus threads and the next full region start them again (PyTorch issue 32008); threads
    // beyond `tasks` find no chunk left.
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

std::string fused_step_unsupported(const optim::Optimizer& optimizer) {
  return detail::fused_step_unsupported(optimizer, {});
}

void fused_step(optim::Optimizer& optimizer) { detail::fused_step(optimizer, {}); }

bool detail::adam_like(const optim::Optimizer& optimizer) {
  return dynamic_cast<const optim::Adam*>(&optimizer) != nullptr || dynamic_cast<const optim::AdamW*>(&optimizer) != nullptr;
}

std::string detail::fused_step_unsupported(const optim::Optimizer& optimizer, const LowPrecisionCopies& copies) {
  const bool adam = dynamic_cast<const optim::Adam*>(&optimizer) != nullptr;
  const bool adamw = dynamic_cast<const optim::AdamW*>(&optimizer) != nullptr;
  const bool sgd = dynamic_cast<const optim::SGD*>(&optimizer) != nullptr;
  if (!adam && !adamw && !sgd) return "the optimizer is not torch::optim::Adam, AdamW or SGD";
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (const at::Tensor* copy = copy_of(copies, p)) {
        const at::Tensor& g = p.grad();
        const bool low = copy->scalar_type() == at::kBFloat16 || copy->scalar_type() == at::kHalf;
        if (!(adam || adamw) || !low || !detail::cuda_kernels_built() || !p.is_cuda() ||
            p.scalar_type() != at::kFloat || !p.is_contiguous() || !copy->is_contiguous() ||
            copy->device() != p.device() || copy->numel() != p.numel() || !g.is_contiguous() ||
            g.device() != p.device() || g.numel() != p.numel() ||
            (g.scalar_type() != at::kFloat && g.scalar_type() != copy->scalar_type())) {
          return "a master weight, its gradient or its parameter copy does not fit the mixed CUDA step";
        }
      } else if (!dense_cpu_float(p) || !dense_cpu_float(p.grad()) || p.scalar_type() != p.grad().scalar_type() ||
          p.device() != p.grad().device()) {
        return "a parameter or its gradient is not a dense contiguous float/double CPU tensor (or fp32 CUDA tensor, "
               "with the CUDA kernels built) of the same dtype and device";
      }
      auto it = optimizer.state().find(compat::state_key(p));
      if (it == optimizer.state().end()) continue;
      if (adam || adamw) {
        const auto& st = static_cast<const optim::AdamParamState&>(*it->second);
        for (const auto& t : {st.exp_avg(), st.exp_avg_sq()}) {
          if (!dense_cpu_float(t) || t.scalar_type() != p.scalar_type()) return "an Adam state tensor is not dense";
        }
        if (amsgrad_of(group.options()) && !dense_cpu_float(st.max_exp_avg_sq())) {
          return "an AMSGrad state tensor is not dense";
        }
      } else {
        const auto& buf = static_cast<const optim::SGDParamState&>(*it->second).momentum_buffer();
        if (buf.defined() && (!dense_cpu_float(buf) || buf.scalar_type() != p.scalar_type())) {
          return "a momentum buffer is not dense";
        }
      }
    }
  }
  return {};
}

void detail::fused_step(optim::Optimizer& optimizer, const LowPrecisionCopies& copies) {
  if (dynamic_cast<optim::AdamW*>(&optimizer)) {
    adam_like_step<optim::AdamWOptions>(optimizer, /*decoupled=*/true, copies);
  } else if (dynamic_cast<optim::Adam*>(&optimizer)) {
    adam_like_step<optim::AdamOptions>(optimizer, /*decoupled=*/false, copies);
  } else if (dynamic_cast<optim::SGD*>(&optimizer)) {
    sgd_step(optimizer);
  } else {
    SHARDOPT_CHECK(false, "fused_step: ", fused_step_unsupported(optimizer, copies));
  }
}

}  // namespace shardopt
