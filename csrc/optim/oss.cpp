#include <shardopt/optim/oss.h>
#include <shardopt/optim/fused_step.h>
#include <shardopt/check.h>

#include <shardopt/comm/agree.h>

#include "optim/backward_step.h"
#include "optim/codec.h"
#include "optim/fused_kernels.h"
#include "cuda/kernels_adapter.h"
#include "optim/fused_step_mixed.h"
#include "optim/master_weights.h"
#include "optim/param_buffers.h"
#include "optim/shard_store.h"
#include "optim/state_codes.h"
#include "optim/state_migration.h"
#include "optim/state_slabs.h"
#include "optim/trainable.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/lbfgs.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace shardopt {

namespace optim = torch::optim;
using detail::GenericDict;

namespace {

// What `factory` makes, over no parameters.
std::unique_ptr<optim::Optimizer> probe(const OptimizerFactory& factory) {
  SHARDOPT_CHECK(factory, "OSS needs an optimizer factory, got an empty one");
  auto made = factory({optim::OptimizerParamGroup(std::vector<at::Tensor>{})});
  SHARDOPT_CHECK(made, "the optimizer factory returned null");
  return made;
}

std::unique_ptr<optim::OptimizerOptions> probe_defaults(const OptimizerFactory& factory) {
  return probe(factory)->defaults().clone();
}

const OptimizerFactory& first_factory(const std::vector<OptimizerGroup>& groups) {
  SHARDOPT_CHECK(!groups.empty(), "OSS needs at least one OptimizerGroup, got none");
  for (size_t k = 0; k < groups.size(); ++k) {
    SHARDOPT_CHECK(groups[k].optimizer, "OptimizerGroup ", k, " has no optimizer factory");
  }
  return groups.front().optimizer;
}

// The first problem with the user's parameters on this rank, or "".
std::string local_param_problem(const std::vector<optim::OptimizerParamGroup>& groups) {
  std::unordered_map<const void*, size_t> seen;
  size_t index = 0, count = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      std::ostringstream where;
      where << "parameter " << index << " (group " << g << ")";
      if (!p.defined()) return where.str() + " is an undefined tensor";
      if (p.is_sparse()) return where.str() + " is sparse; OSS supports dense parameters only";
      if (!p.is_leaf()) return where.str() + " is not a leaf tensor (optimize the leaf, not a result of an operation)";
      if (!p.is_floating_point()) return where.str() + " is not floating point";
      auto [it, fresh] = seen.emplace(p.unsafeGetTensorImpl(), index);
      if (!fresh) {
        std::ostringstream msg;
        msg << where.str() << " is the same tensor as parameter " << it->second
            << ": a parameter may appear in only one group";
        return msg.str();
      }
      ++index, ++count;
    }
  }
  if (count == 0) return "the parameter list is empty";
  return "";
}

bool whole_range(const at::Tensor& param, Range range) {
  return range.begin == 0 && range.size() == param.numel();
}

std::vector<int64_t> encode_text(const std::string& s) {
  return std::vector<int64_t>(s.begin(), s.end());
}
std::string decode_text(const std::vector<int64_t>& v) {
  return std::string(v.begin(), v.end());
}

// What the ranks must agree on about one parameter: dtype, device type, trainability, group,
// shape.
std::vector<int64_t> param_descriptor(const at::Tensor& p, size_t group) {
  std::vector<int64_t> d{static_cast<int64_t>(p.scalar_type()), static_cast<int64_t>(p.device().type()),
                         p.requires_grad() ? 1 : 0, static_cast<int64_t>(group), p.dim()};
  for (int64_t i = 0; i < 8; ++i) d.push_back(i < p.dim() ? p.size(i) : -1);
  return d;
}
std::string descriptor_text(const int64_t* d) {
  std::ostringstream out;
  out << c10::toString(static_cast<c10::ScalarType>(d[0])) << "[";
  for (int64_t i = 0; i < d[4] && i < 8; ++i) out << (i ? ", " : "") << d[5 + i];
  out << "] on " << c10::DeviceTypeName(static_cast<c10::DeviceType>(d[1]), true) << ", requires_grad="
      << (d[2] ? "true" : "false") << ", group " << d[3];
  return out.str();
}


}  // namespace

