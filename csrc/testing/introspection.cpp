#include <shardopt/testing/introspection.h>

#include "comm/failure_watch.h"
#include "comm/wire_codec.h"
#include "ddp/grad_slabs.h"
#include "optim/fused_kernels.h"
#include "optim/shard_store.h"

#include <shardopt/check.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>

namespace shardopt::testing {

void Introspection::feed_back(Wire wire, at::Tensor x, at::Tensor residual) {
  SHARDOPT_CHECK(wire != Wire::kExact, "feed_back: the exact wire drops nothing");
  detail::WireCodec(wire == Wire::kInt8 ? at::kChar : at::kBFloat16).feed_back(std::move(x), std::move(residual));
}

std::vector<Introspection::Holding> Introspection::holdings(const OSS& oss, size_t param) {
  std::vector<Holding> out;
  for (const auto& h : oss.holdings_.at(param)) out.push_back({h.rank, h.in_param, h.tensor});
  return out;
}

at::Tensor Introspection::state_holders(const OSS& oss, size_t param) {
  at::Tensor who = at::full({oss.all_params().at(param).numel()}, -1, at::kInt);
  for (const auto& h : holdings(oss, param)) who.narrow(0, h.in_param.begin, h.in_param.size()).fill_(h.rank);
  return who;
}

std::vector<at::Tensor> Introspection::state_holders(const OSS& oss) {
  std::vector<at::Tensor> who;
  for (size_t i = 0; i < oss.all_params().size(); ++i) who.push_back(state_holders(oss, i));
  return who;
}

int64_t Introspection::holders_changed(const std::vector<at::Tensor>& before, const std::vector<at::Tensor>& after) {
  SHARDOPT_CHECK(before.size() == after.size(), "holders_changed: " + std::to_string(before.size()) +
                 " parameters before, " + std::to_string(after.size()) + " after");
  int64_t changed = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    SHARDOPT_CHECK(before[i].numel() == after[i].numel(), "holders_changed: parameter " + std::to_string(i) +
                   " has " + std::to_string(before[i].numel()) + " elements before, " +
                   std::to_string(after[i].numel()) + " after");
    const at::Tensor b = before[i].contiguous(), a = after[i].contiguous();
    const int* was = b.data_ptr<int>();
    const int* is = a.data_ptr<int>();
    for (int64_t e = 0; e < b.numel(); ++e) changed += was[e] >= 0 && is[e] >= 0 && was[e] != is[e];
  }
  return changed;
}

std::optional<Introspection::StateSlot> Introspection::state_slot(const OSS& oss, const at::Tensor& stepped) {
  const detail::Slot* slot = oss.slabs_->slot_of(stepped);
  if (!slot) return std::nullopt;
  return StateSlot{slot->group, slot->offset, slot->numel, slot->kept};
}

at::Tensor Introspection::state_slab(const OSS& oss, size_t group, const std::string& kind) {
  return oss.slabs_->slab(group, kind);
}

const Partition& Introspection::partition(const OSS& oss) { return oss.store_->partition(); }

void Introspection::sync_params(OSS& oss) { oss.store_->sync_params(); }

int64_t Introspection::slab_bytes(const OSS& oss) { return oss.slabs_->bytes(); }

at::Tensor Introspection::grad_slab(const ShardedDDP& ddp, size_t optimizer, size_t group) {
  return ddp.grad_slabs_.at(optimizer)->slab(group);
}

int64_t Introspection::layout_version(const OSS& oss) { return oss.store_->plan_version(); }

bool Introspection::param_sync_in_flight(const OSS& oss) { return oss.store_->param_sync_in_flight(); }

int Introspection::cpu_kernel_level() {
  return detail::cpu_kernel_level();
}

void Introspection::cap_cpu_kernels(int level) {
  detail::cap_cpu_kernels(level);
}

bool Introspection::wait_watched(PendingWork& work, std::string& error) {
  auto watch = std::make_shared<detail::GroupFailure>();
  watch->watching = true;
  work.set_failure_watch(watch);
  error.clear();
  try {
    work.wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  return watch->broken;
}

}  // namespace shardopt::testing
