#include "train.h"

#include "models/classifier.h"
#include "fashion_mnist.h"
#include "freeze_schedule.h"
#include "metrics_log.h"
#include "progress.h"
#include "units.h"

#include <charconv>
#include <shardopt/comm/launch_env.h>
#include <shardopt/shardopt.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/csrc/api/include/torch/cuda.h>
#include <torch/csrc/api/include/torch/nn/functional/loss.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <malloc.h>
#include <functional>
#include <cmath>
#include <csignal>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdlib>
#include <thread>

namespace shardopt::app {

namespace {

namespace optim = torch::optim;

OptimizerFactory make_optimizer(const TrainOptions& o) {
  if (o.optimizer == "adam") return optimizer<optim::Adam>(optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  if (o.optimizer == "adamw" || o.optimizer == "muon") {
    return optimizer<optim::AdamW>(optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (o.optimizer == "sgd") {
    return optimizer<optim::SGD>(optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  SHARDOPT_CHECK(false, "--optimizer '", o.optimizer, "' is not one of adam, adamw, sgd, muon");
  return nullptr;
}

// --step-in-backward: each bucket stepped in the backward (ShardedDDPOptions::step_in_backward)
// where nothing needs every gradient before the step: no --clip, no fp16 loss scaling, an
// optimizer the fused step takes (not Muon). auto turns it on only where the ranks span nodes
// (ranks_span_nodes()): over a network it hid the parameter sync in the backward, while ranks
// sharing one machine's cores measured slower with it (docs/benchmarks.md §2). auto also leaves it
// off where it has not been measured (--survive-failures, whose recovery may meet a step in a
// backward; --device cuda).
bool steps_in_backward(const TrainOptions& o) {
  if (o.step_in_backward == "off") return false;
  std::string conflict;
  if (o.clip > 0) conflict = "--clip";
  if (o.mixed_precision == "fp16") conflict = "--mixed-precision fp16 (its loss scaling)";
  if (o.optimizer == "muon") conflict = "--optimizer muon";
  if (o.survive_failures) conflict = "--survive-failures";
  const bool measured = o.device == "cpu" && ranks_span_nodes();
  SHARDOPT_CHECK(o.step_in_backward != "on" || conflict.empty(), "--step-in-backward on cannot go with ", conflict,
                 ": the step would run before it (use --step-in-backward auto or off)");
  return conflict.empty() && (o.step_in_backward == "on" || measured);
}

// --overlap-sync: the parameter sync after the step runs beside the next forward
// (ShardedDDPOptions::overlap_param_sync), the model waiting block by block for its own
// parameters (Classifier::before_use), so its first block computes while later blocks' parameters
// are still arriving. auto turns it on only where the ranks span nodes, as --step-in-backward:
// over a shaped link it hid part of the sync behind the forward (docs/benchmarks.md §2), while
// ranks sharing one machine's cores measured slower with it (docs/benchmarks-log.md, "Parameter
// sync overlapped with the next forward"). Not with --survive-failures: a recovery replaces the
// ShardedDDP the model would wait on.
bool overlaps_sync(const TrainOptions& o) {
  if (o.overlap_sync == "off") return false;
  SHARDOPT_CHECK(o.overlap_sync != "on" || !o.survive_failures,
                 "--overlap-sync on cannot go with --survive-failures: a recovery replaces the ShardedDDP the model "
                 "waits on (use --overlap-sync auto or off)");
  return o.overlap_sync == "on" || (!o.survive_failures && o.device == "cpu" && ranks_span_nodes());
}

// --optimizer muon: Muon on the conv and linear weights (a conv filter bank taken as the matrix
// (out channels, the rest)), AdamW on the biases; both take --lr, Muon scaled to AdamW's update
// size ("match_rms_adamw"), as Moonlight trains with one learning rate for both.
// Muon on the weights of the convolutions and linear layers; the rest (biases, norms, the ViT's
// class token and positions) on the chosen element-wise optimizer.
std::vector<OptimizerGroup> muon_groups(const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                                        const TrainOptions& o) {
  std::vector<at::Tensor> matrices, others;
  const auto weight = [](const std::string& n) { return n.size() > 7 && n.compare(n.size() - 7, 7, ".weight") == 0; };
  for (size_t i = 0; i < params.size(); ++i) (params[i].dim() >= 2 && weight(names[i]) ? matrices : others).push_back(params[i]);
  return {{matrices, optimizer<Muon>(MuonOptions(o.lr).weight_decay(o.weight_decay).adjust_lr_fn("match_rms_adamw").flatten(true))},
          {others, make_optimizer(o)}};
}

// The learning rate at global step `step` of `total`.
double lr_at(const TrainOptions& o, int64_t step, int64_t total) {
  double lr = o.lr;
  if (o.lr_schedule == "cosine") {
    lr *= 0.5 * (1.0 + std::cos(M_PI * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(total, 1))));
  } else if (o.lr_schedule == "step") {
    if (3 * step >= 2 * total) lr *= 0.1;
  } else {
    SHARDOPT_CHECK(o.lr_schedule == "constant", "--lr-schedule '", o.lr_schedule, "' is not one of constant, cosine, step");
  }
  if (o.warmup_steps > 0 && step < o.warmup_steps) lr *= static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  return lr;
}

int local_world_size(int world) {
  const char* v = env_var("LOCAL_WORLD_SIZE");
  return v ? std::max(1, std::atoi(v)) : world;
}

// Each rank's value of `mine`, gathered on every rank (a small all-reduce).
std::vector<int64_t> per_rank(ProcessGroup& group, int64_t mine) {
  at::Tensor t = at::zeros({group.size()}, at::kLong);
  t[group.rank()] = mine;
  group.allreduce(t);
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + group.size());
}

std::string per_rank_bytes(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t r = 0; r < v.size(); ++r) out += (r ? " / " : "") + bytes_text(static_cast<double>(v[r]));
  return out;
}

// Where the metrics go (TrainOptions::metrics); empty: nowhere.
std::string metrics_file(const TrainOptions& o) {
  if (o.metrics == "off") return "";
  if (!o.metrics.empty()) return o.metrics;
  return o.checkpoint_dir.empty() ? "" : o.checkpoint_dir + "/metrics.jsonl";
}

// A metrics file this rank could write: its folder exists and is writable, and it is a writable
// file if it exists. Errors name --metrics.
void check_metrics_path(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1));
  SHARDOPT_CHECK(::access(folder.c_str(), W_OK) == 0, "--metrics '", path, "': the folder '", folder,
                 "' does not exist or is not writable");
  struct stat st {};
  SHARDOPT_CHECK(::stat(path.c_str(), &st) != 0 || (S_ISREG(st.st_mode) && ::access(path.c_str(), W_OK) == 0),
                 "--metrics '", path, "' exists and is not a file it can write");
}

class Trainer {
 public:
  explicit Trainer(const TrainOptions& o);
  int run();

