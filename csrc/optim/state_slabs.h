// StateSlabs: where a rank's optimizer state lives, owned by OSS (Note [State slabs] in
// state_slabs.cpp). Internal to shardopt.
//
// For each (device, dtype) group of the layout it holds one flat slab per kind of state
// ("exp_avg", "exp_avg_sq", "momentum_buffer", ...) and mixed precision's fp32 masters in a slab
// of their own (kMasterSlab). The state tensors torch::optim sees are views into the slabs, so
// state_dict(), checkpoints and the codecs see the same tensors as before, and the fused step
// reads each run of state from one slab. A slab's dtype is its kind's stored dtype
// (stored_dtype), which the state's format decides, not the parameter's.
#pragma once

#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/oss.h>

#include "optim/codec.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace shardopt::detail {

struct StatePart;  // (state_migration.h)

// The slab kind of mixed precision's fp32 master weights, beside the state's kinds.
inline constexpr const char* kMasterSlab = "master";

// Where one holding's state lives in its group's slabs.
struct Slot {
  size_t group = 0;
  int64_t offset = 0;  // elements into each slab of the group
  int64_t numel = 0;
  std::vector<int64_t> sizes;  // the holding tensor's shape (the state tensors' shape)
  bool kept = false;           // a frozen parameter's kept state (after the trainable region)
  bool coded = false;          // StateFormat::kInt8 and a parameter of at least kMinCodedNumel elements:
                               // its state is 8-bit codes and block scales (Note [8-bit state slabs])
  bool operator==(const Slot& o) const {
    return group == o.group && offset == o.offset && numel == o.numel && sizes == o.sizes && kept == o.kept &&
           coded == o.coded;
  }
};

class StateSlabs {
 public:
  explicit StateSlabs(StateFormat format = StateFormat::kFloat32) : format_(format) {}

  // Places this rank's state (its slots) for `layout`: every holding of `rank` that is a piece of
  // the layout's trainable run at its place in the rank's shard (the same offsets as the parameter
  // buffer), and each other holding with state (a frozen parameter's kept state) after it. When
  // the slots differ from the last ones, move_in_place() lays each old slab out again inside its
  // own memory where it can; the other slabs are made anew as state arrives (adopt(),
  // fresh_slot()), and the old ones are freed once no state tensor refers to them.
  // `has_state(param, tensor)` says whether the optimizer of `param` holds state for `tensor`.
  void plan_slots(const FlatLayout& layout, int rank, const std::vector<std::vector<Holding>>& holdings,
                  const std::function<bool(size_t param, const at::Tensor& tensor)>& has_state);

  // A zeroed view of `tensor`'s slot (a holding tensor: it keys the state) in the slab of `kind`,
  // shaped like it (a coded slot: zeroed codes whose scales are zeroed too, which decode to 0).
  // Where it has no slot or the slab cannot hold its state (another device, fp32 state beside
  // 8-bit slabs): a zeroed tensor in the kind's stored dtype when that is not `tensor`'s, else
  // undefined.
  at::Tensor fresh_slot(const at::Tensor& tensor, const char* kind);

  // The fp32 block scales of 8-bit codes that view a slab of these (current, or replaced by the
  // last plan_slots() and still viewed): one per kStateBlock elements from the codes' start, which
  // is a block boundary. Undefined when `codes` views none of them.
  at::Tensor scales_of(const at::Tensor& codes) const;
  // Every 8-bit state tensor of `local` replaced by its fp32 values (decoded with its scales):
  // before state moves between ranks, which it does in fp32; adopt() codes it again, to the same
  // codes and scales (Note [8-bit state slabs]).
  // With `only`, the state of those holding tensors (TensorImpls) alone.
  void widen(torch::optim::Optimizer& local, const OptimizerCodec& codec,
             const std::unordered_set<const void*>* only = nullptr) const;
  // `encoded` (an encoded state, state_dict layout) with each 8-bit state tensor replaced by its
  // fp32 values, for consolidation.
  GenericDict widened(const GenericDict& encoded) const;
  // `encoded` with each 8-bit state tensor's scales beside its codes (kScalesSuffix: views of the
  // scale slab), for shards; decoded_state() in state_codes.h reads it back.
  GenericDict with_scales(const GenericDict& encoded) const;

  // Moves every state tensor of `local` that is not in its slot into it (one local copy each; into
  // a coded slot fp32 state is coded, and codes come with their scales) and makes the state hold
  // the slab's view; returns the bytes copied. State without a slot stays as it is.
  int64_t adopt(torch::optim::Optimizer& local, const OptimizerCodec& codec);