// ---- construction ---------------------------------------------------------------------------

OSS::OSS(std::vector<torch::Tensor> params, OptimizerFactory factory, std::shared_ptr<ProcessGroup> group,
         OSSOptions options)
    : OSS(std::vector<optim::OptimizerParamGroup>{optim::OptimizerParamGroup(std::move(params))},
          std::move(factory), std::move(group), options) {}

OSS::OSS(std::vector<optim::OptimizerParamGroup> groups, OptimizerFactory factory,
         std::shared_ptr<ProcessGroup> group, OSSOptions options)
    : optim::Optimizer(std::vector<optim::OptimizerParamGroup>{}, probe_defaults(factory)),
      group_(std::move(group)),
      options_(options) {
  SHARDOPT_CHECK(group_, "OSS needs a process group, got null");
  std::vector<Unit> units(1);
  units[0].factory = std::move(factory);
  for (size_t g = 0; g < groups.size(); ++g) units[0].groups.push_back(g);
  init(std::move(groups), std::move(units));
}

OSS::OSS(std::vector<OptimizerGroup> groups, std::shared_ptr<ProcessGroup> group, OSSOptions options)
    : optim::Optimizer(std::vector<optim::OptimizerParamGroup>{}, probe_defaults(first_factory(groups))),
      group_(std::move(group)),
      options_(options) {
  SHARDOPT_CHECK(group_, "OSS needs a process group, got null");
  std::vector<optim::OptimizerParamGroup> param_groups;
  std::vector<Unit> units(groups.size());
  for (size_t k = 0; k < groups.size(); ++k) {
    param_groups.emplace_back(std::move(groups[k].params), probe_defaults(groups[k].optimizer));
    units[k].factory = std::move(groups[k].optimizer);
    units[k].groups = {k};
  }
  init(std::move(param_groups), std::move(units));
}

OSS::~OSS() {
  try {
    finish_param_sync();
  } catch (const std::exception&) {
    // A failed sync was the last thing this OSS did; its error is not for a destructor to raise.
  }
}

void OSS::init(std::vector<optim::OptimizerParamGroup> groups, std::vector<Unit> units) {
  // Every rank learns of any rank's bad input, so no rank is left waiting in a collective.
  std::string problem = local_param_problem(groups);
  if (problem.empty() && options_.fused_step()) {
    try {
      detail::cpu_kernel_level();  // reads SHARDOPT_FUSED_KERNELS: a bad value fails here, before any step
    } catch (const c10::Error& e) {
      problem = e.what_without_backtrace();
    }
  }
  auto problems = group_->allgather_ints(encode_text(problem));
  for (int r = 0; r < group_->size(); ++r) {
    SHARDOPT_CHECK(problems[r].empty(), "OSS on rank ", r, ": ", decode_text(problems[r]));
  }

  for (size_t g = 0; g < groups.size(); ++g) {
    optim::OptimizerParamGroup global(groups[g].params());
    global.set_options(groups[g].has_options() ? groups[g].options().clone() : defaults_->clone());
    param_groups_.push_back(std::move(global));
    group_sizes_.push_back(groups[g].params().size());
    for (const auto& p : groups[g].params()) {
      index_of_.emplace(p.unsafeGetTensorImpl(), params_.size());
      params_.push_back(p);
      group_of_.push_back(g);
    }
  }
  check_params_across_ranks();  // includes requires_grad: the ranks agree on the trainable set
  form_blocks();
  if (group_->backend() == "nccl") {  // the ranks agree on devices: every rank stops here alike
    for (size_t i = 0; i < params_.size(); ++i) {
      SHARDOPT_CHECK(params_[i].is_cuda(), "parameter ", i, " is on ", params_[i].device(),
                     " but the process group uses NCCL, which moves CUDA tensors only; move the model to "
                     "this rank's GPU or create the group with backend \"gloo\"");
    }
  }

  set_units(std::move(units));
  check_options_alike();  // Note [Optimizers agree across ranks]

  mixed_ = options_.mixed_precision().enabled() || !options_.mixed_precision().problem().empty();
  if (mixed_) master_sources_ = detail::cast_to_param_dtype(*global_group_, params_, options_.mixed_precision());
  check_param_wire();
  check_state_format();
  masters_ = mixed_ || options_.param_wire() != Wire::kExact;
  if (masters_ && !mixed_ && global_group_->size() > 1) {
    // The masters start from the same values on every rank (Note [Parameter wire]).
    at::NoGradGuard no_grad;
    for (auto& p : params_) {
      at::Tensor data = p.detach();
      global_group_->broadcast(data, 0);
    }
  }
  const std::vector<uint8_t> trainable = detail::trainable_mask(params_);  // agreed above
  placement_ = place_params(param_shapes(trainable), group_->size(), options_.partition(), options_.split_above_imbalance(),
                            all_registered());
  options_.layout().split(placement_.split);
  if (options_.state_format() == StateFormat::kInt8) {
    // Every block of 8-bit state has one owner (Note [8-bit state slabs]).
    const int64_t align = options_.layout().align();
    options_.layout().align(std::lcm(align, detail::kStateBlock));
  }
  holdings_.assign(params_.size(), {});
  store_ = std::make_unique<detail::ShardStore>(params_, group_, options_.layout(), options_.sync(),
                                                options_.param_wire(), placement_.partition, placement_.whole_kind);
  slabs_ = std::make_unique<detail::StateSlabs>(options_.state_format());
  if (placement_.split) {
    // A parameter frozen from the start keeps its state where it would be if all were trainable.
    lay_out(store_->make_plan(std::vector<uint8_t>(params_.size(), 1), store_->partition()));
  }
  lay_out_for(trainable);
  repartition_due_ = false;  // the partition was placed for this set
  settled_ = holdings_;
  settled_version_ = store_->plan_version();

  make_local_on_every_rank();
  master_sources_.clear();
  place_state();
}