 private:
  void restore();
  void apply_schedule(int64_t step);
  struct Before;
  void report_change(int64_t step, const std::vector<const FreezeEvent*>& events, const Before& before);
  int64_t model_numel() const;
  void run_step(int64_t epoch_step);
  double train_step(int64_t epoch_step);
  std::pair<int64_t, int64_t> evaluate();
  void save(int64_t next_epoch_step);
  void summary();
  // Every rank's optimizer state, master and gradient bytes into the metrics file. Collective.
  void log_memory();
  // Note [Restarted by torchrun]: resume_, restarts_ and the fault injection from the environment.
  void read_restart_env(const TrainOptions& o);
  // --survive-failures: the loop over steps, and what follows a recovery.
  void run_surviving(int64_t stop);
  void recovered(const Recovery& r);
  void admitted(const Admission& a);
  void adopt_group();  // the Resilient run's group, optimizer and ShardedDDP, after it replaced them
  std::unique_ptr<OSS> make_oss(std::shared_ptr<ProcessGroup> group) const;

  const TrainOptions& o_;
  std::shared_ptr<ProcessGroup> group_;
  int rank_ = 0, world_ = 1;
  FashionMnist data_;
  std::shared_ptr<Classifier> model_;  // --model: models/classifier.h
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  at::Device device_ = at::kCPU;
  // The optimizer and ShardedDDP: this run's own, or under --survive-failures the Resilient run's
  // (which replaces them at each recovery).
  OSS* oss_ = nullptr;
  ShardedDDP* ddp_ = nullptr;
  std::unique_ptr<OSS> owned_oss_;
  std::unique_ptr<ShardedDDP> owned_ddp_;
  std::unique_ptr<Resilient> resilient_;
  bool overlap_ = false;  // --overlap-sync: the parameter sync beside the next forward
  PendingCheckpoint pending_save_;      // the checkpoint being written in the background
  std::unique_ptr<ShardedGradScaler> scaler_;  // fp16
  int64_t skipped_steps_ = 0;                  // fp16 steps skipped for inf/nan gradients
  std::unique_ptr<BalancedSampler> sampler_;
  FreezeSchedule schedule_;
  int64_t steps_per_epoch_ = 0, total_steps_ = 0, step_ = 0, epoch_ = 0, first_epoch_step_ = 0;
  int64_t last_grad_bytes_ = 0;
  std::unique_ptr<Progress> progress_;
  bool resume_ = false;                 // --resume, or a restart by torchrun with a checkpoint to resume
  int64_t restarts_ = 0;                // TORCHELASTIC_RESTART_COUNT
  int fault_rank_ = -1;                 // SHARDOPT_FAULT_AT_STEP: this rank kills itself before step
  int64_t fault_step_ = -1;             // fault_step_ of a run not yet restarted
  int64_t await_joiner_at_ = -1;        // SHARDOPT_AWAIT_JOINER_AT_STEP: wait for a replacement's request before this refresh
  c10::intrusive_ptr<c10d::Store> rendezvous_;  // the first group's store (where replacements ask to join)
  bool metrics_on_ = false;             // every rank: the metrics file is written (by rank 0)
  std::unique_ptr<MetricsLog> metrics_;  // rank 0
  int64_t memory_every_ = 1;            // steps between memory records
  double last_accuracy_ = -1.0;
  // Values before a trainability change, reported after the step that follows it.
  struct Before {
    int64_t grad_bytes = 0, state_bytes = 0, rebuilds = 0, repartitions = 0, state_moves = 0;
    size_t buckets = 0;
  };
};

Trainer::Trainer(const TrainOptions& o) : o_(o) {
  SHARDOPT_CHECK(o.epochs > 0, "--epochs must be positive, got ", o.epochs);
  SHARDOPT_CHECK(o.lr > 0, "--lr must be positive, got ", o.lr);
  lr_at(o, 0, 1);  // rejects an unknown schedule before any work
  schedule_ = FreezeSchedule::parse(o.freeze, o.unfreeze);
  SHARDOPT_CHECK(!o.resume || !o.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  SHARDOPT_CHECK(o.refresh_every >= 1, "--refresh-every must be >= 1, got ", o.refresh_every);
  read_restart_env(o);
  if (!o.checkpoint_dir.empty()) {  // a folder it can write to, before any training
    ::mkdir(o.checkpoint_dir.c_str(), 0755);
    struct stat st {};
    SHARDOPT_CHECK(::stat(o.checkpoint_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "--checkpoint-dir '",
                   o.checkpoint_dir, "' is not a folder and cannot be made one");
    SHARDOPT_CHECK(::access(o.checkpoint_dir.c_str(), W_OK) == 0, "--checkpoint-dir '", o.checkpoint_dir,
                   "' is not writable");
  }
  const std::string metrics_path = metrics_file(o);
  metrics_on_ = !metrics_path.empty();
  if (metrics_on_) check_metrics_path(metrics_path);  // every rank checks, so that every rank says it
  const bool cuda = o.device == "cuda";
  SHARDOPT_CHECK(!cuda || torch::cuda::is_available(), "--device cuda: no CUDA device is visible");
  group_ = init_process_group(
      InitOptions().backend(cuda ? "nccl" : "gloo").timeout(std::chrono::seconds(o.timeout_s)));
  rank_ = group_->rank();
  world_ = group_->size();
  rendezvous_ = group_->store();
  // A process started to replace a rank of a --survive-failures run is a group of one until the
  // run admits it (shardopt::Resilient, below): it is not rank 0 of the run.
  if (metrics_on_ && rank_ == 0 && !group_->joining()) metrics_ = std::make_unique<MetricsLog>(metrics_path, resume_);
  if (cuda) {
    // One GPU per rank: its local rank's (the NCCL group made it the current device). cuDNN's
    // deterministic algorithms: a resumed run repeats the uninterrupted one bit for bit.
    device_ = at::Device(at::kCUDA,
                         static_cast<c10::DeviceIndex>(std::max(0, local_rank()) % torch::cuda::device_count()));
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  SHARDOPT_CHECK(o.batch_size > 0 && o.batch_size % world_ == 0, "--batch-size ", o.batch_size,
                 " (global) must be a positive multiple of the world size ", world_);
  at::set_num_threads(o.threads > 0 ? o.threads
                                    : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) /
                                                      local_world_size(world_)));
  data_ = load_fashion_mnist(o.data_dir, o.train_samples, o.test_samples);
  for (at::Tensor* t : {&data_.train_images, &data_.train_labels, &data_.test_images, &data_.test_labels}) {
    *t = t->to(device_);
  }

  at::manual_seed(o.seed);  // the same initial weights on every rank and at every world size
  model_ = make_classifier(o.model);
  model_->to(device_);
  for (const auto& p : model_->named_parameters()) {
    names_.push_back(p.key());
    params_.push_back(p.value());
  }
  // Under --survive-failures the world size may change: every rank computes the global batch (a
  // sampler of one rank with batch G: the same global batches, docs/sampler.md) and takes its
  // share of it, which is what the sampler of the whole group gives each rank while G divides.
  sampler_ = o.survive_failures
                 ? std::make_unique<BalancedSampler>(data_.train_images.size(0), 0, 1,
                                                     SamplerOptions(o.batch_size).seed(o.seed))
                 : std::make_unique<BalancedSampler>(data_.train_images.size(0), *group_,
                                                     SamplerOptions(o.batch_size / world_).seed(o.seed));
  steps_per_epoch_ = sampler_->steps_per_epoch();
  total_steps_ = steps_per_epoch_ * o.epochs;
  schedule_.validate(names_, steps_per_epoch_, total_steps_);
  if (o.mixed_precision == "fp16") scaler_ = std::make_unique<ShardedGradScaler>();
  // Each rank's loss is the sum over its real samples; gradients are divided by the real
  // samples of the global step, so a padded last step weighs exactly right.
  const bool in_backward = steps_in_backward(o);
  overlap_ = overlaps_sync(o);
  auto make_ddp = [this, in_backward](OSS& opt) {
    return std::make_unique<ShardedDDP>(model_, opt, ShardedDDPOptions().grad_scaling(GradScaling::kGlobalSamples).gradient_wire(
                                                              wire_from_name(o_.gradient_wire)).error_feedback(o_.error_feedback)
                                                              .step_in_backward(in_backward).overlap_param_sync(overlap_));
  };
  if (o.survive_failures) {
    resilient_ = std::make_unique<Resilient>(
        group_, model_, [this](std::shared_ptr<ProcessGroup> g) { return make_oss(std::move(g)); }, make_ddp,
        ResilienceOptions().refresh_every(o.refresh_every).grad_scaler(scaler_.get()));
    oss_ = &resilient_->optimizer();
    ddp_ = resilient_->ddp();
    if (group_->joining()) {  // admitted: the run's group, and the step it goes on from (not a checkpoint's)
      resume_ = false;
      group_ = resilient_->group_ptr();
      rank_ = group_->rank();
      world_ = group_->size();
      step_ = resilient_->start_step();
    }
  } else {
    owned_oss_ = make_oss(group_);
    owned_ddp_ = make_ddp(*owned_oss_);
    oss_ = owned_oss_.get();
    ddp_ = owned_ddp_.get();
    if (overlap_) model_->before_use = [ddp = ddp_](const std::vector<at::Tensor>& ps) { ddp->wait_param_sync(ps); };
  }
}

std::unique_ptr<OSS> Trainer::make_oss(std::shared_ptr<ProcessGroup> group) const {
  OSSOptions oss_options;
  oss_options.param_wire(wire_from_name(o_.param_wire));
  oss_options.state_format(parse_state_format(o_.state_format));
  if (o_.mixed_precision != "off") {
    oss_options.mixed_precision(MixedPrecision().param_dtype(o_.mixed_precision == "bf16" ? at::kBFloat16 : at::kHalf));
  }
  return o_.optimizer == "muon" ? std::make_unique<OSS>(muon_groups(names_, params_, o_), group, oss_options)
                                : std::make_unique<OSS>(params_, make_optimizer(o_), group, oss_options);
}

// The options a checkpoint must be resumed with, as numbers (TrainingState::scalars): their
// position in each option's list of choices.
const std::vector<std::pair<const char*, std::vector<std::string>>>& resume_choices() {
  static const std::vector<std::pair<const char*, std::vector<std::string>>> choices = {
      {"optimizer", {"adam", "adamw", "sgd", "muon"}}, {"mixed-precision", {"off", "bf16", "fp16"}},
      {"model", {"cnn", "vit"}}};
  return choices;
}

// Note [Resuming with other values]
// The options above must match the checkpoint. The hyperparameters below need not: a resumed run
// trains with the values its command line gives, every one of them (before, the optimizer took
// weight decay from the checkpoint's param groups while the learning rate came from the
// command line), and rank 0 says, one line each, which differ from what the checkpoint was
// written with. The freeze schedule is compared as a whole. The optimizer state's format may
// change too: its state is converted as it loads (Note [State formats]).
struct Resumable {
  const char* option;
  std::function<double(const TrainOptions&)> value;
};

uint32_t schedule_hash(const TrainOptions& o) {
  uint32_t h = 2166136261u;  // FNV-1a of the freeze and unfreeze flags, in order
  for (const auto* list : {&o.freeze, &o.unfreeze}) {
    for (const std::string& item : *list) {
      for (const char c : item + "\n") h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
    }
    h = (h ^ 0xffu) * 16777619u;
  }
  return h;
}

const std::vector<Resumable>& resumables() {
  static const std::vector<Resumable> values = {
      {"lr", [](const TrainOptions& o) { return o.lr; }},
      {"weight-decay", [](const TrainOptions& o) { return o.weight_decay; }},
      {"momentum", [](const TrainOptions& o) { return o.momentum; }},
      {"warmup-steps", [](const TrainOptions& o) { return static_cast<double>(o.warmup_steps); }},
      {"clip", [](const TrainOptions& o) { return o.clip; }},
      {"epochs", [](const TrainOptions& o) { return static_cast<double>(o.epochs); }},
      {"freeze/unfreeze schedule", [](const TrainOptions& o) { return static_cast<double>(schedule_hash(o)); }},
      {"state-format", [](const TrainOptions& o) { return static_cast<double>(parse_state_format(o.state_format)); }},
  };
  return values;
}

// The command line's weight decay (and SGD's momentum) in every param group, over what the
// checkpoint's param groups set (the learning rate is set at every step).
void apply_hyperparameters(OSS& oss, const TrainOptions& o) {
  for (auto& g : oss.param_groups()) {
    auto& options = g.options();
    if (auto* a = dynamic_cast<optim::AdamOptions*>(&options)) a->weight_decay(o.weight_decay);
    if (auto* w = dynamic_cast<optim::AdamWOptions*>(&options)) w->weight_decay(o.weight_decay);
    if (auto* m = dynamic_cast<MuonOptions*>(&options)) m->weight_decay(o.weight_decay);
    if (auto* sgd = dynamic_cast<optim::SGDOptions*>(&options)) sgd->weight_decay(o.weight_decay).momentum(o.momentum);
  }
}

const std::string& choice_of(const TrainOptions& o, const std::string& option) {
  return option == "optimizer" ? o.optimizer : option == "model" ? o.model : o.mixed_precision;
}

// Before anything is loaded: a checkpoint written with another optimizer, precision, batch or
// training set is one line naming the option (instead of a failure deep in the optimizer's
// state, or state silently dropped). Checkpoints without these entries are not checked.
void check_resume_options(const std::string& path, const TrainOptions& o, int64_t dataset_size) {
  const c10::impl::GenericDict d = read_checkpoint_file(path).toGenericDict();
  if (d.contains("scalars")) {
    const auto scalars = d.at("scalars").toGenericDict();
    for (const auto& [option, values] : resume_choices()) {
      const std::string key = std::string("option ") + option;
      if (!scalars.contains(key)) continue;
      const auto index = static_cast<size_t>(scalars.at(key).toDouble());
      const std::string saved = index < values.size() ? values[index] : "?";
      SHARDOPT_CHECK(saved == choice_of(o, option), "checkpoint '", path, "' was written with --", option, " ", saved,
                     "; resume it with --", option, " ", saved, " (this run has ", choice_of(o, option), ")");
    }
  }
  if (d.contains("sampler") && d.at("sampler").isGenericDict()) {
    const auto sampler = d.at("sampler").toGenericDict();
    if (sampler.contains("global_batch_size")) {
      const int64_t batch = sampler.at("global_batch_size").toInt();
      SHARDOPT_CHECK(batch == o.batch_size, "checkpoint '", path, "' was written with --batch-size ", batch,
                     "; this run has ", o.batch_size);
    }
    if (sampler.contains("dataset_size")) {
      const int64_t size = sampler.at("dataset_size").toInt();
      SHARDOPT_CHECK(size == dataset_size, "checkpoint '", path, "' was written for ", size,
                     " training images (--train-samples); this run has ", dataset_size);
    }
  }
}

void Trainer::restore() {
  const std::string path = o_.checkpoint_dir + "/last.ckpt";
  check_resume_options(path, o_, data_.train_images.size(0));
  const TrainingState state = load_checkpoint(path, *ddp_, *oss_);
  SHARDOPT_CHECK(state.sampler.has_value(), "checkpoint '", o_.checkpoint_dir, "/last.ckpt' has no sampler position");
  apply_hyperparameters(*oss_, o_);  // Note [Resuming with other values]
  for (const auto& r : resumables()) {
    const auto it = state.scalars.find(std::string("value ") + r.option);
    if (rank_ != 0 || it == state.scalars.end() || it->second == r.value(o_)) continue;
    if (std::string(r.option) == "freeze/unfreeze schedule") {
      std::printf("resumed with another --freeze/--unfreeze schedule than the checkpoint was written with: this "
                  "run's is in effect\n");
    } else if (std::string(r.option) == "state-format") {
      std::printf("resumed with --state-format %s (the checkpoint was written with %s): its optimizer state was "
                  "converted\n", o_.state_format.c_str(),
                  state_format_name(static_cast<StateFormat>(static_cast<int>(it->second))).c_str());
    } else {
      std::printf("resumed with --%s %s (the checkpoint was written with %s): this run's value is in effect\n",
                  r.option, fmt::format("{}", r.value(o_)).c_str(), fmt::format("{}", it->second).c_str());
    }
  }
  sampler_->restore(*state.sampler);
  if (scaler_ && state.scalars.count("loss_scale")) {
    scaler_->load(state.scalars.at("loss_scale"),
                  static_cast<int64_t>(state.scalars.count("loss_scale_growth_tracker")
                                           ? state.scalars.at("loss_scale_growth_tracker") : 0));
  }
  step_ = state.step;
  epoch_ = state.sampler->epoch;
  first_epoch_step_ = state.sampler->next_step;
  if (rank_ == 0) {
    std::printf("%sresumed from %s/last.ckpt: step %lld, epoch %lld, step %lld of the epoch\n",
                o_.resume ? "" : fmt::format("restarted by torchrun (restart {}): ", restarts_).c_str(),
                o_.checkpoint_dir.c_str(), static_cast<long long>(step_), static_cast<long long>(epoch_ + 1),
                static_cast<long long>(first_epoch_step_));
  }
}

void Trainer::apply_schedule(int64_t step) {
  const auto flags = schedule_.trainable_at(names_, step, steps_per_epoch_);
  for (size_t i = 0; i < params_.size(); ++i) params_[i].requires_grad_(flags[i]);
}

double Trainer::train_step(int64_t epoch_step) {
  Batch b = sampler_->batch(epoch_step);
  if (resilient_) {  // this rank's share of the global batch
    const auto n = static_cast<int64_t>(b.indices.size());
    const int64_t lo = n * rank_ / world_, hi = n * (rank_ + 1) / world_;
    b.indices = std::vector<int64_t>(b.indices.begin() + lo, b.indices.begin() + hi);
    b.real = std::vector<uint8_t>(b.real.begin() + lo, b.real.begin() + hi);
  }
  const at::Tensor idx = at::tensor(b.indices, at::kLong).to(device_);
  const at::Tensor real = at::tensor(std::vector<float>(b.real.begin(), b.real.end())).to(device_);
  for (auto& g : oss_->param_groups()) g.options().set_lr(lr_at(o_, step_, total_steps_));
  ddp_->zero_grad(true);
  ddp_->set_global_samples(b.global_real);
  const at::Tensor images = normalise(data_.train_images.index_select(0, idx));
  at::Tensor out;
  if (overlap_) {  // the model waits for each block's parameters itself (Classifier::before_use)
    ddp_->pre_forward(/*finish_sync=*/false);
    out = model_->forward(images.to(params_[0].scalar_type()));
  } else {
    out = ddp_->forward(images);
  }
  // The loss in fp32 whatever the model's dtype.
  const at::Tensor per_sample = torch::nn::functional::cross_entropy(
      out.to(at::kFloat), data_.train_labels.index_select(0, idx),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  const at::Tensor loss = (per_sample * real).sum();
  (scaler_ ? scaler_->scale(loss) : loss).backward();
  // Clipping sees the unscaled gradients; without it the step unscales them as it reads them.
  if (scaler_ && o_.clip > 0) scaler_->unscale_(*oss_);
  if (o_.clip > 0) oss_->clip_grad_norm(o_.clip);
  last_grad_bytes_ = ddp_->local_grad_bytes();
  if (scaler_) {
    skipped_steps_ += scaler_->step(*oss_) ? 0 : 1;
    scaler_->update();
  } else {
    oss_->step();
  }
  return loss.item<double>() / std::max<double>(1.0, real.sum().item<double>());
}

// One line per trainability change: what changed, the rebuild, the re-partition, and each rank's
// gradient and optimizer-state bytes before and after. Collective (gathers the per-rank values).
void Trainer::report_change(int64_t step, const std::vector<const FreezeEvent*>& events, const Before& before) {
  const auto grads_before = per_rank(*group_, before.grad_bytes), grads_after = per_rank(*group_, last_grad_bytes_);
  const auto state_before = per_rank(*group_, before.state_bytes);
  const auto state_after = per_rank(*group_, oss_->local_state_bytes());
  const RebalanceStats last = oss_->last_rebalance();
  const bool rebalanced = last.repartitions != before.repartitions;
  const bool moved_state = last.moves != before.state_moves;
  const auto moved = per_rank(*group_, moved_state ? last.state_bytes_sent : 0);
  if (rank_ != 0) return;
  std::string what;
  for (const auto* e : events) {
    int64_t count = 0, matched = 0;
    for (size_t i = 0; i < names_.size(); ++i) {
      if (names_[i].rfind(e->prefix, 0) != 0) continue;
      count += params_[i].numel();
      ++matched;
    }
    what += fmt::format("{}{} {} ({} tensors, {} parameters)", what.empty() ? "" : "; ", e->freeze ? "froze" : "unfroze",
                        e->prefix, matched, count_text(count));
  }
  int64_t moved_total = 0;
  for (int64_t m : moved) moved_total += m;
  const std::string rebuild = ddp_->rebuild_count() != before.rebuilds
                                  ? fmt::format("buckets rebuilt ({} -> {})", before.buckets, ddp_->num_buckets())
                                  : std::string("buckets unchanged");
  std::string partition = rebalanced ? "partition rebalanced" : (oss_->layout().options().split() ? "split ranges cut again" : "partition kept");
  if (moved_state) partition += fmt::format(", {} of optimizer state moved", bytes_text(static_cast<double>(moved_total)));
  if (metrics_) {
    bool freezes = false, unfreezes = false;
    for (const auto* e : events) (e->freeze ? freezes : unfreezes) = true;
    metrics_->write({{"step", step},
                     {"epoch", epoch_ + 1},
                     {"event", freezes && unfreezes ? "freeze and unfreeze" : freezes ? "freeze" : "unfreeze"},
                     {"what", what},
                     {"buckets_rebuilt", ddp_->rebuild_count() != before.rebuilds},
                     {"buckets", ddp_->num_buckets()},
                     {"rebalanced", rebalanced},
                     {"state_bytes_moved", moved_total},
                     {"grad_bytes_before", grads_before},
                     {"grad_bytes_after", grads_after},
                     {"state_bytes_before", state_before},
                     {"state_bytes_after", state_after}});
  }
  progress_->print(fmt::format("step {} (epoch {}): {}; {}; {}; per rank gradients {} -> {}, optimizer state {} -> {}",
                               step, epoch_ + 1, what, rebuild, partition, per_rank_bytes(grads_before),
                               per_rank_bytes(grads_after), per_rank_bytes(state_before), per_rank_bytes(state_after)));
}

// Step `s` of the current epoch, with what comes with it: the schedule (and its report), the
// progress line, checkpoints, and at the epoch's end the test accuracy.
void Trainer::run_step(int64_t s) {
  if (group_->global_rank() == fault_rank_ && step_ == fault_step_) {
    pending_save_ = PendingCheckpoint();  // (joins this rank's writer: the kill comes after its last save is on disk)
    std::raise(SIGKILL);
  }
  const auto events = schedule_.events_at(step_, steps_per_epoch_);
  const Before before{last_grad_bytes_, oss_->local_state_bytes(), ddp_->rebuild_count(),
                      oss_->last_rebalance().repartitions, oss_->last_rebalance().moves, ddp_->num_buckets()};
  apply_schedule(step_);
  const double loss = train_step(s);
  if (!events.empty()) report_change(step_, events, before);
  progress_->update(step_, epoch_, o_.epochs, loss);
  if (metrics_) {
    metrics_->write({{"step", step_},
                     {"epoch", epoch_ + 1},
                     {"loss", loss},
                     {"lr", lr_at(o_, step_, total_steps_)},
                     {"samples_per_s", static_cast<double>(progress_->steps_done() * o_.batch_size) /
                                           std::max(progress_->seconds(), 1e-9)}});
  }
  if (metrics_on_ && (step_ % memory_every_ == 0 || !events.empty())) log_memory();
  ++step_;
  const bool epoch_end = s + 1 == steps_per_epoch_;
  if (!o_.checkpoint_dir.empty() && !epoch_end && o_.checkpoint_every > 0 && step_ % o_.checkpoint_every == 0) save(s + 1);
  if (!epoch_end) return;
  const auto [correct, seen] = evaluate();
  last_accuracy_ = static_cast<double>(correct) / static_cast<double>(std::max<int64_t>(seen, 1));
  progress_->print(fmt::format("epoch {}/{}: test accuracy {:.2f}% ({}/{}), {:.1f} s", epoch_ + 1, o_.epochs,
                               100.0 * last_accuracy_, correct, seen, progress_->seconds()));
  if (metrics_) metrics_->write({{"step", step_ - 1}, {"epoch", epoch_ + 1}, {"test_accuracy", last_accuracy_}});
  if (!o_.checkpoint_dir.empty()) save(steps_per_epoch_);
}

int Trainer::run() {
  if (resume_) restore();
  progress_ = std::make_unique<Progress>(rank_ == 0, total_steps_, o_.batch_size,
                                         std::max<int64_t>(1, steps_per_epoch_ / 4));
  if (rank_ == 0) {
    progress_->print(fmt::format("training the {} ({} parameters) on {} Fashion-MNIST images: {} rank{} on {}, global batch {}, "
                                 "{} step{} per epoch, {}{}{}; {}",
                                 o_.model == "vit" ? "ViT" : "CNN", count_text(model_numel()),
                                 count_text(data_.train_images.size(0)), world_, world_ == 1 ? "" : "s",
                                 device_.is_cuda() ? "CUDA (NCCL)" : "CPU (Gloo)", o_.batch_size, steps_per_epoch_,
                                 steps_per_epoch_ == 1 ? "" : "s",
                                 o_.optimizer, oss_->steps_in_backward() ? " stepped in the backward" : "",
                                 overlap_ ? ", parameters synced beside the next forward" : "", oss_->describe()));
  }
  memory_every_ = std::max<int64_t>(1, steps_per_epoch_ / 25);
  if (metrics_) {
    metrics_->write({{"event", resume_ ? "resume" : "start"},
                     {"step", step_},
                     {"world", world_},
                     {"model", o_.model},
                     {"optimizer", o_.optimizer},
                     {"mixed_precision", o_.mixed_precision},
                     {"gradient_wire", o_.gradient_wire},
                     {"param_wire", o_.param_wire},
                     {"state_format", o_.state_format},
                     {"error_feedback", o_.error_feedback},
                     {"device", o_.device},
                     {"params", model_numel()},
                     {"batch_size", o_.batch_size},
                     {"steps_per_epoch", steps_per_epoch_},
                     {"total_steps", total_steps_},
                     {"partition", oss_->layout().options().split() ? "split" : "whole"}});
  }
  const int64_t stop = o_.stop_after_steps > 0 ? std::min(o_.stop_after_steps, total_steps_) : total_steps_;
  if (resilient_) {
    run_surviving(stop);
    progress_->finish();
    summary();
    return 0;
  }
  while (step_ < stop) {
    if (first_epoch_step_ == 0) sampler_->set_epoch(epoch_);
    int64_t s = first_epoch_step_;
    for (; s < steps_per_epoch_ && step_ < stop; ++s) run_step(s);
    if (s < steps_per_epoch_) break;  // stopped inside the epoch
    ++epoch_;
    first_epoch_step_ = 0;
  }
  ddp_->finish_param_sync();  // every rank's parameters current (--overlap-sync)
  pending_save_.wait();  // the last checkpoint is on disk before the run ends (an error on every rank)
  progress_->finish();
  summary();
  return 0;
}
// Note [Surviving in the tool]
// Every step, with what comes with it (the schedule's report, memory records, a checkpoint, the
// epoch's test accuracy), runs inside the Resilient run's step: a rank dying in any of them is
// survived. A recovery rolls back to the step of the last refresh; the loop goes on from there
// at the new world size, with the same global batches (each rank's share of the sampler's global
// batch), so the run is the one a restart at that step with the new world size would make.
void Trainer::run_surviving(int64_t stop) {
  if (rank_ == 0) progress_->print(fmt::format("surviving failures: {}", resilient_->describe()));
  int64_t epoch_set = -1;
  while (step_ < stop) {
    epoch_ = step_ / steps_per_epoch_;
    const int64_t s = step_ % steps_per_epoch_;
    if (epoch_ != epoch_set) sampler_->set_epoch(epoch_set = epoch_);
    if (step_ + 1 == await_joiner_at_) {
      // The refresh after this step admits the requests that are in: wait (bounded) for the first.
      rendezvous_->wait({"shardopt/join/1"}, std::chrono::seconds(o_.timeout_s));
      await_joiner_at_ = -1;
    }
    const StepResult r = resilient_->step_by(step_, [&] { run_step(s); });
    if (r.recovery) recovered(*r.recovery);
    if (r.admission) admitted(*r.admission);
    step_ = r.next_step;
  }
}

void Trainer::adopt_group() {
  group_ = resilient_->group_ptr();
  rank_ = group_->rank();
  world_ = group_->size();
  oss_ = &resilient_->optimizer();
  ddp_ = resilient_->ddp();
  if (rank_ == 0) {
    progress_->enable();  // the first survivor prints from now on, rank 0 or not before
    if (metrics_on_ && !metrics_) metrics_ = std::make_unique<MetricsLog>(metrics_file(o_), /*append=*/true);
  }
}

void Trainer::admitted(const Admission& a) {
  adopt_group();
  if (metrics_) {
    metrics_->write({{"event", "admission"},
                     {"step", a.step},
                     {"joined", a.joined},
                     {"refused", a.refused},
                     {"world", world_},
                     {"seconds", a.seconds}});
  }
  progress_->print(fmt::format("step {} (epoch {}): {}", a.step, a.step / steps_per_epoch_ + 1, a.to_string()));
}

void Trainer::recovered(const Recovery& r) {
  adopt_group();
  if (metrics_) {
    metrics_->write({{"event", "recovery"},
                     {"step", r.resume_step},
                     {"lost_ranks", r.lost},
                     {"phase", r.phase},
                     {"failed_step", r.failed_step},
                     {"steps_rolled_back", r.steps_rolled_back},
                     {"world", r.world_size},
                     {"seconds", r.seconds}});
  }
  progress_->print(fmt::format("step {} (epoch {}): {}", r.failed_step, r.failed_step / steps_per_epoch_ + 1,
                               r.to_string()));
}

std::pair<int64_t, int64_t> Trainer::evaluate() {
  ddp_->finish_param_sync();  // (--overlap-sync: the last step's sync may be in flight)
  at::NoGradGuard no_grad;
  model_->eval();
  const int64_t n = data_.test_images.size(0);
  int64_t correct = 0, seen = 0;
  // This rank's share: every world-th sample.
  const at::Tensor mine = at::arange(rank_, n, world_, at::TensorOptions().dtype(at::kLong).device(device_));
  for (int64_t start = 0; start < mine.size(0); start += 1000) {
    const at::Tensor idx = mine.narrow(0, start, std::min<int64_t>(1000, mine.size(0) - start));
    const at::Tensor images = normalise(data_.test_images.index_select(0, idx)).to(params_[0].scalar_type());
    const at::Tensor pred = model_->forward(images).argmax(1);
    correct += pred.eq(data_.test_labels.index_select(0, idx)).sum().item<int64_t>();
    seen += idx.size(0);
  }
  model_->train();
  at::Tensor t = at::tensor({correct, seen}, at::kLong);
  group_->allreduce(t);
  return {t[0].item<int64_t>(), t[1].item<int64_t>()};
}

void Trainer::save(int64_t next_epoch_step) {
  TrainingState state;
  state.step = step_;
  state.epoch = epoch_;
  state.sampler = sampler_->state(next_epoch_step);
  for (const auto& [option, values] : resume_choices()) {
    const auto it = std::find(values.begin(), values.end(), choice_of(o_, option));
    state.scalars[std::string("option ") + option] = static_cast<double>(it - values.begin());
  }
  for (const auto& r : resumables()) state.scalars[std::string("value ") + r.option] = r.value(o_);
  if (scaler_) {
    state.scalars["loss_scale"] = scaler_->get_scale();
    state.scalars["loss_scale_growth_tracker"] = static_cast<double>(scaler_->growth_tracker());
  }
  const auto options = CheckpointOptions().optimizer_state(o_.sharded_checkpoint ? OptimizerStateLayout::kSharded
                                                                               : OptimizerStateLayout::kConsolidated);
  // In the background by default (the previous save, if still in flight, is finished first).
  // Under --survive-failures synchronously: a recovery rebuilds the optimizer, and a write in
  // flight would wait on the dead rank.
  if (o_.sync_checkpoint || resilient_) {
    save_checkpoint(o_.checkpoint_dir + "/last.ckpt", *ddp_, *oss_, state, options);
  } else {
    pending_save_ = save_checkpoint_async(o_.checkpoint_dir + "/last.ckpt", *ddp_, *oss_, state, options);
  }
}

int64_t Trainer::model_numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel();
  return n;
}

// The run's result and what sharding saved on each rank, measured.
void Trainer::summary() {
  // Under mixed precision the fp32 master weights count with the state (ZeRO's 12 bytes).
  const auto state = per_rank(*group_, oss_->local_state_bytes() + oss_->local_master_bytes());
  const auto grads = per_rank(*group_, last_grad_bytes_);
  if (rank_ != 0) return;
  int64_t state_total = 0;
  for (int64_t v : state) state_total += v;
  int64_t grad_total = 0;
  for (const auto& p : params_) grad_total += p.requires_grad() ? p.numel() * static_cast<int64_t>(p.element_size()) : 0;
  const double seconds = progress_->seconds();
  const int64_t steps = progress_->steps_done();
  if (metrics_) {
    metrics_->write({{"event", "done"},
                     {"step", step_},
                     {"steps", steps},
                     {"seconds", seconds},
                     {"samples_per_s", static_cast<double>(steps * o_.batch_size) / std::max(seconds, 1e-9)},
                     {"test_accuracy", last_accuracy_},
                     {"state_bytes", state},
                     {"grad_bytes", grads}});
  }
  std::printf("done: %lld steps in %.1f s (%.0f samples/s)%s\n", static_cast<long long>(steps), seconds,
              static_cast<double>(steps * o_.batch_size) / std::max(seconds, 1e-9),
              last_accuracy_ >= 0 ? fmt::format(", test accuracy {:.2f}%", 100.0 * last_accuracy_).c_str() : "");
  if (scaler_) {
    std::printf("fp16: %lld steps skipped for inf/nan gradients, loss scale %g at the end\n",
                static_cast<long long>(skipped_steps_), scaler_->get_scale());
  }
  std::printf("memory per rank: optimizer state%s %s of %s unsharded; gradients after the last backward %s of %s "
              "(all trainable gradients)\n",
              o_.mixed_precision != "off" ? " + fp32 master weights" : "",
              per_rank_bytes(state).c_str(), bytes_text(static_cast<double>(state_total)).c_str(),
              per_rank_bytes(grads).c_str(), bytes_text(static_cast<double>(grad_total)).c_str());
  if (metrics_) {
    try {
      std::printf("metrics: %s, chart %s\n", metrics_->path().c_str(), metrics_->draw(SHARDOPT_APP_PYTHON).c_str());
    } catch (const c10::Error& e) {  // the run itself succeeded: a missing chart is a warning
      std::printf("metrics: %s; no chart: %s\n", metrics_->path().c_str(), e.what_without_backtrace());
    }
  }
  std::fflush(stdout);
}

// Note [Restarted by torchrun]
// Under torchrun's --max-restarts, a failed worker makes the agent restart every worker with
// TORCHELASTIC_RESTART_COUNT one higher. A restarted run with --checkpoint-dir whose last.ckpt
// exists resumes from it by itself, as if --resume had been passed: the job goes on from its last
// checkpoint instead of starting over. Every rank reads the same count and the same folder, so
// every rank decides alike. SHARDOPT_FAULT_AT_STEP=R:S makes rank R kill itself before step S in
// a run that has not been restarted, so that the restart can be tested.
void Trainer::read_restart_env(const TrainOptions& o) {
  resume_ = o.resume;
  if (const char* v = env_var("TORCHELASTIC_RESTART_COUNT")) restarts_ = std::atoll(v);
  struct stat st {};
  if (!resume_ && restarts_ > 0 && !o.checkpoint_dir.empty() &&
      ::stat((o.checkpoint_dir + "/last.ckpt").c_str(), &st) == 0) {
    resume_ = true;
  }
  const char* replacement = env_var("SHARDOPT_REPLACEMENT");
  if (const char* v = env_var("SHARDOPT_FAULT_AT_STEP"); v && restarts_ == 0 && !(replacement && std::string(replacement) == "1")) {
    const std::string text = v;
    const size_t colon = text.find(':');
    int64_t rank = -1, step = -1;
    const auto whole_number = [](const std::string& t, int64_t& out) {
      const auto [end, error] = std::from_chars(t.data(), t.data() + t.size(), out);
      return error == std::errc() && end == t.data() + t.size() && !t.empty() && out >= 0;
    };
    SHARDOPT_CHECK(colon != std::string::npos && whole_number(text.substr(0, colon), rank) &&
                       whole_number(text.substr(colon + 1), step),
                   "SHARDOPT_FAULT_AT_STEP='", text, "' is not RANK:STEP (two non-negative integers, e.g. 1:15)");
    fault_rank_ = static_cast<int>(rank);
    fault_step_ = step;
  }
  if (const char* v = env_var("SHARDOPT_AWAIT_JOINER_AT_STEP"); v && !(replacement && std::string(replacement) == "1")) {
    await_joiner_at_ = std::atoll(v);
    SHARDOPT_CHECK(await_joiner_at_ > 0, "SHARDOPT_AWAIT_JOINER_AT_STEP='", v, "' is not a positive step");
  }
}

void Trainer::log_memory() {
  const auto state = per_rank(*group_, oss_->local_state_bytes());
  const auto masters = per_rank(*group_, oss_->local_master_bytes());
  const auto grads = per_rank(*group_, last_grad_bytes_);
  if (metrics_) {
    metrics_->write({{"step", step_}, {"state_bytes", state}, {"master_bytes", masters}, {"grad_bytes", grads}});
  }
}

}  // namespace

int run_train(const TrainOptions& options) {
#if defined(__GLIBC__)
  // glibc's malloc hands the heap's freed top back to the kernel and takes it again, zeroed page
  // by page, at the next step: a quarter of a CNN rank's time went to the kernel's page faults.
  // Grow the heap 256 MiB at a time and trim it only beyond 1 GiB (docs/benchmarks.md, §10).
  mallopt(M_TOP_PAD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
  Trainer trainer(options);
  return trainer.run();
}

}  // namespace shardopt::app
