#include <shardopt/optim/oss.h>
#include <shardopt/check.h>

#include <shardopt/comm/agree.h>

#include "optim/codec.h"
#include "optim/trainable.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/serialize/archive.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <map>
#include <sstream>
#include <unordered_map>

namespace shardopt {

namespace optim = torch::optim;
using detail::GenericDict;

namespace {

std::unique_ptr<optim::OptimizerOptions> probe_defaults(const OptimizerFactory& factory) {
  SHARDOPT_CHECK(factory, "OSS needs an optimizer factory, got an empty one");
  auto probe = factory({optim::OptimizerParamGroup({at::zeros({1}).requires_grad_()})});
  SHARDOPT_CHECK(probe, "the optimizer factory returned null");
  return probe->defaults().clone();
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

std::vector<int64_t> encode_text(const std::string& s) {
  return std::vector<int64_t>(s.begin(), s.end());
}
std::string decode_text(const std::vector<int64_t>& v) {
  return std::string(v.begin(), v.end());
}

// What the ranks must agree on about one parameter: dtype, device type, trainability, group,
// shape.
std::vector<int64_t> describe(const at::Tensor& p, size_t group) {
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
  init(std::move(groups), std::move(factory));
}

OSS::~OSS() = default;

void OSS::init(std::vector<optim::OptimizerParamGroup> groups, OptimizerFactory factory) {
  // Every rank learns of any rank's bad input, so no rank is left waiting in a collective.
  const std::string problem = local_param_problem(groups);
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

  for (const auto& p : params_) weights_.push_back(p.numel() * static_cast<int64_t>(p.element_size()));
  trainable_ = detail::trainable_mask(params_);
  balanced_for_ = trainable_;
  partition_ = Partition::balance(weights_, group_->size(), trainable_);
  flatten_params();

  std::vector<optim::OptimizerParamGroup> local_groups;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    local_groups.emplace_back(std::vector<at::Tensor>{}, param_groups_[g].options().clone());
  }
  for (size_t i : partition_.shard(group_->rank())) local_groups[group_of_[i]].params().push_back(params_[i]);
  local_ = factory(std::move(local_groups));
  SHARDOPT_CHECK(local_, "the optimizer factory returned null");
}

void OSS::check_params_across_ranks() {
  Agreement agreement("OSS");
  agreement.field("the number of parameters", static_cast<int64_t>(params_.size()));
  for (size_t i = 0; i < params_.size(); ++i) {
    agreement.field("parameter " + std::to_string(i), describe(params_[i], group_of_[i]),
                    [](const std::vector<int64_t>& d) { return descriptor_text(d.data()); });
  }
  agreement.hint("every rank must pass the same parameters, in the same order and groups").check(*group_);
}

// Note [Parameter sync]
// Parameters of one (device, dtype) live in one flat buffer, laid out owner by owner; each
// owner's segment is padded to the longest, so the buffer is world_size equal shards. After the
// owners stepped, one broadcast per owner segment (or one all-gather of the shards) makes every
// copy current. set_data() keeps each parameter's TensorImpl, so optimizer state keys stay valid.
void OSS::flatten_params() {
  buffers_.clear();  // on a re-partition the parameters still hold the old buffers' data
  std::map<std::pair<int, int>, std::vector<size_t>> by_kind;  // (device, dtype) -> params
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    SHARDOPT_CHECK(p.device().is_cpu() || p.device().is_cuda(), "parameter ", i, " is on ", p.device(),
                "; OSS supports CPU and CUDA parameters");
    by_kind[{static_cast<int>(p.device().type()) * 1000 + p.device().index(), static_cast<int>(p.scalar_type())}]
        .push_back(i);
  }
  const int world = group_->size();
  at::NoGradGuard no_grad;
  for (auto& [kind, members] : by_kind) {
    std::vector<int64_t> seg(world, 0);
    for (size_t i : members) seg[partition_.owner(i)] += params_[i].numel();
    FlatBuffer buf;
    buf.segment_numel = std::max<int64_t>(1, *std::max_element(seg.begin(), seg.end()));
    buf.data = at::zeros({buf.segment_numel * world}, params_[members[0]].options().requires_grad(false));
    std::vector<int64_t> offset(world);
    for (int r = 0; r < world; ++r) offset[r] = r * buf.segment_numel;
    for (size_t i : members) {  // ascending global order within each owner's segment
      auto& p = params_[i];
      int r = partition_.owner(i);
      at::Tensor view = buf.data.narrow(0, offset[r], p.numel()).view(p.sizes());
      view.copy_(p.detach());
      p.set_data(view);
      offset[r] += p.numel();
    }
    buffers_.push_back(std::move(buf));
  }
}

// ---- stepping -------------------------------------------------------------------------------

void OSS::sync_options_to_local() {
  SHARDOPT_CHECK(param_groups_.size() == group_sizes_.size(),
              "OSS param groups changed after construction (", group_sizes_.size(), " -> ",
              param_groups_.size(), "); add_param_group is not supported, build a new OSS");
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    SHARDOPT_CHECK(param_groups_[g].params().size() == group_sizes_[g], "OSS param group ", g,
                " changed size after construction (", group_sizes_[g], " -> ", param_groups_[g].params().size(),
                " parameters)");
    local_->param_groups()[g].set_options(param_groups_[g].options().clone());
  }
}

