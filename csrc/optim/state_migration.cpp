#include "optim/state_migration.h"

#include <shardopt/check.h>
#include <shardopt/compat.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <string>

namespace shardopt::detail {

namespace {

// One range of one parameter on its way to a new holding.
struct Slice {
  int64_t begin = 0, end = 0;  // parameter frame
  std::optional<GenericDict> state;
  at::Tensor grad;
  at::Tensor values;  // the holding tensor's own values (mixed precision's master weights)
};

// Elements [begin, end) (parameter frame) of old holding `o` of parameter `param` on this rank: its
// state, gradient and, with `carry_values`, its own values, as views of the old holding's tensors
// (Note [Slices as views]); with `copy_values`, the values are a copy.
Slice cut_slice(const OptimizerCodec& codec, const torch::optim::Optimizer& local, const HoldingGrads& grads,
                size_t param, const Holding& o, int64_t begin, int64_t end, bool carry_values, bool copy_values) {
  Slice slice{begin, end, std::nullopt, at::Tensor(), at::Tensor()};
  const int64_t from = begin - o.in_param.begin;
  const auto part = [&](const at::Tensor& t) { return t.reshape(-1).narrow(0, from, end - begin); };
  auto it = local.state().find(compat::state_key(o.tensor));
  if (it != local.state().end()) {
    slice.state = slice_state(codec.encode_state(*it->second), from, from + end - begin, o.in_param.size(),
                              /*copy=*/false);
  }
  if (const at::Tensor g = grads.get(param, o); g.defined()) slice.grad = part(g);
  if (carry_values) slice.values = copy_values ? part(o.tensor.detach()).clone() : part(o.tensor.detach());
  return slice;
}

// Note [Slices as views]
// A slice of an old holding is a view of its tensors (the state the optimizer held, its owned
// gradient, its values), not a copy. Nothing writes to the old holdings' memory before every slice
// is read: a slice sent to another rank is read once, when its payload piece is made
// (WireWriter::send), and let go right after; one that stays on its rank becomes the state of its
// new holding as it is, a view of the old state slab (decoded without a copy: Note [Decoding
// without copies]), or a part of it (Note [State lands in its slot]), and StateSlabs::move_in_place
// then moves it to its new place inside that slab (Note [Moving ranges in place]); only the values
// (mixed precision's masters) that stay are copied, since install() writes them into the new
// holding's tensor, which may lie where another old holding's values still are. So a freeze holds
// no copy of the state that stays on its rank, and a sending rank none of what it sends beyond one
// piece of the payload (Note [State moves without pickling]). Before, every slice was copied when
// cut, and the payload made whole beside the copies.

// Bytes of state (and values) a slice carries.
int64_t slice_bytes(const Slice& slice) {
  return (slice.state ? state_tensor_bytes(*slice.state) : 0) +
         (slice.values.defined() ? static_cast<int64_t>(slice.values.nbytes()) : 0);
}

// Note [State moves without pickling]
// The slices one rank sends another travel as two messages: a header of 64-bit words that names
// each slice (parameter, range) and each of its tensors (state entry, dtype, shape, where its
// bytes are), then one payload with every tensor's bytes, each at an 8-byte-aligned offset, made
// on the sender's device and received on the receiver's (a CUDA tensor over NCCL stays on the
// device). The payload goes in pieces of at most kPayloadPiece bytes, each made just before it is
// sent, so a sender holds no more than one piece beside the state it sends; the receiver receives
// the pieces into one payload. The receiver's tensors are views of the payload, copied once into
// their holdings' slabs. Nothing is pickled, and the bytes counted as moved are the state's (and
// masters') as before.
constexpr int64_t kPayloadPiece = int64_t{8} << 20;

class WireWriter {
 public:
  void word(int64_t w) { header_.push_back(w); }
  void text(const std::string& s) {
    word(static_cast<int64_t>(s.size()));
    for (char c : s) word(static_cast<unsigned char>(c));
  }
  void tensor(const at::Tensor& t) {
    word(static_cast<int64_t>(t.scalar_type()));
    word(t.dim());
    for (int64_t size : t.sizes()) word(size);
    word(bytes_);
    tensors_.push_back({t.contiguous().reshape(-1).view(at::kByte), bytes_});  // its bytes
    bytes_ += (static_cast<int64_t>(t.nbytes()) + 7) / 8 * 8;
  }
  void slice(size_t param, const Slice& slice) {
    word(static_cast<int64_t>(param));
    word(slice.begin);
    word(slice.end);
    word(slice.state ? static_cast<int64_t>(slice.state->size()) : -1);
    if (slice.state) {
      for (const auto& v : *slice.state) {
        TORCH_INTERNAL_ASSERT(v.value().isTensor(), "state entry ", v.key().toStringRef(), " is not a tensor");
        text(v.key().toStringRef());
        tensor(v.value().toTensor());
      }
    }
    for (const at::Tensor* t : {&slice.grad, &slice.values}) {
      word(t->defined() ? 1 : 0);
      if (t->defined()) tensor(*t);
    }
  }
  // The header (its last word: the payload's bytes) and the payload, sent to `dst` in pieces of
  // at most kPayloadPiece bytes (Note [State moves without pickling]).
  void send(ProcessGroup& group, int dst, int tag, at::Device device) {
    word(bytes_);
    std::vector<char> header(header_.size() * sizeof(int64_t));
    std::memcpy(header.data(), header_.data(), header.size());
    group.send_bytes(header, dst, tag);
    size_t next = 0;  // the first tensor that does not end before the piece
    for (int64_t at = 0; at < bytes_; at += kPayloadPiece) {
      const int64_t n = std::min(kPayloadPiece, bytes_ - at);
      at::Tensor piece = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device));
      for (size_t k = next; k < tensors_.size() && tensors_[k].second < at + n; ++k) {
        const auto& [t, offset] = tensors_[k];
        const int64_t nbytes = static_cast<int64_t>(t.nbytes());
        const int64_t begin = std::max(offset, at), end = std::min(offset + nbytes, at + n);
        if (begin < end) {
          piece.narrow(0, begin - at, end - begin)
              .copy_(t.narrow(0, begin - offset, end - begin));
        }
        if (offset + nbytes <= at + n) next = k + 1;
      }
      group.send(piece, dst, tag);
    }
    tensors_.clear();
  }