  // After plan_slots() gave new slots, before adopt(): each replaced slab of state whose memory
  // has room for its kind's new slab keeps that memory, and the state of `units` that views it
  // moves inside it to its new slot (8-bit codes with their scales; Note [Moving ranges in place]
  // in buffer_moves.h), so a new plan does not hold the old slabs and the new ones at once. State
  // in such a slab without a new slot there is copied out first. The `parts` that view such a
  // slab move with it to their places in their slots, and are then let go (their tensors
  // undefined: landed). Returns the most elements set aside at once.
  int64_t move_in_place(const std::vector<std::pair<torch::optim::Optimizer*, const OptimizerCodec*>>& units,
                        std::vector<StatePart>& parts);
  // After move_in_place(), before adopt(): the state of each holding that `parts` name (its
  // tensors placeholders) becomes its slot's view, with every part not yet landed copied into its
  // place (into a coded slot: coded); a holding without a slot gets a tensor of its own. Note
  // [State lands in its slot] in state_migration.cpp. Returns the bytes copied.
  int64_t land_parts(const std::vector<std::pair<torch::optim::Optimizer*, const OptimizerCodec*>>& units,
                     std::vector<StatePart>& parts);

  // Mixed precision: moves the master of each holding of `rank` (the holding's fp32 tensor, which
  // keys its state) that has a slot into its group's master slab (kMasterSlab) at the slot, keeping
  // the tensor (set_data); returns the bytes copied. A master without a slot keeps its storage.
  int64_t adopt_masters(const std::vector<std::vector<Holding>>& holdings, int rank);

  // The slab of `kind` in `group`; undefined before any state of that kind arrived.
  at::Tensor slab(size_t group, const std::string& kind) const;
  // Per layout group, its slab of `kind` (undefined where there is none).
  std::vector<at::Tensor> slabs_of(const std::string& kind) const;
  // The slot of holding tensor `tensor`, or null.
  const Slot* slot_of(const at::Tensor& tensor) const;
  // Bytes of all slabs (8-bit slabs' scales included).
  int64_t bytes() const;
  // Bytes of the current 8-bit slabs' scales.
  int64_t scale_bytes() const;
  // Bytes of the scales of the 8-bit state tensors of `encoded` (an encoded state).
  int64_t scale_bytes_of(const GenericDict& encoded) const;

 private:
  // The dtype the state of `kind` is stored in, for state tensors like `like` (Note [State
  // formats]): under kFloat32 the dtype torch::optim makes it in (the stepped tensor's); under
  // kBFloat16 bf16 for fp32 (or bf16) state; masters stay as they are.
  // Under kInt8: uint8 codes in a coded slot, fp32 state (not in a slab) elsewhere.
  at::ScalarType stored_dtype(const std::string& kind, const at::Tensor& like, bool coded) const;
  // Whether `slot`'s state of `kind` lives in a slab (not, under kInt8: the fp32 state of a small
  // tensor, or of an entry `codec` does not compress; null codec: the fused step's kinds).
  bool in_slab(const Slot& slot, const std::string& kind, const OptimizerCodec* codec) const;
  // Whether state `t` of `kind`, a view of the slab `slot`'s group replaced, can move inside that
  // slab's memory into `slot` (contiguous, in the slot's stored dtype, kept in a slab).
  bool movable_to(const Slot& slot, const std::string& kind, const at::Tensor& t, const OptimizerCodec* codec) const;
  // Writes `t` (codes viewing a slab of these, with their scales, or values to code with the
  // tensor's own blocks) into `codes` and their `scales`; returns the bytes written.
  int64_t write_codes(at::Tensor codes, at::Tensor scales, const at::Tensor& t, const std::string& kind) const;
  // The scales of `slot` in the scale slab of `kind` (a coded slot).
  at::Tensor slot_scales(const Slot& slot, const std::string& kind);
  // The slab of `kind` in `group` for state like `like`, made when missing; undefined when `like`
  // does not fit the group's slabs.
  at::Tensor slab_for(size_t group, const std::string& kind, const at::Tensor& like, bool coded = false);

  StateFormat format_;
  std::unordered_map<const void*, Slot> slots_;  // holding tensor (TensorImpl) -> slot
  std::vector<int64_t> slab_numel_;              // per group: trainable region + kept region
  std::vector<std::map<std::string, at::Tensor>> slabs_;  // per group: kind -> slab
  std::vector<std::map<std::string, at::Tensor>> scales_;  // per group: kind -> its 8-bit slab's scales
  // The slabs (and scales) plan_slots() replaced, until move_in_place() has taken what it can.
  std::vector<std::map<std::string, at::Tensor>> replaced_, replaced_scales_;
  // The bytes each slab's memory holds (StorageImpl -> bytes): a slab laid out again in less
  // than its memory keeps the rest for a later plan.
  std::unordered_map<const void*, int64_t> room_;
  int64_t room_of(const at::Tensor& t) const;
  // Every 8-bit slab (codes) with its scales, current and replaced; a replaced one is dropped once
  // nothing views it.
  std::vector<std::pair<at::Tensor, at::Tensor>> coded_;
};

}  // namespace shardopt::detail
