#include "optim/state_slabs.h"

#include <shardopt/compat.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace shardopt::detail {

// Note [State slabs]
// A rank's optimizer state lives in flat slabs, one per (layout group, kind of state), laid out
// like the rank's shard of the group's parameter buffer: the state of a trainable piece owned here
// is at the piece's offset in the shard (FlatLayout's in_shard), so a run of adjacent pieces has
// its parameters, and each kind of its state, at the same offsets in one contiguous range each.
// After the trainable region (the shard's used elements) comes the kept region: the state of
// frozen parameters held here (Note [Kept state]), in parameter order. torch::optim keeps its own
// state objects, keyed by the tensors OSS steps; their tensors are views into the slabs, so
// state_dict(), the codecs, checkpoints and Python interop see the layout they always did.
//
// State gets into its slot in two ways: the fused step creates new state directly there
// (fresh_slot), and adopt() copies any state tensor that is elsewhere (made by the wrapped
// optimizer's own step, loaded from a state dict, or moved from another rank) into its slot and
// keeps the view. A new plan (a freeze, an unfreeze, a re-partition: Note [Shard plan]) gives new
// slots (plan_slots); state then moves into new slabs at the next adopt(), and the old slabs are freed with the last view.
// Under mixed precision the masters (the fp32 tensors the wrapped optimizer steps, which key the
// state) move into a slab of their own at the same offsets (adopt_masters), so that a run of
// pieces has its master, its state and its low-precision parameters each in one range. An
// optimizer shardopt has no codec for keeps its state, and its masters, as it makes them.

void StateSlabs::plan_slots(const FlatLayout& layout, int rank, const std::vector<std::vector<Holding>>& holdings,
                            const std::function<bool(size_t param, const at::Tensor& tensor)>& has_state) {
  const auto& groups = layout.groups();
  std::vector<int64_t> numel(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g) numel[g] = groups[g].used.at(rank);
  std::unordered_map<const void*, Slot> slots;
  for (size_t i = 0; i < holdings.size(); ++i) {
    for (const Holding& h : holdings[i]) {
      if (h.rank != rank || !h.tensor.defined()) continue;
      Slot slot;
      slot.numel = h.in_param.size();
      slot.sizes = h.tensor.sizes().vec();
      bool placed = false;
      for (size_t k : layout.pieces_of(i)) {
        const Piece& piece = layout.pieces()[k];
        slot.group = piece.group;
        if (piece.owner == rank && piece.in_param == h.in_param) {
          slot.offset = piece.in_shard.begin;
          placed = true;
        }
      }
      if (!placed) {  // kept state: a slot only for state that exists, aligned as the shard is
        if (!has_state(i, h.tensor)) continue;
        slot.kept = true;
        const int64_t align = layout.options().align();
        slot.offset = (numel[slot.group] + align - 1) / align * align;
        numel[slot.group] = slot.offset + slot.numel;
      }
      slots.emplace(h.tensor.unsafeGetTensorImpl(), std::move(slot));
    }
  }
  if (slots == slots_ && numel == slab_numel_) return;
  slots_ = std::move(slots);
  slab_numel_ = std::move(numel);
  slabs_.assign(groups.size(), {});  // the old slabs live on in the views until adopt() copies them
}

at::Tensor StateSlabs::slab_for(size_t group, const std::string& kind, const at::Tensor& like) {
  auto& slabs = slabs_.at(group);
  auto it = slabs.find(kind);
  if (it == slabs.end()) {
    // Zeros: the gaps between pieces (alignment) stay finite, whatever steps over them.
    at::Tensor slab = at::zeros({slab_numel_[group]}, like.options().dtype(stored_dtype(kind, like)).requires_grad(false));
    it = slabs.emplace(kind, std::move(slab)).first;
  }
  const at::Tensor& slab = it->second;
  if (slab.scalar_type() != stored_dtype(kind, like) || slab.device() != like.device()) return at::Tensor();
  return slab;
}