 private:
  std::vector<int64_t> header_;
  std::vector<std::pair<at::Tensor, int64_t>> tensors_;
  int64_t bytes_ = 0;
};

// A tensor as a header names it: its dtype, its shape and where its bytes start in the payload.
struct Placed {
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  int64_t offset;
};

// One slice as a header names it.
struct Parsed {
  size_t param;
  int64_t begin, end;
  bool has_state;
  std::vector<std::pair<std::string, Placed>> state;
  std::optional<Placed> grad, values;
};

// The slices a header from rank `src` names (WireWriter's words), and the payload's bytes.
std::pair<std::vector<Parsed>, int64_t> parse_header(const std::vector<char>& bytes, int src) {
  std::vector<int64_t> words(bytes.size() / sizeof(int64_t));
  std::memcpy(words.data(), bytes.data(), words.size() * sizeof(int64_t));
  TORCH_INTERNAL_ASSERT(!words.empty(), "an empty header of state slices from rank ", src);
  size_t at = 0;
  auto word = [&] {
    TORCH_INTERNAL_ASSERT(at < words.size(), "a short header of state slices from rank ", src);
    return words[at++];
  };
  auto tensor = [&] {
    Placed p{static_cast<at::ScalarType>(word()), {}, 0};
    for (int64_t d = word(); d > 0; --d) p.sizes.push_back(word());
    p.offset = word();
    return p;
  };
  std::vector<Parsed> parsed;
  while (at + 1 < words.size()) {
    Parsed p{static_cast<size_t>(word()), word(), word(), false, {}, std::nullopt, std::nullopt};
    const int64_t entries = word();
    p.has_state = entries >= 0;
    for (int64_t e = 0; e < entries; ++e) {
      std::string key;
      for (int64_t n = word(); n > 0; --n) key.push_back(static_cast<char>(word()));
      p.state.emplace_back(std::move(key), tensor());
    }
    if (word()) p.grad = tensor();
    if (word()) p.values = tensor();
    parsed.push_back(std::move(p));
  }
  const int64_t payload_bytes = word();
  return {std::move(parsed), payload_bytes};
}