// The optimizers, each over its global groups, and what shardopt knows of each.
void OSS::set_units(std::vector<Unit> units) {
  units_ = std::move(units);
  unit_of_group_.assign(param_groups_.size(), 0);
  local_group_of_.assign(param_groups_.size(), 0);
  for (size_t u = 0; u < units_.size(); ++u) {
    for (size_t k = 0; k < units_[u].groups.size(); ++k) {
      unit_of_group_[units_[u].groups[k]] = u;
      local_group_of_[units_[u].groups[k]] = k;
    }
    auto made = probe(units_[u].factory);
    SHARDOPT_CHECK(!dynamic_cast<optim::LBFGS*>(made.get()),
                   "OSS cannot shard LBFGS: each of its steps evaluates the closure several times and takes dot "
                   "products over all parameters, which a rank holding a shard cannot do alone; use "
                   "torch::optim::LBFGS on every rank without OSS");
    units_[u].codec = detail::find_codec(*made);
    // Nothing is switched off silently: without a codec, state cannot move between ranks.
    const optim::Optimizer& ref = *made;
    units_[u].class_name = c10::demangle(typeid(ref).name());
    units_[u].fused_kind = dynamic_cast<const optim::Adam*>(&ref) || dynamic_cast<const optim::AdamW*>(&ref) ||
                           dynamic_cast<const optim::SGD*>(&ref);
    SHARDOPT_CHECK(units_[u].codec || !options_.rebalance(), "OSS: the optimizer ", c10::demangle(typeid(ref).name()),
                   " is not registered (shardopt knows Adam, AdamW, SGD, RMSprop, Adagrad and Muon; "
                   "shardopt::register_optimizer in shardopt/optim/state_layout.h says how another one's state is "
                   "laid out), so its state cannot move to a new owner after a freeze; register it, or pass "
                   "OSSOptions().rebalance(false) to train with it (state_dict() will not be available either)");
  }
}

void OSS::make_local_on_every_rank() {
  // A factory may refuse this rank's holdings (Muon a parameter that is not 2-D): every rank
  // learns of it, so none is left waiting in the next collective.
  std::string failed;
  try {
    make_local();
  } catch (const c10::Error& e) {
    failed = e.what_without_backtrace();
  } catch (const std::exception& e) {
    failed = e.what();
  }
  const auto failures = group_->allgather_ints(encode_text(failed));
  for (int r = 0; r < group_->size(); ++r) {
    SHARDOPT_CHECK(failures[r].empty(), "OSS on rank ", r, ": the optimizer factory failed over that rank's "
                   "parameters: ", decode_text(failures[r]));
  }
}

