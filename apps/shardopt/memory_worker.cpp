#include "memory_worker.h"

#include "shard_plan.h"

#include <shardopt/shardopt.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <malloc.h>

#include <algorithm>
#include <fstream>
#include <unordered_set>

namespace shardopt::app {

namespace {

// The model's shapes as parameters; forward is the scaled sum of all of them: a backward produces
// every trainable gradient and nothing else of a parameter's size (no temporaries in the forward,
// none in the backward but the gradients themselves).
struct SpecModule : torch::nn::Module {
  explicit SpecModule(const ModelSpec& spec) {
    for (const auto& l : spec.layers) {
      std::string name = l.name;
      for (char& c : name) c = c == '.' ? '_' : c;
      params.push_back(register_parameter(name, at::randn(l.shape) * 0.02));
    }
  }
  at::Tensor forward() {
    at::Tensor total = at::zeros({});
    for (const auto& p : params) {
      if (p.requires_grad()) total = total + p.sum();
    }
    return total * 1e-3;
  }
  std::vector<at::Tensor> params;
};

int64_t peak_rss_bytes() { return proc_kib("/proc/self/status", "VmHWM:") * 1024; }
int64_t rss_bytes() { return proc_kib("/proc/self/status", "VmRSS:") * 1024; }

// Note [Peaks by phase]
// The resident peak (VmHWM) is reset as each phase begins (writing 5 to /proc/self/clear_refs
// sets it to the current resident size), so VmHWM at a phase's end less the resident size at its
// start is how far that phase rose above where it began: forward, backward (ZeRO-2's reductions
// run in it), exchange (the all-reduce of ddp and zero1), step (OSS's step and parameter sync, or
// torch's), and the re-partition after a freeze. Memory a phase frees but malloc keeps stays
// resident, so it is carried into the next phase's start (rss_after_step, malloc_free). The whole
// run's peak is the largest VmHWM seen. Where the kernel ignores the reset, a phase's rise counts
// from the earlier peak, and is no more than the whole run's peak.
class PhasePeaks {
 public:
  PhasePeaks() : whole_(static_cast<double>(peak_rss_bytes())) { reset(); }
  // The phase that ends now: its rise into `rise` (the largest over the steps).
  void end(double& rise) {
    const auto now = static_cast<double>(peak_rss_bytes());
    rise = std::max(rise, now - start_);
    whole_ = std::max(whole_, now);
    reset();
  }
  double whole() const { return std::max(whole_, static_cast<double>(peak_rss_bytes())); }

 private:
  void reset() {
    std::ofstream("/proc/self/clear_refs") << "5";
    start_ = static_cast<double>(rss_bytes());
  }
  double whole_, start_ = 0;
};

// Bytes of the distinct storages that hold the parameters.
int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

int64_t grad_bytes(const std::vector<at::Tensor>& params) {
  int64_t bytes = 0;
  for (const auto& p : params) bytes += p.grad().defined() ? static_cast<int64_t>(p.grad().nbytes()) : 0;
  return bytes;
}

int64_t torch_state_bytes(torch::optim::Optimizer& opt) {
  int64_t bytes = 0;
  for (const auto& [key, state] : opt.state()) {
    if (const auto* muon = dynamic_cast<const MuonParamState*>(state.get())) {
      bytes += static_cast<int64_t>(muon->momentum_buffer().nbytes());
      continue;
    }
    auto& adam = static_cast<torch::optim::AdamParamState&>(*state);
    for (const at::Tensor& t : {adam.exp_avg(), adam.exp_avg_sq(), adam.max_exp_avg_sq()}) {
      if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
    }
  }
  return bytes;
}

// Plain data parallel's gradient exchange: the gradients copied into flat buckets that live for
// the whole run (as DDP's do), all-reduced, averaged and copied back.
struct FlatAllReduce {
  at::Tensor bucket;
  void run(const std::vector<at::Tensor>& params, ProcessGroup& group) {
    std::vector<at::Tensor> grads;
    for (const auto& p : params) {
      if (p.requires_grad() && p.grad().defined()) grads.push_back(p.grad().reshape(-1));
    }
    int64_t n = 0;
    for (const auto& g : grads) n += g.numel();
    if (grads.empty()) return;
    if (!bucket.defined() || bucket.numel() < n) bucket = at::empty({n}, grads.front().options());
    at::NoGradGuard no_grad;
    at::Tensor used = bucket.narrow(0, 0, n);
    at::cat_out(used, grads);
    group.allreduce(used);
    used.div_(group.size());
    int64_t at = 0;
    for (auto& g : grads) g.copy_(used.narrow(0, at, g.numel())), at += g.numel();
  }
};

}  // namespace

int64_t proc_kib(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size()));
  }
  return 0;
}

