#include "optim/state_slabs.h"

#include <shardopt/check.h>
#include <shardopt/compat.h>

#include "optim/buffer_moves.h"
#include "optim/state_migration.h"
#include "optim/state_codes.h"

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
// slots (plan_slots). Where all the state in an old slab has its new slot in the same group and
// the new slab fits in the old one's memory (slabs are made with a little room to spare), the
// state moves inside that memory (move_in_place, Note [Moving ranges in place] in buffer_moves.h),
// so the old and the new slab are never held at once; otherwise it moves into a new slab at the
// next adopt(), and the old slab is freed with its last view.
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
        slot.coded = format_ == StateFormat::kInt8 && coded_numel(piece.param_numel);
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
  // The old slabs live on in the views until adopt() copies them (8-bit ones with their scales,
  // in coded_).
  replaced_ = std::move(slabs_);
  replaced_scales_ = std::move(scales_);
  slabs_.assign(groups.size(), {});
  scales_.assign(groups.size(), {});
}

int64_t StateSlabs::room_of(const at::Tensor& t) const {
  auto it = room_.find(t.storage().unsafeGetStorageImpl());
  return it == room_.end() ? static_cast<int64_t>(t.storage().nbytes()) : it->second;
}

bool StateSlabs::movable_to(const Slot& slot, const std::string& kind, const at::Tensor& t,
                            const OptimizerCodec* codec) const {
  return t.is_contiguous() && replaced_[slot.group].count(kind) != 0 &&
         t.storage().is_alias_of(replaced_[slot.group].at(kind).storage()) &&
         stored_dtype(kind, t, slot.coded) == t.scalar_type() && in_slab(slot, kind, codec);
}