// The wrapped optimizers over this rank's holdings, with the global groups' options.
void OSS::make_local() {
  for (auto& unit : units_) {
    std::vector<optim::OptimizerParamGroup> local_groups;
    for (size_t g : unit.groups) {
      local_groups.emplace_back(std::vector<at::Tensor>{}, param_groups_[g].options().clone());
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (unit_of(i).groups != unit.groups) continue;
      for (const auto& h : holdings_[i]) {
        if (h.rank == group_->rank()) local_groups[local_group_of_[group_of_[i]]].params().push_back(h.tensor);
      }
    }
    unit.local = unit.factory(std::move(local_groups));
    SHARDOPT_CHECK(unit.local, "the optimizer factory returned null");
  }
}

// What placement needs of each parameter (Note [Ownership by kind] in placement.cpp).
std::vector<ParamShape> OSS::param_shapes(const std::vector<uint8_t>& trainable) const {
  std::vector<ParamShape> shapes;
  for (size_t i = 0; i < params_.size(); ++i) {
    ParamShape s;
    s.sizes = params_[i].sizes().vec();
    s.dtype = params_[i].scalar_type();
    s.device = params_[i].device();
    s.trainable = trainable[i] != 0;
    const auto* codec = unit_of(i).codec;
    s.registered = codec != nullptr;
    s.whole_tensor = codec && codec->kind == StateKind::kWholeTensor;
    s.cost = s.whole_tensor ? codec->cost(params_[i].sizes()) : 0.0;
    shapes.push_back(std::move(s));
  }
  return shapes;
}

bool OSS::all_registered() const {
  return std::all_of(units_.begin(), units_.end(), [](const Unit& unit) { return unit.codec != nullptr; });
}

void OSS::check_params_across_ranks() {
  Agreement agreement("OSS");
  agreement.field("the number of parameters", static_cast<int64_t>(params_.size()));
  for (size_t i = 0; i < params_.size(); ++i) {
    agreement.field("parameter " + std::to_string(i), param_descriptor(params_[i], group_of_[i]),
                    [](const std::vector<int64_t>& d) { return descriptor_text(d.data()); });
  }
  agreement.field("param_wire", static_cast<int64_t>(options_.param_wire()),
                  [](const std::vector<int64_t>& v) { return wire_name(static_cast<Wire>(v[0])); });
  agreement.field("state_format", static_cast<int64_t>(options_.state_format()),
                  [](const std::vector<int64_t>& v) { return state_format_name(static_cast<StateFormat>(v[0])); });
  agreement.hint("every rank must pass the same parameters, in the same order and groups, and the same "
                 "OSSOptions::param_wire and state_format").check(*group_);
}

// After the ranks agreed on param_wire (check_params_across_ranks) and on mixed precision.
void OSS::check_param_wire() const {
  const Wire wire = options_.param_wire();
  const auto& mp = options_.mixed_precision();
  SHARDOPT_CHECK(!(wire == Wire::kBFloat16 && mp.enabled() && *mp.param_dtype() == at::kHalf),
                 "OSSOptions::param_wire(Wire::kBFloat16) with MixedPrecision::param_dtype(kHalf): the parameters are "
                 "fp16 already, and rounding them to bf16 would lose precision without saving a byte; use "
                 "param_wire(Wire::kExact), or param_dtype(kBFloat16)");
}

bool OSS::lay_out_for(const std::vector<uint8_t>& trainable) {
  if (trainable != store_->trainable()) refuse_new_layout_in_backward_step();
  if (!store_->lay_out_for(trainable)) return false;
  repartition_due_ = true;  // the step runs on the old owners; the re-partition follows it
  follow_plan();
  return true;
}

void OSS::lay_out(detail::PlanPtr plan) {
  refuse_new_layout_in_backward_step();
  store_->lay_out(std::move(plan));
  follow_plan();
}

