#include "optim/state_migration.h"

#include <shardopt/check.h>
#include <shardopt/compat.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <map>

namespace shardopt::detail {

namespace {

// One range of one parameter on its way to a new holding.
struct Slice {
  int64_t begin = 0, end = 0;  // parameter frame
  std::optional<GenericDict> state;
  at::Tensor grad;
  at::Tensor values;  // the holding tensor's own values (mixed precision's master weights)
};

GenericDict encode_slice(size_t param, const Slice& slice) {
  GenericDict d = make_string_dict();
  d.insert("param", static_cast<int64_t>(param));
  d.insert("begin", slice.begin);
  d.insert("end", slice.end);
  if (slice.state) d.insert("state", *slice.state);
  if (slice.grad.defined()) d.insert("grad", slice.grad);
  if (slice.values.defined()) d.insert("values", slice.values);
  return d;
}

// Elements [begin, end) (parameter frame) of old holding `o` of parameter `param` on this rank: its
// state, gradient and, with `carry_values`, its own values.
Slice cut_slice(const OptimizerCodec& codec, const torch::optim::Optimizer& local, const HoldingGrads& grads,
                size_t param, const Holding& o, int64_t begin, int64_t end, bool carry_values) {
  Slice slice{begin, end, std::nullopt, at::Tensor(), at::Tensor()};
  const int64_t from = begin - o.in_param.begin;
  auto it = local.state().find(compat::state_key(o.tensor));
  if (it != local.state().end()) slice.state = slice_state(codec.encode_state(*it->second), from, from + end - begin);
  if (const at::Tensor g = grads.get(param, o); g.defined()) slice.grad = g.reshape(-1).narrow(0, from, end - begin).clone();
  if (carry_values) slice.values = o.tensor.detach().reshape(-1).narrow(0, from, end - begin).clone();
  return slice;
}

// Bytes of state (and values) a slice carries.
int64_t slice_bytes(const Slice& slice) {
  return (slice.state ? state_tensor_bytes(*slice.state) : 0) +
         (slice.values.defined() ? static_cast<int64_t>(slice.values.nbytes()) : 0);
}

// A slice another rank sent (encode_slice), with its parameter.
std::pair<size_t, Slice> decode_slice(const c10::IValue& item) {
  const auto d = item.toGenericDict();
  Slice slice{d.at("begin").toInt(), d.at("end").toInt(), std::nullopt, at::Tensor(), at::Tensor()};
  if (d.contains("state")) slice.state = d.at("state").toGenericDict();
  if (d.contains("grad")) slice.grad = d.at("grad").toTensor();
  if (d.contains("values")) slice.values = d.at("values").toTensor();
  return {static_cast<size_t>(d.at("param").toInt()), std::move(slice)};
}

// incoming[(param, holding index)] -> the slices of that holding of this rank.
using Incoming = std::map<std::pair<size_t, size_t>, std::vector<Slice>>;

// Sends rank d outgoing[d] where moving[this rank][d], and files each slice this rank receives
// under every holding of its own in `to` that the slice lies in: one pair of ranks at a time, in
// the same order everywhere, so that no two transfers wait on each other.
void exchange(ProcessGroup& group, const std::vector<std::vector<uint8_t>>& moving,
              const std::vector<c10::impl::GenericList>& outgoing, const std::vector<std::vector<Holding>>& to,
              Incoming& incoming, RebalanceStats& stats) {
  const int rank = group.rank(), world = group.size();
  for (int s = 0; s < world; ++s) {
    for (int d = 0; d < world; ++d) {
      if (!moving[s][d]) continue;
      if (rank == s) group.send_bytes(torch::pickle_save(outgoing[d]), d, s);
      if (rank != d) continue;
      const c10::IValue received = torch::pickle_load(group.recv_bytes(s, s));
      for (const auto& item : received.toListRef()) {
        auto [i, slice] = decode_slice(item);
        stats.state_bytes_received += slice_bytes(slice);
        for (size_t k = 0; k < to[i].size(); ++k) {
          const Holding& h = to[i][k];
          if (h.rank == rank && h.in_param.begin <= slice.begin && slice.end <= h.in_param.end) {
            incoming[{i, k}].push_back(slice);
          }
        }
      }
    }
  }
}

// Stitches the slices of one new holding (sorted, covering it) and installs state and gradient.
void install(const OptimizerCodec& codec, torch::optim::Optimizer& local, size_t param, const Holding& h,
             const HoldingGrads& grads, std::vector<Slice> slices) {
  std::sort(slices.begin(), slices.end(), [](const Slice& a, const Slice& b) { return a.begin < b.begin; });
  int64_t at = h.in_param.begin;
  bool all_state = true, all_grad = true, all_values = true;
  for (const auto& s : slices) {
    TORCH_INTERNAL_ASSERT(s.begin == at, "state slices of a holding leave a gap at element ", at);
    at = s.end;
    all_state &= s.state.has_value();
    all_grad &= s.grad.defined();
    all_values &= s.values.defined();
  }
  TORCH_INTERNAL_ASSERT(at == h.in_param.end, "state slices end at ", at, ", the holding at ", h.in_param.end);
  if (all_state && !slices.empty()) {
    GenericDict merged = make_string_dict();
    for (const auto& v : *slices.front().state) {
      if (!is_state_tensor(v)) {
        merged.insert(v.key(), v.value());
        continue;
      }
      std::vector<at::Tensor> parts;
      for (const auto& s : slices) parts.push_back(s.state->at(v.key()).toTensor().reshape(-1));
      merged.insert(v.key(), at::cat(parts).reshape(h.tensor.sizes()));
    }
    local.state()[compat::state_key(h.tensor)] = decode_state_like(codec, merged, h.tensor);
  }
  if (all_values && !slices.empty()) {
    std::vector<at::Tensor> parts;
    for (const auto& s : slices) parts.push_back(s.values.reshape(-1));
    h.tensor.view(-1).copy_(at::cat(parts));
  }
  if (all_grad && !slices.empty() && !grads.get(param, h).defined()) {
    std::vector<at::Tensor> parts;
    for (const auto& s : slices) parts.push_back(s.grad.reshape(-1));
    // A fresh tensor, not a view of the concatenation: zero_grad(false) detaches it in place.
    const auto options = slices.front().grad.options().device(h.tensor.device()).requires_grad(false);
    grads.set(param, h, at::cat(parts).to(options).reshape(h.tensor.sizes()).clone());
  }
}

}  // namespace

std::unique_ptr<torch::optim::OptimizerParamState> decode_state_like(const OptimizerCodec& codec,
                                                                     const GenericDict& encoded,
                                                                     const at::Tensor& like) {
  const auto options = like.options().requires_grad(false);
  GenericDict placed = make_string_dict();
  for (const auto& v : encoded) {
    if (is_state_tensor(v)) {
      const at::Tensor t = v.value().toTensor().to(options);
      placed.insert(v.key(), t.numel() == like.numel() ? t.reshape(like.sizes()) : t);
    } else {
      placed.insert(v.key(), v.value());
    }
  }
  return codec.decode_state(placed);
}

GenericDict slice_state(const GenericDict& encoded, int64_t begin, int64_t end) {
  GenericDict out = make_string_dict();
  for (const auto& v : encoded) {
    if (is_state_tensor(v)) {
      out.insert(v.key(), v.value().toTensor().reshape(-1).narrow(0, begin, end - begin).clone());
    } else {
      out.insert(v.key(), v.value());
    }
  }
  return out;
}

bool same_holdings(const std::vector<Holding>& a, const std::vector<Holding>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].rank != b[k].rank || a[k].in_param != b[k].in_param) return false;
  }
  return true;
}