int64_t StateSlabs::move_in_place(
    const std::vector<std::pair<torch::optim::Optimizer*, const OptimizerCodec*>>& units,
    std::vector<StatePart>& parts) {
  at::NoGradGuard no_grad;
  using Visit = std::function<at::Tensor(const void* key, const std::string& kind, const at::Tensor& t,
                                         const OptimizerCodec& codec)>;
  auto visit = [&](const Visit& fn) {
    for (const auto& unit : units) {
      const OptimizerCodec& codec = *unit.second;
      for (auto& entry : unit.first->state()) {
        const void* key = entry.first;
        codec.place_state(*entry.second, [&](const char* kind, const at::Tensor& t) { return fn(key, kind, t, codec); });
      }
    }
  };
  // Per replaced slab (group, kind): the moves of the state that views it, and whether all of it
  // has a new slot there; state viewing a slab kept nowhere makes it stay as it was (adopt()
  // copies it).
  struct Moves {
    std::vector<RangeMove> moves;
    bool movable = true;
  };
  std::map<std::pair<size_t, std::string>, Moves> by_slab;
  for (size_t g = 0; g < replaced_.size(); ++g) {
    for (const auto& [kind, old] : replaced_[g]) {
      if (kind == kMasterSlab) continue;
      bool room = g < slabs_.size() && old.storage_offset() == 0 &&
                  room_of(old) >= slab_numel_[g] * static_cast<int64_t>(old.element_size());
      if (room && old.scalar_type() == at::kByte) {
        auto sc = replaced_scales_[g].find(kind);
        room = sc != replaced_scales_[g].end() && sc->second.storage_offset() == 0 &&
               room_of(sc->second) >= state_blocks(slab_numel_[g]) * static_cast<int64_t>(sc->second.element_size());
      }
      by_slab[{g, kind}].movable = room;
    }
  }
  auto slab_viewed = [&](const std::string& kind, const at::Tensor& t) -> Moves* {
    for (auto& [where, m] : by_slab) {
      if (where.second == kind && t.storage().is_alias_of(replaced_[where.first].at(kind).storage())) return &m;
    }
    return nullptr;
  };
  visit([&](const void* key, const std::string& kind, const at::Tensor& t, const OptimizerCodec& codec) {
    Moves* m = slab_viewed(kind, t);
    if (!m) return t;
    auto it = slots_.find(key);
    const Slot* slot = it == slots_.end() ? nullptr : &it->second;
    const bool fits = slot && t.numel() == slot->numel && movable_to(*slot, kind, t, &codec);
    if (fits) {
      m->moves.push_back({t.storage_offset(), slot->offset, slot->numel});
    } else {
      m->movable = false;
    }
    return t;
  });
  // The parts of holdings assembled from slices: each to its place in its slot.
  std::vector<std::pair<StatePart*, Moves*>> part_moves;
  for (StatePart& part : parts) {
    const at::Tensor& t = part.tensor;
    Moves* m = slab_viewed(part.kind, t);
    if (!m) continue;
    auto it = slots_.find(part.key);
    const Slot* slot = it == slots_.end() ? nullptr : &it->second;
    const bool fits = slot && part.offset + t.numel() <= slot->numel && movable_to(*slot, part.kind, t, part.codec);
    if (fits) {
      m->moves.push_back({t.storage_offset(), slot->offset + part.offset, t.numel()});
      part_moves.emplace_back(&part, m);
    } else {
      m->movable = false;
    }
  }
  int64_t most = 0;
  for (auto& [where, m] : by_slab) {
    if (!m.movable) continue;
    const auto& [g, kind] = where;
    const at::Tensor& old = replaced_[g].at(kind);
    // The new slab, and the old places beyond it.
    auto span = [](const std::vector<RangeMove>& moves, int64_t numel) {
      for (const auto& mv : moves) numel = std::max(numel, mv.from + mv.numel);
      return numel;
    };
    const int64_t numel = slab_numel_[g];
    most = std::max(most, move_ranges_in_place(storage_as(old, room_of(old)).narrow(0, 0, span(m.moves, numel)), m.moves));
    const at::Tensor slab = storage_as(old, numel * static_cast<int64_t>(old.element_size()));
    slabs_[g][kind] = slab;
    if (old.scalar_type() != at::kByte) continue;
    // The scales move with their codes, a block each (every slot starts on a block boundary).
    std::vector<RangeMove> blocks;
    for (const auto& mv : m.moves) {
      TORCH_INTERNAL_ASSERT(mv.from % kStateBlock == 0 && mv.to % kStateBlock == 0, "8-bit state moved from element ",
                            mv.from, " to ", mv.to, ", not on block boundaries");
      blocks.push_back({mv.from / kStateBlock, mv.to / kStateBlock, state_blocks(mv.numel)});
    }
    const at::Tensor& old_scales = replaced_scales_[g].at(kind);
    const int64_t blocks_numel = state_blocks(numel);
    most = std::max(most, move_ranges_in_place(
                              storage_as(old_scales, room_of(old_scales)).narrow(0, 0, span(blocks, blocks_numel)), blocks));
    const at::Tensor scales = storage_as(old_scales, blocks_numel * static_cast<int64_t>(old_scales.element_size()));
    scales_[g][kind] = scales;
    for (auto& c : coded_) {
      if (c.first.storage().is_alias_of(slab.storage())) c = {slab, scales};
    }
  }
  // The moved state views its new place; the moved parts are in theirs.
  visit([&](const void* key, const std::string& kind, const at::Tensor& t, const OptimizerCodec&) {
    Moves* m = slab_viewed(kind, t);
    if (!m || !m->movable) return t;
    const Slot& slot = slots_.at(key);
    return slabs_[slot.group].at(kind).narrow(0, slot.offset, slot.numel).view(slot.sizes);
  });
  for (auto& [part, m] : part_moves) {
    if (m->movable) part->tensor = at::Tensor();
  }
  replaced_.clear();
  replaced_scales_.clear();
  return most;
}