// The slices rank `src` sent (WireWriter::send), with their parameters; their tensors view one
// payload received on the device `device_of(first slice's parameter)` gives.
std::vector<std::pair<size_t, Slice>> receive_slices(ProcessGroup& group, int src, int tag,
                                                     const std::function<at::Device(size_t)>& device_of) {
  // First the header: the tensors are made once the payload is here.
  const auto [parsed, payload_bytes] = parse_header(group.recv_bytes(src, tag), src);
  const at::Device device = parsed.empty() ? at::Device(at::kCPU) : device_of(parsed.front().param);
  at::Tensor payload = at::empty({payload_bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  for (int64_t at = 0; at < payload_bytes; at += kPayloadPiece) {
    at::Tensor piece = payload.narrow(0, at, std::min(kPayloadPiece, payload_bytes - at));
    group.recv(piece, src, tag);
  }
  auto make = [&](const Placed& p) {
    const int64_t numel = c10::multiply_integers(p.sizes);
    const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(p.dtype));
    return payload.narrow(0, p.offset, nbytes).view(p.dtype).view(p.sizes);
  };
  std::vector<std::pair<size_t, Slice>> out;
  for (const auto& p : parsed) {
    Slice slice{p.begin, p.end, std::nullopt, at::Tensor(), at::Tensor()};
    if (p.has_state) {
      GenericDict state = make_string_dict();
      for (const auto& [key, placed] : p.state) state.insert(key, make(placed));
      slice.state = std::move(state);
    }
    if (p.grad) slice.grad = make(*p.grad);
    if (p.values) slice.values = make(*p.values);
    out.emplace_back(p.param, std::move(slice));
  }
  return out;
}

// incoming[(param, holding index)] -> the slices of that holding of this rank.
using Incoming = std::map<std::pair<size_t, size_t>, std::vector<Slice>>;

// Sends rank d outgoing[d] where moving[this rank][d], and files each slice this rank receives
// under every holding of its own in `to` that the slice lies in: one pair of ranks at a time, in
// the same order everywhere, so that no two transfers wait on each other.
void exchange(ProcessGroup& group, const std::vector<std::vector<uint8_t>>& moving, std::vector<WireWriter>& outgoing,
              at::Device device, const std::vector<std::vector<Holding>>& to, Incoming& incoming, RebalanceStats& stats) {
  const int rank = group.rank(), world = group.size();
  const auto device_of = [&](size_t i) {
    for (const Holding& h : to.at(i)) {
      if (h.rank == rank && h.tensor.defined()) return h.tensor.device();
    }
    return device;
  };
  for (int s = 0; s < world; ++s) {
    for (int d = 0; d < world; ++d) {
      if (!moving[s][d]) continue;
      if (rank == s) outgoing[d].send(group, d, s, device);
      if (rank != d) continue;
      for (auto& [i, slice] : receive_slices(group, s, s, device_of)) {
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

// Note [State lands in its slot]
// A new holding whose state comes in several slices (in a split re-partition most do: each rank's
// ranges shift) was joined by at::cat into a tensor of its own, which StateSlabs::adopt then
// copied into its slot: for a moment a rank held that state twice, beside the old slab and the
// payload it received. With `parts`, the slices are not joined. The holding's state tensors are
// placeholders on the meta device (its shape and dtype, no memory), and each slice is a StatePart.
// StateSlabs::move_in_place moves the parts that are views of an old slab it lays out again in
// its own memory to their places in the new slot, with the rest of that slab's state; land_parts
// then copies every other part (a view of a payload, or of a slab made anew) into its place and
// makes the state the slot's view. So state that stays on its rank is never copied out of its
// slab, and state that arrives is copied once, from the payload into its slot.

// Stitches the slices of one new holding (sorted, covering it) and installs state and gradient;
// with `parts`, state in several slices is left for the slabs to land (Note [State lands in its
// slot]).
void install(const OptimizerCodec& codec, torch::optim::Optimizer& local, size_t param, const Holding& h,
             const HoldingGrads& grads, std::vector<Slice> slices, std::vector<StatePart>* parts) {
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
  if (all_state && slices.size() == 1) {
    // One range: its tensors as they came, whatever their shape.
    local.state()[compat::state_key(h.tensor)] =
        decode_state_like(codec, *slices.front().state, h.tensor, /*alias=*/true);
  } else if (all_state && !slices.empty() && parts) {
    GenericDict placeholders = make_string_dict();
    const auto options = h.tensor.options().requires_grad(false);
    for (const auto& v : *slices.front().state) {
      if (!is_state_tensor(v)) {
        placeholders.insert(v.key(), v.value());
        continue;
      }
      placeholders.insert(v.key(), at::empty(h.tensor.sizes(), options.device(at::kMeta)));
      for (const auto& s : slices) {
        parts->push_back({h.tensor.unsafeGetTensorImpl(), v.key().toStringRef(), s.begin - h.in_param.begin,
                          s.state->at(v.key()).toTensor().reshape(-1), options, &codec});
      }
    }
    local.state()[compat::state_key(h.tensor)] = codec.decode_state(placeholders);
  } else if (all_state && !slices.empty()) {
    GenericDict merged = make_string_dict();
    for (const auto& v : *slices.front().state) {
      if (!is_state_tensor(v)) {
        merged.insert(v.key(), v.value());
        continue;
      }
      std::vector<at::Tensor> pieces;
      for (const auto& s : slices) pieces.push_back(s.state->at(v.key()).toTensor().reshape(-1));
      merged.insert(v.key(), at::cat(pieces).reshape(h.tensor.sizes()));
    }
    local.state()[compat::state_key(h.tensor)] = decode_state_like(codec, merged, h.tensor);
  }
  if (all_values && !slices.empty()) {  // each slice straight into its place
    at::Tensor flat = h.tensor.detach().view(-1);
    for (const auto& s : slices) flat.narrow(0, s.begin - h.in_param.begin, s.end - s.begin).copy_(s.values.reshape(-1));
  }
  if (all_grad && !slices.empty() && !grads.get(param, h).defined()) {
    // A fresh tensor, not a view of another: zero_grad(false) detaches it in place. The slices
    // are written into it once.
    const auto options = slices.front().grad.options().device(h.tensor.device()).requires_grad(false);
    std::vector<at::Tensor> parts;
    for (const auto& s : slices) parts.push_back(s.grad.reshape(-1).to(options));
    at::Tensor grad = at::empty(h.tensor.sizes(), options);
    at::Tensor flat = grad.view(-1);
    at::cat_out(flat, parts);
    grads.set(param, h, std::move(grad));
  }
}

}  // namespace

// Note [Decoding without copies]
// A codec's decode_state copies each state tensor (a state dict the user keeps must not share
// memory with the optimizer's state). Where the tensors are the optimizer's own already (state
// that moved, views of a slab or of a payload), decode_state_like with `alias` decodes
// placeholders on the meta device (the shapes and dtypes, no memory) and then puts the tensors
// themselves in the state through the codec's place_state, which names every entry it keeps.
// A codec that names fewer entries than the state has is decoded the usual way.
std::unique_ptr<torch::optim::OptimizerParamState> decode_state_like(const OptimizerCodec& codec,
                                                                     const GenericDict& encoded,
                                                                     const at::Tensor& like, bool alias) {
  const auto options = like.options().requires_grad(false);
  GenericDict placed = make_string_dict(), shapes = make_string_dict();
  std::map<std::string, at::Tensor> tensors;
  for (const auto& v : encoded) {
    if (is_state_tensor(v)) {
      // (Aliased, each keeps its dtype: 8-bit codes stay codes, bf16 state stays bf16.)
      const at::Tensor& given = v.value().toTensor();
      at::Tensor t = given.to(alias ? options.dtype(given.scalar_type()) : options);
      if (t.numel() == like.numel()) t = t.reshape(like.sizes());
      placed.insert(v.key(), t);
      if (alias) {
        shapes.insert(v.key(), at::empty(t.sizes(), t.options().device(at::kMeta)));
        tensors.emplace(v.key().toStringRef(), t);
      }
    } else {
      placed.insert(v.key(), v.value());
      if (alias) shapes.insert(v.key(), v.value());
    }
  }
  if (alias) {
    auto state = codec.decode_state(shapes);
    size_t named = 0;
    codec.place_state(*state, [&](const char* kind, const at::Tensor& t) {
      auto it = tensors.find(kind);
      if (it == tensors.end()) return t;
      ++named;
      return it->second;
    });
    if (named == tensors.size()) return state;
  }
  return codec.decode_state(placed);
}

GenericDict slice_state(const GenericDict& encoded, int64_t begin, int64_t end, int64_t numel, bool copy) {
  GenericDict out = make_string_dict();
  const bool all = begin == 0 && end == numel;
  for (const auto& v : encoded) {
    if (is_state_tensor(v) && all) {
      const at::Tensor& t = v.value().toTensor();
      out.insert(v.key(), copy ? t.clone() : t);
    } else if (is_state_tensor(v)) {
      const at::Tensor range = v.value().toTensor().reshape(-1).narrow(0, begin, end - begin);
      out.insert(v.key(), copy ? range.clone() : range);
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

void migrate_holdings(ProcessGroup& group, const std::function<torch::optim::Optimizer&(size_t param)>& local_of,
                      const std::vector<std::vector<Holding>>& from,
                      const std::vector<std::vector<Holding>>& to, const HoldingGrads& grads, RebalanceStats& stats,
                      bool carry_values, std::vector<StatePart>* parts,
                      const std::function<GenericDict(const GenericDict&)>& widen) {
  TORCH_INTERNAL_ASSERT(from.size() == to.size(), "holdings of ", from.size(), " and ", to.size(), " parameters");
  const int rank = group.rank(), world = group.size();
  std::vector<size_t> changed;
  for (size_t i = 0; i < from.size(); ++i) {
    if (!same_holdings(from[i], to[i])) changed.push_back(i);
  }
  if (changed.empty()) return;
  at::NoGradGuard no_grad;
  // moving[s][d]: does any range go from rank s to another rank d?
  std::vector<std::vector<uint8_t>> moving(world, std::vector<uint8_t>(world, 0));
  std::vector<WireWriter> outgoing(world);
  // The device the payloads this rank sends are made on: its holdings'.
  at::Device device(at::kCPU);
  for (const auto& list : from) {
    for (const Holding& o : list) {
      if (o.rank == rank && o.tensor.defined()) device = o.tensor.device();
    }
  }
  Incoming incoming;
  for (size_t i : changed) {
    torch::optim::Optimizer& local = local_of(i);
    const auto& codec = codec_for(local);
    ++stats.params_moved;
    for (size_t k = 0; k < to[i].size(); ++k) {
      const Holding& h = to[i][k];
      for (const Holding& o : from[i]) {
        const int64_t begin = std::max(h.in_param.begin, o.in_param.begin);
        const int64_t end = std::min(h.in_param.end, o.in_param.end);
        if (begin >= end && !(h.in_param.size() == 0 && o.in_param.size() == 0)) continue;
        if (o.rank != h.rank) moving[o.rank][h.rank] = 1;
        if (o.rank != rank) continue;
        Slice slice = cut_slice(codec, local, grads, i, o, begin, end, carry_values, /*copy_values=*/h.rank == rank);
        if (h.rank == rank) {
          incoming[{i, k}].push_back(std::move(slice));
          continue;
        }
        if (widen && slice.state) slice.state = widen(*slice.state);
        stats.state_bytes_sent += slice_bytes(slice);
        outgoing[h.rank].slice(i, slice);
      }
    }
    // The old holdings' state is now in the slices.
    for (const Holding& o : from[i]) {
      if (o.rank == rank) local.state().erase(compat::state_key(o.tensor));
    }
  }
  exchange(group, moving, outgoing, device, to, incoming, stats);
  // Each holding's slices let go once installed: a payload goes as its last slice does.
  for (auto it = incoming.begin(); it != incoming.end(); it = incoming.erase(it)) {
    torch::optim::Optimizer& local = local_of(it->first.first);
    install(codec_for(local), local, it->first.first, to[it->first.first][it->first.second], grads,
            std::move(it->second), parts);
  }
}

// Note [Each rank receives its own ranges]
// A new OSS (a recovery's, or an admission's) loads the shards of the old one, which some members
// hold whole (a survivor its own, and a lost buddy's). Each range of an old shard goes only to the
// members whose new holdings overlap it, and there only the overlap, in the messages and order of
// migrate_holdings (one pair of members at a time, in the same order everywhere). Every member
// first learns every member's ranges (one all-gather of five numbers per range), so that all lay
// out alike for the state they will hold, and know who sends what to whom. No member holds more
// than its own share of the state, and a recovery at world 8 moves a few MB per survivor where
// broadcasting every shard to every survivor moved the whole state (docs/benchmarks-log.md).
void scatter_shard_ranges(ProcessGroup& members, const std::function<int(int member)>& rank_of,
                          const std::function<torch::optim::Optimizer&(size_t param)>& local_of,
                          const std::vector<ShardRange>& ranges, const std::vector<GenericDict>& mine,
                          const std::vector<std::vector<Holding>>& to, RebalanceStats& stats, bool carry_values) {
  at::NoGradGuard no_grad;
  const int me = members.rank(), world = members.size();
  const int my_rank = rank_of(me);
  at::Device device(at::kCPU);  // where this member's payloads are made: its holdings' device
  for (const auto& list : to) {
    for (const Holding& h : list) {
      if (h.rank == my_rank && h.tensor.defined()) device = h.tensor.device();
    }
  }
  std::vector<int> shard_rank(static_cast<size_t>(world));
  for (int m = 0; m < world; ++m) shard_rank[static_cast<size_t>(m)] = rank_of(m);
  // moving[s][d]: does any range go from member s to another member d?
  std::vector<std::vector<uint8_t>> moving(world, std::vector<uint8_t>(world, 0));
  std::vector<WireWriter> outgoing(static_cast<size_t>(world));
  Incoming incoming;
  size_t next_mine = 0;
  for (const ShardRange& r : ranges) {
    SHARDOPT_CHECK(r.param < to.size() && r.begin >= 0 && r.begin <= r.end, "an old shard names range [", r.begin,
                   ", ", r.end, ") of parameter ", r.param, ", but the optimizer has ", to.size(), " parameters");
    const GenericDict* entry = nullptr;
    if (r.member == me) {
      TORCH_INTERNAL_ASSERT(next_mine < mine.size(), "fewer entries than this member's ranges");
      entry = &mine[next_mine++];
    }
    if (!r.state && !(carry_values && r.master)) continue;
    for (size_t k = 0; k < to[r.param].size(); ++k) {
      const Holding& h = to[r.param][k];
      const int64_t begin = std::max(h.in_param.begin, r.begin), end = std::min(h.in_param.end, r.end);
      if (begin >= end && !(h.in_param.size() == 0 && r.begin == r.end)) continue;
      for (int d = 0; d < world; ++d) {
        if (shard_rank[static_cast<size_t>(d)] != h.rank) continue;
        if (d != r.member) moving[r.member][d] = 1;
        if (entry == nullptr) continue;
        Slice slice{begin, end, std::nullopt, at::Tensor(), at::Tensor()};
        const int64_t from = begin - r.begin;
        if (r.state) slice.state = slice_state(entry->at("state").toGenericDict(), from, end - r.begin, r.end - r.begin);
        if (carry_values && r.master) {
          slice.values = entry->at("master").toTensor().reshape(-1).narrow(0, from, end - begin);
        }
        if (d == me) {
          // On the device of what the others send (a host copy's slices meet CUDA payloads).
          if (slice.state) {
            GenericDict moved = make_string_dict();
            for (const auto& v : *slice.state) {
              moved.insert(v.key(), is_state_tensor(v) ? c10::IValue(v.value().toTensor().to(device)) : v.value());
            }
            slice.state = std::move(moved);
          }
          if (slice.values.defined()) slice.values = slice.values.to(device);
          incoming[{r.param, k}].push_back(std::move(slice));
        } else {
          stats.state_bytes_sent += slice_bytes(slice);
          outgoing[static_cast<size_t>(d)].slice(r.param, slice);
        }
      }
    }
  }
  TORCH_INTERNAL_ASSERT(next_mine == mine.size(), "more entries than this member's ranges");
  for (int s = 0; s < world; ++s) {
    for (int d = 0; d < world; ++d) {
      if (!moving[s][d]) continue;
      if (me == s) outgoing[static_cast<size_t>(d)].send(members, d, s, device);
      if (me != d) continue;
      for (auto& [i, slice] : receive_slices(members, s, s, [&](size_t) { return device; })) {
        stats.state_bytes_received += slice_bytes(slice);
        for (size_t k = 0; k < to[i].size(); ++k) {
          const Holding& h = to[i][k];
          if (h.rank == my_rank && h.in_param.begin <= slice.begin && slice.end <= h.in_param.end) {
            incoming[{i, k}].push_back(slice);
          }
        }
      }
    }
  }
  const HoldingGrads no_grads{[](size_t, const Holding&) { return at::Tensor(); }, [](size_t, const Holding&, at::Tensor) {}};
  for (auto& [where, slices] : incoming) {
    torch::optim::Optimizer& local = local_of(where.first);
    install(codec_for(local), local, where.first, to[where.first][where.second], no_grads, std::move(slices), nullptr);
  }
}

}  // namespace shardopt::detail