// The step a backward began (Note [A step in the backward]) syncs the buckets of its layout; a
// new one before step() would leave it half on each.
void OSS::refuse_new_layout_in_backward_step() const {
  SHARDOPT_CHECK(!backward_step_, "a new layout (a changed trainable set, or a re-partition) on rank ", group_->rank(),
                 " between a backward that stepped the optimizer (ShardedDDPOptions::step_in_backward) and step(); call "
                 "step() first");
}

void OSS::follow_plan() {
  if (holdings_version_ == store_->plan_version()) return;
  assign_holdings();
  holdings_version_ = store_->plan_version();
}

void OSS::assign_holdings() {
  const int rank = group_->rank();
  std::vector<std::vector<detail::Holding>> next(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto held = held_ranges(store_->layout(), store_->partition(), kept_whole(i),
                                  store_->trainable()[i] != 0, i, params_[i].numel());
    if (held) {
      for (const auto& [owner, range] : *held) next[i].push_back({owner, range, at::Tensor()});
    } else {
      next[i] = holdings_[i];  // frozen without state: nothing to keep, nothing moves
    }
    for (auto& h : next[i]) {
      if (h.rank != rank) {
        h.tensor = at::Tensor();
        continue;
      }
      // The same range keeps its tensor, which keys its state: the settled one first (it holds
      // the state even after several layouts without a step), else the current one.
      h.tensor = at::Tensor();
      for (const auto* list : {&settled_, &holdings_}) {
        if (i >= list->size() || h.tensor.defined()) continue;
        for (const auto& old : (*list)[i]) {
          if (old.rank == rank && old.in_param == h.in_param && old.tensor.defined()) h.tensor = old.tensor;
        }
      }
      if (masters_) {  // a master has storage of its own (Note [Mixed precision])
        if (!h.tensor.defined()) {
          h.tensor = detail::make_master(params_[i], i < master_sources_.size() ? master_sources_[i] : at::Tensor(),
                                         h.in_param);
        }
        continue;
      }
      // OSS's own tensor over the parameter's memory, never the user's parameter: the wrapped
      // optimizer's step reads its .grad, which OSS alone sets (Note [Owned gradients]).
      const bool whole = h.in_param.begin == 0 && h.in_param.size() == params_[i].numel();
      at::Tensor view = whole ? params_[i].detach()
                              : params_[i].detach().reshape(-1).narrow(0, h.in_param.begin, h.in_param.size()).detach();
      if (h.tensor.defined()) {
        h.tensor.set_data(view);
      } else {
        h.tensor = view;
      }
    }
  }
  holdings_ = std::move(next);
}

void OSS::settle_state() {
  if (settled_version_ == store_->plan_version()) return;  // nothing laid out since the last settle
  CommPhase phase("optimizer state moving to new owners");
  bool changed = false;
  for (size_t i = 0; i < params_.size() && !changed; ++i) changed = !detail::same_holdings(settled_[i], holdings_[i]);
  std::vector<detail::StatePart> parts;
  if (changed) {
    RebalanceStats stats;
    stats.imbalance_before = last_rebalance_.imbalance_before;
    stats.imbalance_after = last_rebalance_.imbalance_after;
    const detail::HoldingGrads grads{
        [this](size_t i, const detail::Holding& h) { return owned_grad(i, h); },
        [this](size_t i, const detail::Holding& h, at::Tensor g) { set_owned_grad(i, h, std::move(g)); }};
    // 8-bit state that changes rank goes in fp32 and is coded again in its new slot, to the same
    // codes; the state that stays keeps its codes, moved with their scales (Note [8-bit state
    // slabs]).
    std::function<c10::impl::GenericDict(const c10::impl::GenericDict&)> widen;
    if (options_.state_format() == StateFormat::kInt8) {
      widen = [this](const c10::impl::GenericDict& d) { return slabs_->widened(d); };
    }
    // Registered optimizers' state lands in its slots from its slices (Note [State lands in its slot]).
    detail::migrate_holdings(*group_, [this](size_t i) -> optim::Optimizer& { return *unit_of(i).local; }, settled_,
                             holdings_, grads, stats, /*carry_values=*/masters_, all_registered() ? &parts : nullptr,
                             widen);
    last_rebalance_ = stats;
    ++state_moves_;
  }
  store_->retain_grads(holdings_, group_->rank());
  settled_ = holdings_;
  settled_version_ = store_->plan_version();
  set_local_groups();
  const int64_t copied = place_state(&parts);
  if (changed) last_rebalance_.state_bytes_copied = copied;
}