void migrate_holdings(ProcessGroup& group, torch::optim::Optimizer& local, const std::vector<std::vector<Holding>>& from,
                      const std::vector<std::vector<Holding>>& to, const HoldingGrads& grads, RebalanceStats& stats,
                      bool carry_values) {
  TORCH_INTERNAL_ASSERT(from.size() == to.size(), "holdings of ", from.size(), " and ", to.size(), " parameters");
  const int rank = group.rank(), world = group.size();
  std::vector<size_t> changed;
  for (size_t i = 0; i < from.size(); ++i) {
    if (!same_holdings(from[i], to[i])) changed.push_back(i);
  }
  if (changed.empty()) return;
  const auto& codec = codec_for(local);
  at::NoGradGuard no_grad;
  // moving[s][d]: does any range go from rank s to another rank d?
  std::vector<std::vector<uint8_t>> moving(world, std::vector<uint8_t>(world, 0));
  // One list per destination (a GenericList is a shared handle: copies would alias one list).
  std::vector<c10::impl::GenericList> outgoing;
  for (int d = 0; d < world; ++d) outgoing.emplace_back(c10::AnyType::get());
  Incoming incoming;
  for (size_t i : changed) {
    ++stats.params_moved;
    for (size_t k = 0; k < to[i].size(); ++k) {
      const Holding& h = to[i][k];
      for (const Holding& o : from[i]) {
        const int64_t begin = std::max(h.in_param.begin, o.in_param.begin);
        const int64_t end = std::min(h.in_param.end, o.in_param.end);
        if (begin >= end && !(h.in_param.size() == 0 && o.in_param.size() == 0)) continue;
        if (o.rank != h.rank) moving[o.rank][h.rank] = 1;
        if (o.rank != rank) continue;
        Slice slice = cut_slice(codec, local, grads, i, o, begin, end, carry_values);
        if (h.rank == rank) {
          incoming[{i, k}].push_back(std::move(slice));
          continue;
        }
        stats.state_bytes_sent += slice_bytes(slice);
        outgoing[h.rank].push_back(encode_slice(i, slice));
      }
    }
    // The old holdings' state is now in the slices.
    for (const Holding& o : from[i]) {
      if (o.rank == rank) local.state().erase(compat::state_key(o.tensor));
    }
  }
  exchange(group, moving, outgoing, to, incoming, stats);
  for (auto& [where, slices] : incoming) {
    install(codec, local, where.first, to[where.first][where.second], grads, std::move(slices));
  }
}

}  // namespace shardopt::detail
