// OSS's state dict: consolidation on one rank, PyTorch's layout, loading on any world size.
#include <shardopt/optim/oss.h>
#include <shardopt/check.h>
#include <shardopt/comm/agree.h>

#include "optim/codec.h"
#include "optim/master_weights.h"
#include "optim/shard_store.h"
#include "optim/state_codes.h"
#include "optim/state_migration.h"
#include "optim/state_slabs.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/api/include/torch/serialize/archive.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <map>
#include <unordered_map>

namespace shardopt {

namespace optim = torch::optim;
using detail::GenericDict;

namespace {

// This rank's ranges with state or a master weight: [{"param", "begin", "end", "state"?,
// "master"?}, ...] (masters with `masters`: the holdings' tensors are mixed precision's).
// `local_of(i)` is the optimizer of parameter i. 8-bit state (`slabs`) leaves decoded to fp32 for
// consolidation, as codes and scales in a shard (`coded`).
c10::impl::GenericList own_shard(const std::vector<std::vector<detail::Holding>>& holdings,
                                 const std::function<optim::Optimizer&(size_t)>& local_of, int rank, bool masters,
                                 const detail::StateSlabs& slabs, bool coded, bool own_storage = true) {
  c10::impl::GenericList shard(c10::AnyType::get());
  for (size_t i = 0; i < holdings.size(); ++i) {
    optim::Optimizer& local = local_of(i);
    for (const auto& h : holdings[i]) {
      if (h.rank != rank) continue;
      auto it = local.state().find(compat::state_key(h.tensor));
      const bool has_state = it != local.state().end();
      if (!has_state && !masters) continue;
      GenericDict d = detail::make_string_dict();
      d.insert("param", static_cast<int64_t>(i));
      d.insert("begin", h.in_param.begin);
      d.insert("end", h.in_param.end);
      if (has_state) {
        const GenericDict encoded = detail::codec_for(local).encode_state(*it->second);
        GenericDict state = coded ? slabs.with_scales(encoded) : slabs.widened(encoded);
        d.insert("state", own_storage ? detail::with_own_storage(state) : state);
      }
      if (masters) d.insert("master", h.tensor.detach().reshape(-1));
      shard.push_back(d);
    }
  }
  return shard;
}

// Whole-parameter state stitched from ranges as they arrive, without holding more than the full
// state and the shard being added. With `widen`, bf16 state tensors become fp32 (Note [State
// formats]).
class Stitcher {
 public:
  Stitcher(const std::vector<at::Tensor>& params, bool widen) : params_(params), widen_(widen) {}

  void add(const c10::impl::GenericList& shard) {
    for (const c10::IValue& item : shard.vec()) {
      const auto d = item.toGenericDict();
      const auto i = static_cast<size_t>(d.at("param").toInt());
      const int64_t begin = d.at("begin").toInt(), end = d.at("end").toInt();
      if (d.contains("master")) {
        auto [m, fresh] = masters_.try_emplace(i, at::Tensor(), 0);
        if (fresh) m->second.first = at::empty({params_[i].numel()}, d.at("master").toTensor().options());
        m->second.first.narrow(0, begin, end - begin).copy_(d.at("master").toTensor().reshape(-1));
        m->second.second += end - begin;
      }
      if (!d.contains("state")) continue;
      auto [it, fresh] = parts_.try_emplace(i, detail::make_string_dict(), 0);
      auto& [full, filled] = it->second;
      const bool all = begin == 0 && end == params_[i].numel();
      // 8-bit state in a shard: its codes decoded with its scales (Note [8-bit state slabs]).
      const GenericDict state = detail::decoded_state(
          d.at("state").toGenericDict(), "the optimizer state of parameter " + std::to_string(i) + ", elements [" +
                                             std::to_string(begin) + ", " + std::to_string(end) + ")");
      for (const auto& v : state) {
        if (!detail::is_state_tensor(v) || (all && fresh)) {  // a whole range: as it is, whatever its shape
          if (fresh) full.insert(v.key(), detail::is_state_tensor(v) ? c10::IValue(widened(v.value().toTensor())) : v.value());
          continue;
        }
        const at::Tensor t = widened(v.value().toTensor().reshape(-1));
        if (fresh) full.insert(v.key(), at::empty({params_[i].numel()}, t.options()));
        full.at(v.key()).toTensor().narrow(0, begin, end - begin).copy_(t);
      }
      filled += end - begin;
    }
  }