int64_t OSS::place_state(std::vector<detail::StatePart>* parts) {
  // An optimizer shardopt does not know keeps its own state.
  if (!all_registered() || settled_version_ != store_->plan_version()) {
    TORCH_INTERNAL_ASSERT(!parts || parts->empty(), "state in parts with nowhere to land");
    return 0;
  }
  slabs_->plan_slots(store_->layout(), group_->rank(), settled_, [this](size_t i, const at::Tensor& key) {
    return unit_of(i).local->state().count(compat::state_key(key)) != 0;
  });
  std::vector<std::pair<optim::Optimizer*, const detail::OptimizerCodec*>> units;
  for (auto& unit : units_) units.emplace_back(unit.local.get(), unit.codec);
  std::vector<detail::StatePart> none;
  slabs_->move_in_place(units, parts ? *parts : none);  // (Note [Moving ranges in place])
  int64_t copied = slabs_->land_parts(units, parts ? *parts : none);
  for (auto& unit : units_) copied += slabs_->adopt(*unit.local, *unit.codec);
  if (masters_) slabs_->adopt_masters(settled_, group_->rank());
  return copied;
}

at::Tensor OSS::owned_grad(size_t i, const detail::Holding& h) const {
  return whole_range(params_[i], h.in_param) ? params_[i].grad() : store_->grad(i, h.in_param);
}

void OSS::set_owned_grad(size_t i, const detail::Holding& h, at::Tensor grad) {
  // `grad` is shaped like h.tensor (a whole parameter's holding has the parameter's shape).
  if (whole_range(params_[i], h.in_param)) {
    params_[i].mutable_grad() = std::move(grad);
  } else {
    store_->set_grad(i, h.in_param, std::move(grad));
  }
}

at::Tensor OSS::holding_grad(size_t i, const detail::Holding& h) const {
  const at::Tensor& full = params_[i].grad();
  if (full.defined() && full.numel() == params_[i].numel()) {
    if (whole_range(params_[i], h.in_param) && full.sizes() == h.tensor.sizes()) return full;
    return full.reshape(-1).narrow(0, h.in_param.begin, h.in_param.size()).view(h.tensor.sizes());
  }
  return store_->grad(i, h.in_param);
}

void OSS::set_local_groups() {
  for (auto& unit : units_) {
    for (auto& g : unit.local->param_groups()) g.params().clear();
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& group = unit_of(i).local->param_groups()[local_group_of_[group_of_[i]]];
    for (const auto& h : settled_[i]) {
      if (h.rank == group_->rank()) group.params().push_back(h.tensor);
    }
  }
}

const FlatLayout& OSS::layout() const { return store_->layout(); }


detail::ShardStore& OSS::hand_over(const detail::HandOver& h) {
  store_->hand_over(h);
  follow_plan();  // new bucket cuts
  return *store_;
}

// ---- introspection ------------------------------------------------------------------------

size_t OSS::index_of(const torch::Tensor& param) const {
  if (param.defined()) {
    auto it = index_of_.find(param.unsafeGetTensorImpl());
    if (it != index_of_.end()) return it->second;
  }
  SHARDOPT_CHECK(false, "the tensor", (param.defined() ? " of shape " + c10::str(param.sizes()) : std::string()),
              " is not a parameter of this OSS");
}

int OSS::owner(const torch::Tensor& param) const {
  const auto& h = holdings_[index_of(param)];
  if (h.size() == 1 && h[0].in_param.begin == 0 && h[0].in_param.size() == param.numel()) return h[0].rank;
  return -1;
}

std::vector<int> OSS::owners(const torch::Tensor& param) const {
  std::vector<int> ranks;
  for (const auto& h : holdings_[index_of(param)]) ranks.push_back(h.rank);
  return ranks;
}

