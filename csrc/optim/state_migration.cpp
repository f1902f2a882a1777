#include "optim/state_migration.h"

#include <shardopt/compat.h>
#include <shardopt/optim/oss.h>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace shardopt::detail {

std::unique_ptr<torch::optim::OptimizerParamState> decode_state_like(const OptimizerCodec& codec,
                                                                     const GenericDict& encoded,
                                                                     const at::Tensor& param) {
  const auto like = param.options().requires_grad(false);
  GenericDict placed = make_string_dict();
  for (const auto& v : encoded) {
    if (v.value().isTensor() && v.key().toStringRef() != "step") {
      placed.insert(v.key(), v.value().toTensor().to(like));
    } else {
      placed.insert(v.key(), v.value());
    }
  }
  return codec.decode_state(placed);
}

void migrate_state(ProcessGroup& group, torch::optim::Optimizer& local, std::vector<at::Tensor>& params,
                   const Partition& from, const Partition& to, RebalanceStats& stats) {
  const int rank = group.rank(), world = group.size();
  const auto& codec = codec_for(local);
  auto& state = local.state();
  // moving[s][d]: does any parameter go from rank s to rank d?
  std::vector<std::vector<uint8_t>> moving(world, std::vector<uint8_t>(world, 0));
  std::vector<GenericDict> outgoing;
  for (int d = 0; d < world; ++d) outgoing.emplace_back(c10::IntType::get(), c10::AnyType::get());
  for (size_t i = 0; i < params.size(); ++i) {
    const int s = from.owner(i), d = to.owner(i);
    if (s == d) continue;
    moving[s][d] = 1;
    ++stats.params_moved;
    if (s != rank) continue;
    GenericDict entry = make_string_dict();
    auto it = state.find(compat::state_key(params[i]));
    if (it != state.end()) {  // no state yet (never stepped): nothing to move
      GenericDict encoded = codec.encode_state(*it->second);
      stats.state_bytes_sent += state_tensor_bytes(encoded);
      entry.insert("state", encoded);
      state.erase(it);
    }
    // A gradient only the old owner holds (ShardedDDP reduced it there) goes along, so a step
    // right after the re-partition still sees it. clone(): a view would carry its whole base.
    if (params[i].grad().defined()) entry.insert("grad", params[i].grad().detach().clone());
    if (!entry.empty()) outgoing[d].insert(static_cast<int64_t>(i), entry);
  }
  // One pair of ranks at a time, in the same order everywhere: no two transfers wait on each other.
  for (int s = 0; s < world; ++s) {
    for (int d = 0; d < world; ++d) {
      if (!moving[s][d]) continue;
      if (rank == s) group.send_bytes(torch::pickle_save(outgoing[d]), d, s);
      if (rank != d) continue;
      for (const auto& item : torch::pickle_load(group.recv_bytes(s, s)).toGenericDict()) {
        const size_t i = static_cast<size_t>(item.key().toInt());
        TORCH_INTERNAL_ASSERT(i < params.size() && to.owner(i) == rank, "rank ", s, " sent state of parameter ", i,
                              " to rank ", rank, ", which does not own it");
        const auto entry = item.value().toGenericDict();
        auto& p = params[i];
        if (entry.contains("grad") && !p.grad().defined()) {
          p.mutable_grad() = entry.at("grad").toTensor().to(p.options().requires_grad(false));
        }
        if (!entry.contains("state")) continue;
        const auto encoded = entry.at("state").toGenericDict();
        stats.state_bytes_received += state_tensor_bytes(encoded);
        state[compat::state_key(p)] = decode_state_like(codec, encoded, p);
      }
    }
  }
}

}  // namespace shardopt::detail