  // {index: state} with every tensor in its parameter's shape.
  GenericDict finish() const {
    GenericDict state(c10::IntType::get(), c10::AnyType::get());
    for (const auto& [i, entry] : parts_) {
      const auto& [full, filled] = entry;
      SHARDOPT_CHECK(filled == params_[i].numel(), "the state of parameter ", i, " covers ", filled, " of ",
                     params_[i].numel(), " elements (a shard missing or given twice?)");
      GenericDict shaped = detail::make_string_dict();
      for (const auto& v : full) {
        const bool like_param = detail::is_state_tensor(v) && v.value().toTensor().numel() == params_[i].numel();
        shaped.insert(v.key(), like_param ? c10::IValue(v.value().toTensor().view(params_[i].sizes())) : v.value());
      }
      state.insert(static_cast<int64_t>(i), shaped);
    }
    return state;
  }

  // {index: fp32 master weight} in the parameters' shapes; empty without mixed precision.
  GenericDict finish_masters() const {
    GenericDict out(c10::IntType::get(), c10::AnyType::get());
    for (const auto& [i, entry] : masters_) {
      SHARDOPT_CHECK(entry.second == params_[i].numel(), "the master weight of parameter ", i, " covers ",
                     entry.second, " of ", params_[i].numel(), " elements (a shard missing or given twice?)");
      out.insert(static_cast<int64_t>(i), entry.first.view(params_[i].sizes()));
    }
    return out;
  }

  // The full state dict: {"state", "param_groups", and "master_weights" when there are masters}.
  GenericDict result(const c10::IValue& param_groups) const {
    GenericDict d = detail::make_string_dict();
    d.insert("state", finish());
    d.insert("param_groups", param_groups);
    GenericDict masters = finish_masters();
    if (!masters.empty()) d.insert("master_weights", masters);
    return d;
  }

 private:
  at::Tensor widened(const at::Tensor& t) const {
    return widen_ && t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
  }

  const std::vector<at::Tensor>& params_;
  const bool widen_;
  std::map<size_t, std::pair<GenericDict, int64_t>> parts_;  // param -> (state, elements filled)
  std::map<size_t, std::pair<at::Tensor, int64_t>> masters_;  // param -> (master, elements filled)
};

}  // namespace

// ---- state dict -----------------------------------------------------------------------------

void OSS::consolidate_state_dict(int recipient) {
  CommPhase phase("consolidating the optimizer state");
  Agreement().field("the recipient of consolidate_state_dict", recipient).check(*group_);
  SHARDOPT_CHECK(recipient >= 0 && recipient < group_->size(), "consolidate_state_dict recipient ",
              recipient, " is outside [0, ", group_->size(), ")");
  const auto local_of = [this](size_t i) -> optim::Optimizer& { return *unit_of(i).local; };
  for (const auto& unit : units_) detail::codec_for(*unit.local);  // every rank stops here alike
  const int rank = group_->rank();
  consolidated_.reset();
  last_recipient_ = recipient;

  settle_state();  // every rank's state where the current layout puts it

  // One shard in flight at a time: the recipient holds the full state plus at most one
  // serialized shard.
  Stitcher stitcher(params_, options_.state_format() != StateFormat::kFloat32);
  for (int r = 0; r < group_->size(); ++r) {
    if (r == recipient) {
      if (rank == recipient) stitcher.add(own_shard(holdings_, local_of, rank, masters_, *slabs_, /*coded=*/false));
      continue;
    }
    if (rank == r) {
      group_->send_bytes(torch::pickle_save(own_shard(holdings_, local_of, rank, masters_, *slabs_, /*coded=*/false)), recipient, r);
    } else if (rank == recipient) {
      stitcher.add(torch::pickle_load(group_->recv_bytes(r, r)).toList());
    }
  }
  if (rank != recipient) return;
  consolidated_ = stitcher.result(param_groups_value());
}

// The param groups in PyTorch's layout: options and parameter indices.
c10::impl::GenericList OSS::param_groups_value() const {
  c10::impl::GenericList groups(c10::AnyType::get());
  size_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& codec = detail::codec_for(*units_[unit_of_group_[g]].local);
    GenericDict d = codec.encode_options(param_groups_[g].options());
    // A generic list: Python's safe loader accepts it without extra allow-listed globals.
    c10::impl::GenericList ids(c10::AnyType::get());
    for (size_t k = 0; k < group_sizes_[g]; ++k) ids.push_back(static_cast<int64_t>(index++));
    d.insert("params", ids);
    groups.push_back(d);
  }
  return groups;
}