nlohmann::json zero_formula(const std::string& mode, int world, int64_t numel, int64_t trainable, int64_t with_state,
                            int64_t muon) {
  const double w = world;
  const bool bf16 = mode.size() > 5 && mode.compare(mode.size() - 5, 5, "-bf16") == 0;
  const bool zero2 = mode.rfind("zero2", 0) == 0;
  const double low = bf16 ? 2.0 : 4.0;  // bytes of a parameter or a gradient
  nlohmann::json f;
  f["params"] = low * numel;
  f["grads"] = zero2 ? low * trainable / w : low * trainable;
  // Adam: exp_avg and exp_avg_sq; Muon: momentum_buffer; bf16: an fp32 master beside either.
  const double state = (bf16 ? 12.0 : 8.0) * static_cast<double>(with_state - muon) + (bf16 ? 8.0 : 4.0) * muon;
  f["state"] = mode == "ddp" ? state : state / w;
  return f;
}

void run_memory_worker(const ModelSpec& spec, const MemoryOptions& o) {
  const std::string& mode = o.worker_mode;
  const std::string& optimizer_name = o.optimizer;
  const int steps = o.steps;
  const double freeze_fraction = o.freeze_fraction;
  const std::string& out = o.worker_out;
  SHARDOPT_CHECK(mode == "ddp" || mode == "zero1" || mode == "zero2" || mode == "zero1-bf16" || mode == "zero2-bf16",
                 "mode '", mode, "' is not one of ddp, zero1, zero2, zero1-bf16, zero2-bf16");
  const bool bf16 = mode.find("-bf16") != std::string::npos;
  at::set_num_threads(1);
  auto group = init_process_group(InitOptions().backend("gloo").timeout(std::chrono::minutes(10)));
  // The runtime's fixed cost, before the model exists: after a first collective (Gloo's buffers
  // and threads up).
  group->barrier();
  const auto runtime = static_cast<double>(rss_bytes());
  at::manual_seed(0);
  auto model = std::make_shared<SpecModule>(spec);
  const auto& params = model->params;
  SHARDOPT_CHECK(optimizer_name == "adam" || optimizer_name == "muon", "optimizer '", optimizer_name,
                 "' is not one of adam, muon");
  std::vector<at::Tensor> matrices, others;
  int64_t muon_numel = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool muon = optimizer_name == "muon" && muon_matrix(spec.layers.at(i));
    (muon ? matrices : others).push_back(params[i]);
    muon_numel += muon ? params[i].numel() : 0;
  }
  const auto muon_options = MuonOptions(0.02).flatten(true);
  std::unique_ptr<torch::optim::Adam> plain;
  std::unique_ptr<Muon> plain_muon;
  std::unique_ptr<OSS> oss;
  std::unique_ptr<ShardedDDP> ddp;
  FlatAllReduce allreduce;
  if (mode == "ddp") {
    plain = std::make_unique<torch::optim::Adam>(others, torch::optim::AdamOptions(1e-4));
    if (!matrices.empty()) plain_muon = std::make_unique<Muon>(matrices, muon_options);
  } else {
    OSSOptions options;
    if (bf16) options.mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
    options.state_format(parse_state_format(o.state_format));
    auto adam = optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-4));
    oss = matrices.empty() ? std::make_unique<OSS>(params, adam, group, options)
                           : std::make_unique<OSS>(std::vector<OptimizerGroup>{{matrices, optimizer<Muon>(muon_options)},
                                                                               {others, adam}},
                                                   group, options);
    if (mode.rfind("zero2", 0) == 0) {
      const auto ddp_options =
          ShardedDDPOptions().gradient_wire(wire_from_name(o.gradient_wire)).error_feedback(o.error_feedback);
      ddp = std::make_unique<ShardedDDP>(model, *oss, ddp_options);
    }
  }
  PhasePeaks phases;
  struct {
    double forward = 0, backward = 0, exchange = 0, step = 0, rebuild = 0, rss_after = 0, malloc_free = 0;
  } peaks;
  auto step = [&] {
    if (ddp) {
      ddp->zero_grad(true);
      ddp->pre_forward();
    } else if (plain) {
      plain->zero_grad(true);
      if (plain_muon) plain_muon->zero_grad(true);
    } else {
      oss->zero_grad(true);
    }
    at::Tensor loss = model->forward();
    phases.end(peaks.forward);
    loss.backward();
    loss.reset();
    phases.end(peaks.backward);
    if (!ddp) allreduce.run(params, *group);
    phases.end(peaks.exchange);
    if (plain) {
      plain->step();
      if (plain_muon) plain_muon->step();
    } else {
      oss->step();
    }
    phases.end(peaks.step);
    peaks.rss_after = static_cast<double>(rss_bytes());
    peaks.malloc_free = static_cast<double>(mallinfo2().fordblks);
  };
  auto measure = [&] {
    std::vector<double> mine = {static_cast<double>(storage_bytes(params)),
                                static_cast<double>(ddp ? ddp->local_grad_bytes() : grad_bytes(params)),
                                // Under mixed precision the fp32 masters count as state, as in ZeRO's 12 bytes.
                                static_cast<double>(plain ? torch_state_bytes(*plain) +
                                                                (plain_muon ? torch_state_bytes(*plain_muon) : 0)
                                                          : oss->local_state_bytes() + oss->local_master_bytes()),
                                // ZeRO-2: the owned gradient slabs' bytes beyond the gradients
                                // in them (counts, alignment); else the all-reduce's bucket.
                                static_cast<double>(ddp ? ddp->local_bucket_bytes() - ddp->local_grad_bytes()
                                                        : allreduce.bucket.defined() ? allreduce.bucket.nbytes() : 0),
                                phases.whole(), runtime, static_cast<double>(ddp ? ddp->error_feedback_bytes() : 0),
                                peaks.forward, peaks.backward, peaks.exchange, peaks.step, peaks.rebuild,
                                peaks.rss_after, peaks.malloc_free};
    const int64_t fields = static_cast<int64_t>(mine.size());
    at::Tensor all = at::zeros({group->size() * fields}, at::kDouble);
    all.narrow(0, group->rank() * fields, fields).copy_(at::tensor(mine, at::kDouble));
    group->allreduce(all);
    return all;
  };
  int64_t numel = 0;
  for (const auto& p : params) numel += p.numel();
  nlohmann::json rows = nlohmann::json::array();
  auto record = [&](const std::string& scenario, const at::Tensor& all, int64_t trainable) {
    const int64_t fields = std::size(kMeasured);
    for (int r = 0; r < group->size(); ++r) {
      nlohmann::json row;
      row["mode"] = mode;
      row["world"] = group->size();
      row["scenario"] = scenario;
      row["rank"] = r;
      for (int64_t f = 0; f < fields; ++f) row[kMeasured[f]] = all[r * fields + f].item<double>();
      row["formula"] = zero_formula(mode, group->size(), numel, trainable, numel, muon_numel);
      rows.push_back(row);
    }
  };
  for (int s = 0; s < steps; ++s) step();
  record("all trainable", measure(), numel);
  peaks = {};

  // Freeze the leading layers up to the fraction (as `shardopt plan` does), then step and count again.
  int64_t frozen = 0;
  const auto trainable = freeze_leading(spec, freeze_fraction, &frozen);
  for (size_t i = 0; i < params.size(); ++i) {
    if (trainable[i]) continue;
    params[i].requires_grad_(false);
    params[i].mutable_grad().reset();
  }
  // The new trainable set agreed and the shards re-balanced now, as the next forward() would do
  // over two steps: the measurement sees the settled layout whatever --steps is.
  phases.end(peaks.rebuild);  // (the freeze itself: not measured)
  peaks.rebuild = 0;
  if (ddp) {
    ddp->refresh_trainable();
  } else if (oss) {
    oss->refresh_trainable();
  }
  phases.end(peaks.rebuild);
  for (int s = 0; s < steps; ++s) step();
  record(fmt::format("{:.0f}% frozen", 100.0 * static_cast<double>(frozen) / static_cast<double>(numel)), measure(),
         numel - frozen);
  if (group->rank() == 0) {
    std::ofstream f(out);
    SHARDOPT_CHECK(f, "cannot write '", out, "'");
    f << rows.dump(1) << "\n";
  }
}

}  // namespace shardopt::app