at::Tensor StateSlabs::slab_for(size_t group, const std::string& kind, const at::Tensor& like, bool coded) {
  auto& slabs = slabs_.at(group);
  const at::ScalarType dtype = stored_dtype(kind, like, coded);
  auto it = slabs.find(kind);
  if (it == slabs.end()) {
    // Zeros: the gaps between pieces (alignment) stay finite, whatever steps over them; zero
    // scales decode any code to 0.
    // (With room for a later plan's slab: Note [Moving ranges in place].)
    int64_t room = 0;
    at::Tensor slab = zeros_with_room(slab_numel_[group], like.options().dtype(dtype).requires_grad(false), room);
    room_[slab.storage().unsafeGetStorageImpl()] = room;
    if (dtype == at::kByte) {
      at::Tensor scales =
          zeros_with_room(state_blocks(slab_numel_[group]), like.options().dtype(at::kFloat).requires_grad(false), room);
      room_[scales.storage().unsafeGetStorageImpl()] = room;
      scales_.at(group).emplace(kind, scales);
      // Replaced slabs nothing views any more go.
      coded_.erase(std::remove_if(coded_.begin(), coded_.end(),
                                  [](const auto& c) { return c.first.storage().use_count() == 1; }),
                   coded_.end());
      coded_.emplace_back(slab, scales);
    }
    it = slabs.emplace(kind, std::move(slab)).first;
  }
  const at::Tensor& slab = it->second;
  if (slab.scalar_type() != dtype || slab.device() != like.device()) return at::Tensor();
  return slab;
}

bool StateSlabs::in_slab(const Slot& slot, const std::string& kind, const OptimizerCodec* codec) const {
  return format_ != StateFormat::kInt8 || kind == kMasterSlab || (slot.coded && (!codec || codec->compresses(kind)));
}

at::Tensor StateSlabs::slot_scales(const Slot& slot, const std::string& kind) {
  return scales_.at(slot.group).at(kind).narrow(0, slot.offset / kStateBlock, state_blocks(slot.numel));
}

// Note [8-bit state slabs]
// Under StateFormat::kInt8 each moment of a parameter of at least kMinCodedNumel elements (the
// whole parameter's count, never a shard's) lives as uint8 codes in a slab laid out like the
// others, beside a slab of fp32 scales, one per kStateBlock elements of the slab. The layout is
// aligned to kStateBlock (OSS sets LayoutOptions::align to a multiple of it), so every parameter
// starts, and every cut of one (rows, split ranges, kept state) falls, on a block boundary of the
// whole tensor: a slot's offset is a block boundary, its blocks are the tensor's blocks, and its
// scales are the slab's from offset / kStateBlock. The codes are what torch::optim's state holds
// (views, shaped like the parameter); the fused step finds their scales here (scales_of). Smaller
// parameters keep fp32 state of their own, as torch::optim makes it. State leaves a rank in fp32
// (widen, widened: consolidation, shards, moves), and adopt() codes fp32 state into its slot with
// the tensor's own blocks, by recode(): the codes and scales of decoded codes are those codes and
// scales (Note [Codes of decoded codes] in state_codes.cpp), so state that leaves and comes back
// keeps its bits, and a block's result never depends on which rank holds it.
at::Tensor StateSlabs::scales_of(const at::Tensor& codes) const {
  if (!codes.defined() || codes.scalar_type() != at::kByte) return at::Tensor();
  for (const auto& [slab, scales] : coded_) {
    if (!codes.storage().is_alias_of(slab.storage())) continue;
    const int64_t at = codes.storage_offset() - slab.storage_offset();
    TORCH_INTERNAL_ASSERT(at % kStateBlock == 0, "8-bit state at element ", at, " of its slab is not on a block boundary");
    return scales.narrow(0, at / kStateBlock, state_blocks(codes.numel()));
  }
  return at::Tensor();
}

namespace {

bool signed_kind(const std::string& kind) { return signed_state(kind); }  // (codec.h)

}  // namespace