std::string OSS::describe() const {
  std::ostringstream out;
  bool any_whole_kind = false;
  bool any_element_wise = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    any_whole_kind |= placement_.whole_kind[i] && unit_of(i).codec;
    any_element_wise |= !placement_.whole_kind[i];
  }
  out << "OSS over " << group_->size() << (group_->size() == 1 ? " rank: " : " ranks: ")
      << (!placement_.split ? "whole parameters per owner"
          : !any_whole_kind   ? "parameters split into equal ranges (element-wise optimizer)"
          : any_element_wise  ? "element-wise optimizers' parameters split into equal ranges, whole-tensor "
                                "optimizers' parameters whole per owner, balanced by cost, in row buckets"
                              : "whole-tensor optimizers' parameters whole per owner, balanced by cost, in row buckets")
      << ", trainable imbalance " << layout().imbalance() * 100.0 << "%";
  if (options_.state_format() != StateFormat::kFloat32) {
    out << ", optimizer state in " << state_format_name(options_.state_format());
  }
  if (!placement_.split && options_.partition() == PartitionMode::kAuto) {
    if (!all_registered()) {
      out << " (the wrapped optimizer is not one shardopt knows the state layout of)";
    } else if (!any_whole_kind || placement_.whole_imbalance > 0) {
      out << " (whole parameters balance within " << placement_.whole_imbalance * 100.0 << "%, under the "
          << options_.split_above_imbalance() * 100.0 << "% that would split them)";
    }
  }
  // Per rank, from the holdings and the optimizers' declared state sizes (every rank computes
  // the same table).
  const int world = group_->size();
  std::vector<double> cost(world, 0.0);
  std::vector<int64_t> state_bytes(world, 0), whole(world, 0), part(world, 0);
  double total_cost = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Unit& unit = unit_of(i);
    const bool held = store_->trainable()[i] || store_->stepped()[i];
    for (const auto& h : holdings_[i]) {
      if (h.rank < 0 || !held) continue;
      const bool all = whole_range(params_[i], h.in_param);
      ++(all ? whole : part)[h.rank];
      if (unit.codec) {
        const auto& options = param_groups_[group_of_[i]].options();
        const int64_t numel = all ? unit.codec->state_numel(options, params_[i].sizes())
                                  : unit.codec->state_numel(options, {h.in_param.size()});
        const int64_t element = options_.state_format() == StateFormat::kBFloat16 ? 2
                                : masters_                                          ? 4
                                                   : static_cast<int64_t>(params_[i].element_size());
        if (options_.state_format() == StateFormat::kInt8 && detail::coded_numel(params_[i].numel())) {
          // A byte an element and an fp32 scale a block, per state tensor (Note [8-bit state slabs]).
          const int64_t tensors = numel / std::max<int64_t>(1, h.in_param.size());
          state_bytes[h.rank] += numel + tensors * 4 * detail::state_blocks(h.in_param.size());
        } else {
          state_bytes[h.rank] += numel * element;
        }
        if (placement_.whole_kind[i] && store_->trainable()[i]) {
          const double c = unit.codec->cost(params_[i].sizes());
          cost[h.rank] += c;
          total_cost += c;
        }
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    out << "\n  rank " << r << ": ";
    if (total_cost > 0) out << "whole-tensor cost " << 100.0 * cost[r] / total_cost << "%, ";
    out << "state " << state_bytes[r] << " bytes, " << whole[r] << " whole and " << part[r] << " split parameters";
  }
  return out.str();
}

RebalanceStats OSS::last_rebalance() const {
  RebalanceStats stats = last_rebalance_;
  stats.moves = state_moves_;
  stats.repartitions = partition_version_;
  return stats;
}

int64_t OSS::local_state_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) {
    const auto& codec = detail::codec_for(*unit.local);
    for (const auto& [key, state] : unit.local->state()) {
      const GenericDict encoded = codec.encode_state(*state);
      bytes += detail::state_tensor_bytes(encoded) + slabs_->scale_bytes_of(encoded);
    }
  }
  return bytes;
}

}  // namespace shardopt