torch::IValue OSS::state_shard(bool own_storage) {
  SHARDOPT_CHECK(!holdings_.empty() || params_.empty(), "OSS::state_shard before the first layout");
  for (const auto& unit : units_) detail::codec_for(*unit.local);
  settle_state();
  GenericDict d = detail::make_string_dict();
  d.insert("shard", own_shard(holdings_, [this](size_t i) -> optim::Optimizer& { return *unit_of(i).local; },
                              group_->rank(), masters_, *slabs_, /*coded=*/true, own_storage));
  d.insert("param_groups", param_groups_value());
  d.insert("rank", static_cast<int64_t>(group_->rank()));
  d.insert("world_size", static_cast<int64_t>(group_->size()));
  return d;
}

torch::IValue OSS::state_dict_from_shards(const std::vector<torch::IValue>& shards) const {
  SHARDOPT_CHECK(!shards.empty(), "state_dict_from_shards needs at least one shard");
  Stitcher stitcher(params_, options_.state_format() != StateFormat::kFloat32);
  for (size_t r = 0; r < shards.size(); ++r) {
    SHARDOPT_CHECK(shards[r].isGenericDict() && shards[r].toGenericDict().contains("shard"),
                   "state_dict_from_shards: shard ", r, " is not a state_shard() value");
    stitcher.add(shards[r].toGenericDict().at("shard").toList());
  }
  return stitcher.result(shards[0].toGenericDict().at("param_groups"));
}

torch::IValue OSS::state_dict() const {
  SHARDOPT_CHECK(consolidated_.has_value(), "OSS::state_dict() on rank ", group_->rank(),
              ": there is no consolidated state here; call consolidate_state_dict(recipient) on every rank first, "
              "then state_dict() on the recipient",
              (last_recipient_ >= 0 ? " (the last recipient was rank " + std::to_string(last_recipient_) + ")"
                                    : std::string()));
  return *consolidated_;
}

std::unordered_map<size_t, GenericDict> OSS::saved_entries(const GenericDict& dict) const {
  const auto saved_groups = dict.at("param_groups").toListRef();
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
  std::unordered_map<size_t, GenericDict> entries;
  for (const auto& entry : dict.at("state").toGenericDict()) {
    const int64_t id = entry.key().toInt();
    auto it = id_to_param.find(id);
    SHARDOPT_CHECK(it != id_to_param.end(), "load_state_dict: state entry ", id,
                " belongs to no parameter of any group");
    const size_t i = it->second;
    const auto values = entry.value().toGenericDict();
    const auto& codec = detail::codec_for(*unit_of(i).local);
    // State saved by another class (SGD's into Adam) would be dropped without a word.
    const auto foreign = detail::entries_not_kept(codec, values);
    if (!foreign.empty()) {
      const std::string keepers = detail::optimizers_keeping(foreign[0]);
      SHARDOPT_CHECK(false, "load_state_dict: the state of parameter ", i, " holds '", foreign[0], "', which ",
                     codec.name, " does not keep: it was saved by another optimizer",
                     keepers.empty() ? std::string() : " (" + keepers + " keeps '" + foreign[0] + "')",
                     "; load it into the optimizer that saved it");
    }
    for (const auto& v : values) {
      if (!detail::is_state_tensor(v)) continue;
      const auto& t = v.value().toTensor();
      const auto expected = codec.entry_shape(v.key().toStringRef(), params_[i].sizes());
      SHARDOPT_CHECK(t.sizes() == at::IntArrayRef(expected), "load_state_dict: state '", v.key().toStringRef(),
                     "' of parameter ", i, " has shape ", t.sizes(), " but ", codec.name, " keeps it in shape ",
                     at::IntArrayRef(expected), " for a parameter of shape ", params_[i].sizes());
    }
    entries.emplace(i, values);
  }
  return entries;
}