bool OSS::trainable_mask_changed() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (static_cast<uint8_t>(params_[i].requires_grad()) != trainable_[i]) return true;
  }
  return false;
}

void OSS::agree_on_trainable(bool force) {
  auto mask = detail::trainable_mask(params_);
  detail::agree_on_mask(*group_, mask, force, [](size_t i) { return "parameter " + std::to_string(i); });
  trainable_ = std::move(mask);
}

void OSS::refresh_trainable() {
  agree_on_trainable(/*force=*/group_->size() > 1);
}

torch::Tensor OSS::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  if (options_.check_trainable_every_step()) {
    agree_on_trainable(false);
  } else if (trainable_mask_changed()) {
    trainable_ = detail::trainable_mask(params_);
  }
  sync_options_to_local();

  // A frozen parameter must not move, even if it still holds a gradient from before it was
  // frozen: hide such gradients from the wrapped optimizer for the duration of its step.
  std::vector<std::pair<at::Tensor, at::Tensor>> hidden;
  for (size_t i : partition_.shard(group_->rank())) {
    auto& p = params_[i];
    if (!trainable_[i] && p.grad().defined()) {
      hidden.emplace_back(p, p.grad());
      p.mutable_grad() = at::Tensor();
    }
  }
  try {
    local_->step();
  } catch (...) {
    for (auto& [p, g] : hidden) p.mutable_grad() = g;
    throw;
  }
  for (auto& [p, g] : hidden) p.mutable_grad() = g;

  sync_params();
  // The set was just agreed on, so every rank takes the same decision.
  if (options_.check_trainable_every_step()) rebalance(trainable_);
  return loss;
}

// ---- re-partitioning ---------------------------------------------------------------------------

// Note [Rebalance after a freeze]
// The partition balances the trainable parameters first and spreads the frozen ones by total
// weight (Partition::balance with flags). When the trainable set changes, the work a step does
// can become lopsided (freezing every other tensor of a GPT-2-shaped model leaves one of two
// ranks 1.77x the mean). If the old partition is more than rebalance_threshold above the mean
// for the new set, rebalance() improves it by moves and swaps of trainable parameters
// (Partition::rebalance: few change owner, frozen ones never do, so a frozen parameter's state
// stays where it is for when it is unfrozen). Each parameter that changes owner takes its
// optimizer state, and any gradient the old owner holds, to the new one (serialized with the
// state_dict codec, one pair of ranks at a time), and the flat buffers are laid out again, so
// the parameters' data moves with them. Every input of the decision (the mask,
// the partition, the weights) is the same on every rank, so all ranks decide alike without
// communicating. The step in which the set changed still runs on the old partition; the
// re-partition follows it.
bool OSS::rebalance(const std::vector<uint8_t>& trainable) {
  SHARDOPT_CHECK(trainable.size() == params_.size(), "OSS::rebalance got ", trainable.size(),
              " trainable flags for ", params_.size(), " parameters");
  if (trainable == balanced_for_) return false;
  balanced_for_ = trainable;
  if (!options_.rebalance() || group_->size() == 1 || !detail::find_codec(*local_)) return false;
  const double before = partition_.imbalance(weights_, trainable);
  if (before <= options_.rebalance_threshold()) return false;
  Partition next = Partition::rebalance(partition_, weights_, trainable);
  const double after = next.imbalance(weights_, trainable);
  if (after >= before) return false;

  last_rebalance_ = RebalanceStats();
  last_rebalance_.imbalance_before = before;
  last_rebalance_.imbalance_after = after;
  migrate_state(next);
  partition_ = std::move(next);
  ++partition_version_;
  flatten_params();
  set_local_groups();
  return true;
}