// Note [State formats]
// OSSOptions::state_format decides the dtype each kind of state is stored in on its owner.
// kFloat32 keeps torch::optim's (the stepped tensor's dtype). kBFloat16 stores fp32 state in bf16:
// the fused step (Adam, AdamW, SGD) widens each block of the state to fp32, steps it with the fp32
// step's arithmetic and rounds it back to nearest even, so the result of an element depends on
// that element alone: the same bits at every world size and partition. State made or loaded in
// fp32 (a consolidated state dict, state moved from another rank, which travels widened) is
// rounded the same way when adopt() copies it into its slab; widening is exact, so state that
// leaves and comes back keeps its bits. The consolidated state_dict() widens it to fp32, the
// layout PyTorch's optimizers load. Mixed precision's masters (kMasterSlab) stay fp32.
at::ScalarType StateSlabs::stored_dtype(const std::string& kind, const at::Tensor& like) const {
  const at::ScalarType dtype = like.scalar_type();
  if (format_ == StateFormat::kBFloat16 && kind != kMasterSlab && (dtype == at::kFloat || dtype == at::kBFloat16)) {
    return at::kBFloat16;
  }
  return dtype;
}

std::vector<at::Tensor> StateSlabs::slabs_of(const std::string& kind) const {
  std::vector<at::Tensor> out(slabs_.size());
  for (size_t g = 0; g < slabs_.size(); ++g) out[g] = slab(g, kind);
  return out;
}

at::Tensor StateSlabs::fresh_slot(const at::Tensor& tensor, const char* kind) {
  at::NoGradGuard no_grad;
  auto it = slots_.find(tensor.unsafeGetTensorImpl());
  const at::Tensor slab = it == slots_.end() ? at::Tensor() : slab_for(it->second.group, kind, tensor);
  if (!slab.defined()) {
    const at::ScalarType dtype = stored_dtype(kind, tensor);
    return dtype == tensor.scalar_type() ? at::Tensor() : at::zeros(tensor.sizes(), tensor.options().dtype(dtype));
  }
  const Slot& slot = it->second;
  return slab.narrow(0, slot.offset, slot.numel).view(slot.sizes).zero_();
}

int64_t StateSlabs::adopt(torch::optim::Optimizer& local, const OptimizerCodec& codec) {
  int64_t copied = 0;
  at::NoGradGuard no_grad;
  for (auto& [key, state] : local.state()) {
    auto it = slots_.find(key);
    if (it == slots_.end()) continue;
    const Slot& slot = it->second;
    codec.place_state(*state, [&](const char* kind, const at::Tensor& t) {
      if (t.numel() != slot.numel) return t;
      const at::Tensor slab = slab_for(slot.group, kind, t);
      if (!slab.defined()) return t;
      at::Tensor view = slab.narrow(0, slot.offset, slot.numel).view(slot.sizes);
      if (t.data_ptr() == view.data_ptr() && t.sizes() == view.sizes() && t.strides() == view.strides()) return t;
      view.copy_(t.reshape(slot.sizes));
      copied += static_cast<int64_t>(t.nbytes());
      return view;
    });
  }
  return copied;
}

int64_t StateSlabs::adopt_masters(const std::vector<std::vector<Holding>>& holdings, int rank) {
  int64_t copied = 0;
  at::NoGradGuard no_grad;
  for (const auto& list : holdings) {
    for (const Holding& h : list) {
      if (h.rank != rank || !h.tensor.defined()) continue;
      const Slot* slot = slot_of(h.tensor);
      if (!slot || slot->numel != h.tensor.numel()) continue;
      const at::Tensor slab = slab_for(slot->group, kMasterSlab, h.tensor);
      if (!slab.defined()) continue;
      at::Tensor view = slab.narrow(0, slot->offset, slot->numel).view(slot->sizes);
      if (h.tensor.data_ptr() == view.data_ptr() && h.tensor.sizes() == view.sizes()) continue;
      view.copy_(h.tensor.detach().reshape(slot->sizes));
      copied += static_cast<int64_t>(h.tensor.nbytes());
      at::Tensor master = h.tensor;  // the holding's handle: the same TensorImpl
      master.set_data(view);
    }
  }
  return copied;
}

at::Tensor StateSlabs::slab(size_t group, const std::string& kind) const {
  if (group >= slabs_.size()) return at::Tensor();
  auto it = slabs_[group].find(kind);
  return it == slabs_[group].end() ? at::Tensor() : it->second;
}

const Slot* StateSlabs::slot_of(const at::Tensor& tensor) const {
  auto it = slots_.find(tensor.unsafeGetTensorImpl());
  return it == slots_.end() ? nullptr : &it->second;
}

int64_t StateSlabs::bytes() const {
  int64_t total = 0;
  for (const auto& group : slabs_) {
    for (const auto& [kind, slab] : group) total += static_cast<int64_t>(slab.nbytes());
  }
  return total;
}

}  // namespace shardopt::detail