void OSS::load_state_dict(const torch::IValue& sd) {
  SHARDOPT_CHECK(sd.isGenericDict(), "load_state_dict expects a dict, got ", sd.tagKind());
  const auto dict = sd.toGenericDict();
  SHARDOPT_CHECK(dict.contains("state") && dict.contains("param_groups"),
              "load_state_dict expects the keys \"state\" and \"param_groups\"");
  const auto saved_groups = dict.at("param_groups").toListRef();
  SHARDOPT_CHECK(saved_groups.size() == param_groups_.size(), "load_state_dict: the state has ",
              saved_groups.size(), " param groups, this optimizer has ", param_groups_.size());
  const auto entries = saved_entries(dict);
  // A parameter with saved state has state from now on; a frozen one's is kept, spread over the
  // ranks (Note [Kept state]).
  bool kept_changed = false;
  for (const auto& entry : entries) {
    kept_changed |= !store_->stepped()[entry.first] && !store_->trainable()[entry.first];
    store_->stepped()[entry.first] = 1;
  }
  if (kept_changed && placement_.split) lay_out(store_->make_plan(store_->trainable(), store_->partition()));
  for (size_t g = 0; g < saved_groups.size(); ++g) {
    const auto& codec = detail::codec_for(*units_[unit_of_group_[g]].local);
    param_groups_[g].set_options(codec.decode_options(saved_groups[g].toGenericDict(), param_groups_[g].options()));
  }
  sync_options_to_local();
  // The loaded state replaces whatever was owed to the current holdings.
  const int rank = group_->rank();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& local_state = unit_of(i).local->state();
    for (const auto& old : settled_[i]) {
      bool kept = false;
      for (const auto& h : holdings_[i]) kept |= h.tensor.defined() && h.tensor.is_same(old.tensor);
      if (old.rank == rank && !kept) local_state.erase(compat::state_key(old.tensor));
    }
  }
  settled_ = holdings_;
  settled_version_ = store_->plan_version();
  set_local_groups();
  if (masters_) load_masters(dict);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& local_state = unit_of(i).local->state();
    const auto& codec = detail::codec_for(*unit_of(i).local);
    for (const auto& h : holdings_[i]) {
      if (h.rank != rank) continue;
      const auto key = compat::state_key(h.tensor);
      auto it = entries.find(i);
      if (it == entries.end()) {
        // Adagrad creates its state at construction and expects it to stay.
        if (codec.name != "Adagrad") local_state.erase(key);
        continue;
      }
      // This holding's range of the saved state, as views of it, copied once, in the holding's
      // dtype and on its device (the saved state is not decoded whole first).
      local_state[key] = detail::decode_state_like(
          codec, detail::slice_state(it->second, h.in_param.begin, h.in_param.end, params_[i].numel(), /*copy=*/false),
          h.tensor);
    }
  }
  place_state();
}