at::TensorOptions OSS::placed_like(size_t param) const {
  return params_[param].options().requires_grad(false);
}

std::unique_ptr<optim::OptimizerParamState> OSS::decode_placed(const GenericDict& encoded, size_t param) const {
  GenericDict placed = detail::make_string_dict();
  for (const auto& v : encoded) {
    if (v.value().isTensor() && v.key().toStringRef() != "step") {
      placed.insert(v.key(), v.value().toTensor().to(placed_like(param)));
    } else {
      placed.insert(v.key(), v.value());
    }
  }
  return detail::codec_for(*local_).decode_state(placed);
}

void OSS::migrate_state(const Partition& next) {
  const int rank = group_->rank(), world = group_->size();
  const auto& codec = detail::codec_for(*local_);
  auto& state = local_->state();
  // moving[s][d]: does any parameter go from rank s to rank d?
  std::vector<std::vector<uint8_t>> moving(world, std::vector<uint8_t>(world, 0));
  std::vector<GenericDict> outgoing;
  for (int d = 0; d < world; ++d) outgoing.emplace_back(c10::IntType::get(), c10::AnyType::get());
  for (size_t i = 0; i < params_.size(); ++i) {
    const int s = partition_.owner(i), d = next.owner(i);
    if (s == d) continue;
    moving[s][d] = 1;
    ++last_rebalance_.params_moved;
    if (s != rank) continue;
    GenericDict entry = detail::make_string_dict();
    auto it = state.find(compat::state_key(params_[i]));
    if (it != state.end()) {  // no state yet (never stepped): nothing to move
      GenericDict encoded = codec.encode_state(*it->second);
      last_rebalance_.state_bytes_sent += detail::state_tensor_bytes(encoded);
      entry.insert("state", encoded);
      state.erase(it);
    }
    // A gradient only the old owner holds (ShardedDDP reduced it there) goes along, so a step
    // right after the re-partition still sees it. clone(): a view would carry its whole base.
    if (params_[i].grad().defined()) entry.insert("grad", params_[i].grad().detach().clone());
    if (!entry.empty()) outgoing[d].insert(static_cast<int64_t>(i), entry);
  }
  // One pair of ranks at a time, in the same order everywhere: no two transfers wait on each other.
  for (int s = 0; s < world; ++s) {
    for (int d = 0; d < world; ++d) {
      if (!moving[s][d]) continue;
      if (rank == s) group_->send_bytes(torch::pickle_save(outgoing[d]), d, s);
      if (rank != d) continue;
      for (const auto& item : torch::pickle_load(group_->recv_bytes(s, s)).toGenericDict()) {
        const size_t i = static_cast<size_t>(item.key().toInt());
        const auto entry = item.value().toGenericDict();
        if (entry.contains("grad") && !params_[i].grad().defined()) {
          params_[i].mutable_grad() = entry.at("grad").toTensor().to(placed_like(i));
        }
        if (!entry.contains("state")) continue;
        const auto encoded = entry.at("state").toGenericDict();
        last_rebalance_.state_bytes_received += detail::state_tensor_bytes(encoded);
        state[compat::state_key(params_[i])] = decode_placed(encoded, i);
      }
    }
  }
}

void OSS::set_local_groups() {
  auto& groups = local_->param_groups();
  for (auto& g : groups) g.params().clear();
  for (size_t i : partition_.shard(group_->rank())) groups[group_of_[i]].params().push_back(params_[i]);
}