void StateSlabs::widen(torch::optim::Optimizer& local, const OptimizerCodec& codec,
                       const std::unordered_set<const void*>* only) const {
  at::NoGradGuard no_grad;
  for (auto& [key, state] : local.state()) {
    if (only && only->count(key) == 0) continue;
    codec.place_state(*state, [&](const char* kind, const at::Tensor& t) {
      const at::Tensor scales = scales_of(t);
      return scales.defined() ? dequantise(t, scales, signed_kind(kind)) : t;
    });
  }
}

GenericDict StateSlabs::with_scales(const GenericDict& encoded) const {
  if (format_ != StateFormat::kInt8) return encoded;
  GenericDict out = make_string_dict();
  for (const auto& v : encoded) {
    out.insert(v.key(), v.value());
    if (!is_state_tensor(v)) continue;
    const at::Tensor scales = scales_of(v.value().toTensor());
    if (scales.defined()) out.insert(v.key().toStringRef() + kScalesSuffix, scales);
  }
  return out;
}

GenericDict StateSlabs::widened(const GenericDict& encoded) const {
  if (format_ != StateFormat::kInt8) return encoded;
  GenericDict out = make_string_dict();
  for (const auto& v : encoded) {
    if (is_state_tensor(v)) {
      const at::Tensor& t = v.value().toTensor();
      const at::Tensor scales = scales_of(t);
      if (scales.defined()) {
        out.insert(v.key(), dequantise(t, scales, signed_kind(v.key().toStringRef())));
        continue;
      }
    }
    out.insert(v.key(), v.value());
  }
  return out;
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
at::ScalarType StateSlabs::stored_dtype(const std::string& kind, const at::Tensor& like, bool coded) const {
  const at::ScalarType dtype = like.scalar_type();
  if (format_ == StateFormat::kBFloat16 && kind != kMasterSlab && (dtype == at::kFloat || dtype == at::kBFloat16)) {
    return at::kBFloat16;
  }
  if (format_ == StateFormat::kInt8 && coded && kind != kMasterSlab && (dtype == at::kFloat || dtype == at::kByte)) {
    return at::kByte;
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
  const bool slabbed = it != slots_.end() && in_slab(it->second, kind, nullptr);
  const at::Tensor slab = slabbed ? slab_for(it->second.group, kind, tensor, it->second.coded) : at::Tensor();
  if (!slab.defined()) {
    // (8-bit codes never live outside a slab: without one a coded kind keeps fp32.)
    const at::ScalarType dtype = format_ == StateFormat::kInt8 ? tensor.scalar_type() : stored_dtype(kind, tensor, false);
    return dtype == tensor.scalar_type() ? at::Tensor() : at::zeros(tensor.sizes(), tensor.options().dtype(dtype));
  }
  const Slot& slot = it->second;
  if (slab.scalar_type() == at::kByte) slot_scales(slot, kind).zero_();
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
      if (t.numel() != slot.numel || !in_slab(slot, kind, &codec)) return t;
      const at::Tensor slab = slab_for(slot.group, kind, t, slot.coded);
      if (!slab.defined()) return t;
      at::Tensor view = slab.narrow(0, slot.offset, slot.numel).view(slot.sizes);
      if (t.data_ptr() == view.data_ptr() && t.sizes() == view.sizes() && t.strides() == view.strides()) return t;
      if (slab.scalar_type() == at::kByte) {
        copied += write_codes(view, slot_scales(slot, kind), t, kind);
        return view;
      }
      view.copy_(t.reshape(slot.sizes));
      copied += static_cast<int64_t>(t.nbytes());
      return view;
    });
  }
  return copied;
}

int64_t StateSlabs::write_codes(at::Tensor codes, at::Tensor scales, const at::Tensor& t, const std::string& kind) const {
  if (t.scalar_type() == at::kByte) {  // codes in a replaced slab: they move with their scales
    const at::Tensor from = scales_of(t);
    TORCH_INTERNAL_ASSERT(from.defined(), "8-bit state without its scales");
    codes.copy_(t.reshape(codes.sizes()));
    scales.copy_(from);
  } else {  // fp32 values: coded with the tensor's own blocks
    auto [c, sc] = recode(t.to(at::kFloat).reshape(codes.sizes()), signed_kind(kind));
    codes.copy_(c);
    scales.copy_(sc);
  }
  return static_cast<int64_t>(codes.nbytes() + scales.nbytes());
}