RebalanceStats OSS::load_state_shards(const std::vector<torch::IValue>& held, const torch::IValue& param_groups) {
  CommPhase phase("loading the copied optimizer state");
  finish_param_sync();
  // Every member's ranges, as five numbers each: param, begin, end, has state, has a master.
  std::vector<int64_t> words;
  std::vector<GenericDict> mine;
  for (const auto& shard : held) {
    SHARDOPT_CHECK(shard.isGenericDict() && shard.toGenericDict().contains("shard"),
                   "load_state_shards: a shard is not a state_shard() value");
    for (const c10::IValue& item : shard.toGenericDict().at("shard").toListRef()) {
      GenericDict d = item.toGenericDict();
      if (d.contains("state")) {  // 8-bit state decoded; adopt() codes it again, to the same codes
        d = d.copy();
        d.insert_or_assign("state", detail::decoded_state(d.at("state").toGenericDict(),
                                                          "a copied shard's state of parameter " +
                                                              std::to_string(d.at("param").toInt())));
      }
      words.insert(words.end(), {d.at("param").toInt(), d.at("begin").toInt(), d.at("end").toInt(),
                                 d.contains("state") ? 1 : 0, d.contains("master") ? 1 : 0});
      mine.push_back(std::move(d));
    }
  }
  const auto all = global_group_->allgather_ints(words);
  std::vector<detail::ShardRange> ranges;
  for (int m = 0; m < global_group_->size(); ++m) {
    const auto& w = all[static_cast<size_t>(m)];
    for (size_t k = 0; k + 4 < w.size(); k += 5) {
      ranges.push_back({m, static_cast<size_t>(w[k]), w[k + 1], w[k + 2], w[k + 3] != 0, w[k + 4] != 0});
    }
  }
  // The state (and the masters) of a parameter must come whole, each element once: every rank
  // reads the same table, so a shard missing or given twice is an error on every rank.
  for (const bool master : {false, true}) {
    std::map<size_t, std::vector<std::pair<int64_t, int64_t>>> cover;
    for (const auto& r : ranges) {
      if (master ? r.master : r.state) cover[r.param].emplace_back(r.begin, r.end);
    }
    for (auto& [i, list] : cover) {
      std::sort(list.begin(), list.end());
      int64_t at = 0;
      for (const auto& [begin, end] : list) {
        SHARDOPT_CHECK(begin == at || (begin == end && end <= at), "load_state_shards: the old shards' ",
                       master ? "master weight" : "state", " of parameter ", i, " covers elements [0, ", at, ") of ",
                       params_[i].numel(), ", then starts again at ", begin, " (a shard missing or given twice?)");
        at = std::max(at, end);
      }
      SHARDOPT_CHECK(at == params_[i].numel(), "load_state_shards: the old shards' ", master ? "master weight" : "state",
                     " of parameter ", i, " covers elements [0, ", at, ") of ", params_[i].numel(),
                     " (a shard missing or given twice?)");
    }
  }
  // A parameter with saved state has state from now on; a frozen one's is kept, spread over the
  // ranks (Note [Kept state]). Every rank reads the same table, so all lay out alike.
  bool kept_changed = false;
  for (const auto& r : ranges) {
    SHARDOPT_CHECK(r.param < params_.size() && r.begin >= 0 && r.begin <= r.end && r.end <= params_[r.param].numel(),
                   "load_state_shards: an old shard names elements [", r.begin, ", ", r.end, ") of parameter ", r.param,
                   ", but the optimizer has ", params_.size(), " parameters",
                   r.param < params_.size() ? ", that one of " + std::to_string(params_[r.param].numel()) + " elements"
                                            : std::string());
    if (!r.state) continue;
    kept_changed |= !store_->stepped()[r.param] && !store_->trainable()[r.param];
    store_->stepped()[r.param] = 1;
  }
  if (kept_changed && placement_.split) lay_out(store_->make_plan(store_->trainable(), store_->partition()));
  const auto saved_groups = param_groups.toListRef();
  SHARDOPT_CHECK(saved_groups.size() == param_groups_.size(), "load_state_shards: the shards have ",
                 saved_groups.size(), " param groups, this optimizer has ", param_groups_.size());
  for (size_t g = 0; g < saved_groups.size(); ++g) {
    const auto& codec = detail::codec_for(*units_[unit_of_group_[g]].local);
    param_groups_[g].set_options(codec.decode_options(saved_groups[g].toGenericDict(), param_groups_[g].options()));
  }
  sync_options_to_local();
  settle_state();
  const int block = group_->size();
  const bool blocks = replica_group_ != nullptr;
  RebalanceStats stats;
  detail::scatter_shard_ranges(
      *global_group_, [&](int member) { return blocks ? member % block : member; },
      [this](size_t i) -> optim::Optimizer& { return *unit_of(i).local; }, ranges, mine, holdings_, stats, masters_);
  place_state();
  return stats;
}

// The masters of this rank's ranges from the state's "master_weights" (by parameter position),
// or from the parameters where it has none (a state saved without mixed precision).
void OSS::load_masters(const GenericDict& dict) {
  finish_param_sync();  // the parameters are read below
  const bool saved_any = dict.contains("master_weights");
  const GenericDict masters =
      saved_any ? dict.at("master_weights").toGenericDict() : GenericDict(c10::IntType::get(), c10::AnyType::get());
  for (size_t i = 0; i < params_.size(); ++i) {
    const c10::IValue key(static_cast<int64_t>(i));
    at::Tensor source = params_[i];
    if (saved_any && masters.contains(key)) {
      source = masters.at(key).toTensor();
      SHARDOPT_CHECK(source.sizes() == params_[i].sizes(), "load_state_dict: the master weight of parameter ", i,
                     " has shape ", source.sizes(), " but the parameter has shape ", params_[i].sizes());
    }
    for (const auto& h : holdings_[i]) {
      if (h.rank == group_->rank()) detail::set_master(h.tensor, source, h.in_param);
    }
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