void OSS::sync_params() {
  const int world = group_->size();
  if (world == 1) return;
  at::NoGradGuard no_grad;
  if (options_.sync() == ParamSync::kBroadcast) {
    std::vector<PendingWork> pending;
    for (auto& buf : buffers_) {
      for (int r = 0; r < world; ++r) {
        at::Tensor segment = buf.data.narrow(0, r * buf.segment_numel, buf.segment_numel);
        pending.push_back(group_->broadcast_async(segment, r));
      }
    }
    for (auto& w : pending) w.wait();
    return;
  }
  for (auto& buf : buffers_) {
    std::vector<at::Tensor> segments;
    for (int r = 0; r < world; ++r) segments.push_back(buf.data.narrow(0, r * buf.segment_numel, buf.segment_numel));
    // The input is copied: it must not alias the output it is gathered into.
    at::Tensor mine = segments[group_->rank()].clone();
    group_->allgather(segments, mine);
  }
}

void OSS::zero_grad(bool set_to_none) {
  for (auto& p : params_) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.mutable_grad() = at::Tensor();
    } else {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

double OSS::clip_grad_norm(double max_norm, double norm_type) {
  SHARDOPT_CHECK(max_norm >= 0, "clip_grad_norm max_norm must be >= 0, got ", max_norm);
  SHARDOPT_CHECK(norm_type > 0, "clip_grad_norm norm_type must be > 0 (or inf), got ", norm_type);
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> grads;
  for (size_t i : partition_.shard(group_->rank())) {
    // The flags as they are now, not as of the last step(): unfreezing takes effect at once.
    if (params_[i].requires_grad() && params_[i].grad().defined()) grads.push_back(params_[i].grad());
  }
  double local = 0.0;
  for (const auto& g : grads) {
    const double n = g.norm(norm_type).item<double>();
    local = inf ? std::max(local, n) : local + std::pow(n, norm_type);
  }
  at::Tensor t = at::scalar_tensor(local, at::kDouble).reshape({1});
  group_->allreduce(t, inf ? Reduction::kMax : Reduction::kSum);
  const double total = inf ? t.item<double>() : std::pow(t.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
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
  return partition_.owner(index_of(param));
}

int64_t OSS::local_state_bytes() const {
  int64_t bytes = 0;
  const auto& codec = detail::codec_for(*local_);
  for (const auto& [key, state] : local_->state()) bytes += detail::state_tensor_bytes(codec.encode_state(*state));
  return bytes;
}

// ---- state dict -----------------------------------------------------------------------------

void OSS::consolidate_state_dict(int recipient) {
  Agreement().field("the recipient of consolidate_state_dict", recipient).check(*group_);
  SHARDOPT_CHECK(recipient >= 0 && recipient < group_->size(), "consolidate_state_dict recipient ",
              recipient, " is outside [0, ", group_->size(), ")");
  const auto& codec = detail::codec_for(*local_);
  const int rank = group_->rank();
  consolidated_.reset();
  last_recipient_ = recipient;

  auto own_shard = [&] {
    GenericDict shard(c10::IntType::get(), c10::AnyType::get());
    for (size_t i : partition_.shard(rank)) {
      auto it = local_->state().find(compat::state_key(params_[i]));
      if (it != local_->state().end()) shard.insert(static_cast<int64_t>(i), codec.encode_state(*it->second));
    }
    return shard;
  };

  GenericDict state(c10::IntType::get(), c10::AnyType::get());
  auto merge = [&](const GenericDict& shard) {
    for (const auto& entry : shard) state.insert(entry.key(), entry.value());
  };
  // One shard in flight at a time: the recipient holds the full state plus at most one
  // serialized shard.
  for (int r = 0; r < group_->size(); ++r) {
    if (r == recipient) {
      if (rank == recipient) merge(own_shard());
      continue;
    }
    if (rank == r) {
      group_->send_bytes(torch::pickle_save(own_shard()), recipient, r);
    } else if (rank == recipient) {
      merge(torch::pickle_load(group_->recv_bytes(r, r)).toGenericDict());
    }
  }
  if (rank != recipient) return;

  c10::impl::GenericList groups(c10::AnyType::get());
  size_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    GenericDict d = codec.encode_options(param_groups_[g].options());
    // A generic list: Python's safe loader accepts it without extra allow-listed globals.
    c10::impl::GenericList ids(c10::AnyType::get());
    for (size_t k = 0; k < group_sizes_[g]; ++k) ids.push_back(static_cast<int64_t>(index++));
    d.insert("params", ids);
    groups.push_back(d);
  }
  GenericDict result = detail::make_string_dict();
  result.insert("state", state);
  result.insert("param_groups", groups);
  consolidated_ = result;
}

torch::IValue OSS::state_dict() const {
  SHARDOPT_CHECK(consolidated_.has_value(), "OSS::state_dict() on rank ", group_->rank(),
              ": there is no consolidated state here; call consolidate_state_dict(recipient) on every rank first, "
              "then state_dict() on the recipient",
              (last_recipient_ >= 0 ? " (the last recipient was rank " + std::to_string(last_recipient_) + ")"
                                    : std::string()));
  return *consolidated_;
}

void OSS::load_state_dict(const torch::IValue& sd) {
  SHARDOPT_CHECK(sd.isGenericDict(), "load_state_dict expects a dict, got ", sd.tagKind());
  const auto dict = sd.toGenericDict();
  SHARDOPT_CHECK(dict.contains("state") && dict.contains("param_groups"),
              "load_state_dict expects the keys \"state\" and \"param_groups\"");
  const auto saved_groups = dict.at("param_groups").toListRef();
  SHARDOPT_CHECK(saved_groups.size() == param_groups_.size(), "load_state_dict: the state has ",
              saved_groups.size(), " param groups, this optimizer has ", param_groups_.size());
  // Saved ids map to our parameters by position, group by group, as in torch.optim.
  std::unordered_map<int64_t, size_t> id_to_param;
  size_t index = 0;
  for (size_t g = 0; g < saved_groups.size(); ++g) {
    const auto group = saved_groups[g].toGenericDict();
    SHARDOPT_CHECK(group.contains("params"), "load_state_dict: param group ", g, " has no \"params\"");
    const auto ids = group.at("params").toListRef();
    SHARDOPT_CHECK(ids.size() == group_sizes_[g], "load_state_dict: param group ", g, " has ", ids.size(),
                " parameters in the state but ", group_sizes_[g], " in this optimizer");
    for (const auto& id : ids) id_to_param[id.toInt()] = index++;
  }
  const auto& codec = detail::codec_for(*local_);
  const auto state = dict.at("state").toGenericDict();
  std::unordered_map<size_t, GenericDict> entries;
  for (const auto& entry : state) {
    const int64_t id = entry.key().toInt();
    auto it = id_to_param.find(id);
    SHARDOPT_CHECK(it != id_to_param.end(), "load_state_dict: state entry ", id,
                " belongs to no parameter of any group");
    const size_t i = it->second;
    const auto values = entry.value().toGenericDict();
    for (const auto& v : values) {
      if (!v.value().isTensor() || v.key().toStringRef() == "step") continue;
      const auto& t = v.value().toTensor();
      SHARDOPT_CHECK(t.sizes() == params_[i].sizes(), "load_state_dict: state '", v.key().toStringRef(),
                  "' of parameter ", i, " has shape ", t.sizes(), " but the parameter has shape ", params_[i].sizes());
    }
    entries.emplace(i, values);
  }

  for (size_t g = 0; g < saved_groups.size(); ++g) {
    param_groups_[g].set_options(codec.decode_options(saved_groups[g].toGenericDict(), param_groups_[g].options()));
  }
  sync_options_to_local();
  auto& local_state = local_->state();
  for (size_t i : partition_.shard(group_->rank())) {
    const auto key = compat::state_key(params_[i]);
    auto it = entries.find(i);
    if (it == entries.end()) {
      // Adagrad creates its state at construction and expects it to stay.
      if (codec.name != "Adagrad") local_state.erase(key);
      continue;
    }
    local_state[key] = decode_placed(codec.encode_state(*codec.decode_state(it->second)), i);
  }
}

void OSS::save(torch::serialize::OutputArchive& archive) const {
  archive.write("shardopt_oss_state_dict", state_dict());
}

void OSS::load(torch::serialize::InputArchive& archive) {
  torch::IValue value;
  SHARDOPT_CHECK(archive.try_read("shardopt_oss_state_dict", value),
              "OSS::load: the archive holds no OSS state (written by OSS::save?)");
  load_state_dict(value);
}

}  // namespace shardopt