int64_t StateSlabs::land_parts(const std::vector<std::pair<torch::optim::Optimizer*, const OptimizerCodec*>>& units,
                               std::vector<StatePart>& parts) {
  if (parts.empty()) return 0;
  at::NoGradGuard no_grad;
  std::map<std::pair<const void*, std::string>, std::vector<const StatePart*>> of;
  for (const StatePart& part : parts) of[{part.key, part.kind}].push_back(&part);
  int64_t copied = 0;
  // The holding's state of `kind` from its parts, in its slot where it has one in a slab.
  auto land = [&](const void* key, const std::string& kind, const at::Tensor& placeholder,
                  const std::vector<const StatePart*>& ps) {
    const StatePart& first = *ps.front();
    const at::Tensor like = at::empty({0}, first.options);
    auto it = slots_.find(key);
    const Slot* slot = it == slots_.end() ? nullptr : &it->second;
    at::Tensor slab;
    if (slot && slot->numel == placeholder.numel() && in_slab(*slot, kind, first.codec)) {
      slab = slab_for(slot->group, kind, like, slot->coded);
    }
    if (slab.defined() && slab.scalar_type() == at::kByte) {
      // Each part is whole blocks of the tensor (its cuts fall on block boundaries): codes come
      // with their scales, fp32 values are coded with those blocks.
      at::Tensor codes = slab.narrow(0, slot->offset, slot->numel), scales = slot_scales(*slot, kind);
      for (const StatePart* p : ps) {
        if (!p->tensor.defined()) continue;  // moved into its place with its scales (move_in_place)
        TORCH_INTERNAL_ASSERT(p->offset % kStateBlock == 0, "8-bit state cut at element ", p->offset,
                              ", not on a block boundary");
        const int64_t n = p->tensor.numel();
        copied += write_codes(codes.narrow(0, p->offset, n), scales.narrow(0, p->offset / kStateBlock, state_blocks(n)),
                              p->tensor, kind);
      }
      return codes.view(slot->sizes);
    }
    at::Tensor flat = slab.defined() ? slab.narrow(0, slot->offset, slot->numel)
                                     : at::empty({placeholder.numel()}, first.options);
    for (const StatePart* p : ps) {
      if (!p->tensor.defined()) {  // moved into its place (move_in_place)
        TORCH_INTERNAL_ASSERT(slab.defined(), "state landed in a slab that is not its slot's");
        continue;
      }
      flat.narrow(0, p->offset, p->tensor.numel()).copy_(p->tensor);
      copied += static_cast<int64_t>(p->tensor.nbytes());
    }
    return flat.view(placeholder.sizes());
  };
  for (const auto& unit : units) {
    const OptimizerCodec& codec = *unit.second;
    for (auto& entry : unit.first->state()) {
      const void* key = entry.first;
      codec.place_state(*entry.second, [&](const char* kind, const at::Tensor& t) {
        auto found = of.find({key, kind});
        return found == of.end() ? t : land(key, kind, t, found->second);
      });
    }
  }
  parts.clear();
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
  return total + scale_bytes();
}

int64_t StateSlabs::scale_bytes_of(const GenericDict& encoded) const {
  int64_t total = 0;
  for (const auto& v : encoded) {
    if (!is_state_tensor(v)) continue;
    const at::Tensor scales = scales_of(v.value().toTensor());
    if (scales.defined()) total += static_cast<int64_t>(scales.nbytes());
  }
  return total;
}

int64_t StateSlabs::scale_bytes() const {
  int64_t total = 0;
  for (const auto& group : scales_) {
    for (const auto& [kind, scales] : group) total += static_cast<int64_t>(scales.nbytes());
  }
  return total;
}

}  // namespace shardopt::detail
