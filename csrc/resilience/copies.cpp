#include "resilience/copies.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>
#include <functional>

namespace shardopt::detail {

std::vector<at::Tensor> host_copies(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor> reuse) {
  bool fits = reuse.size() == tensors.size();
  for (size_t i = 0; i < tensors.size() && fits; ++i) {
    fits = reuse[i].sizes() == tensors[i].sizes() && reuse[i].scalar_type() == tensors[i].scalar_type() &&
           reuse[i].is_contiguous();
  }
  if (fits) {
    for (size_t i = 0; i < tensors.size(); ++i) reuse[i].copy_(tensors[i].detach());
    return reuse;
  }
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
  return out;
}

at::Tensor bytes_tensor(const std::vector<char>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::vector<char> tensor_bytes(const at::Tensor& t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  return std::vector<char>(p, p + t.numel());
}

namespace {

// `value` with every tensor replaced by f(tensor), in traversal order; containers keep their types.
c10::IValue map_tensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (value.isTensor()) return f(value.toTensor());
  if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), map_tensors(entry.value(), f));
    return out;
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(f(t));
    return out;
  }
  if (value.isList()) {
    const auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    for (const auto& item : list) out.push_back(map_tensors(item, f));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : value.toTupleRef().elements()) items.push_back(map_tensors(item, f));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return value;  // numbers, strings, None
}

constexpr int64_t kAlign = 64;

// `bytes` bytes: `reuse` when it has that many, else new memory.
at::Tensor byte_buffer(int64_t bytes, at::Tensor reuse) {
  return reuse.defined() && reuse.numel() == bytes ? std::move(reuse) : at::empty({bytes}, at::kByte);
}

}  // namespace

FlatCopy flatten(const c10::IValue& value, at::Tensor reuse) {
  std::vector<at::Tensor> tensors;
  c10::List<int64_t> offsets;
  c10::List<c10::List<int64_t>> sizes;
  int64_t total = 0;
  const c10::IValue shape = map_tensors(value, [&](const at::Tensor& t) {
    tensors.push_back(t.detach());
    offsets.push_back(total);
    sizes.push_back(c10::List<int64_t>(t.sizes().vec()));
    total += (static_cast<int64_t>(t.nbytes()) + kAlign - 1) / kAlign * kAlign;
    return at::empty({0}, t.options().device(at::kCPU).requires_grad(false));
  });
  FlatCopy copy;
  copy.bytes = byte_buffer(total, std::move(reuse));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    copy.bytes.narrow(0, offsets[i], static_cast<int64_t>(t.nbytes())).view(t.scalar_type()).view(t.sizes()).copy_(t);
  }
  copy.structure = torch::pickle_save(c10::ivalue::Tuple::create({shape, offsets, sizes}));
  return copy;
}

c10::IValue unflatten(const FlatCopy& copy) {
  const auto parts = torch::pickle_load(copy.structure).toTupleRef().elements();
  const auto offsets = parts[1].toIntList();
  const auto sizes = parts[2].toList();
  size_t i = 0;
  return map_tensors(parts[0], [&](const at::Tensor& empty) {
    const std::vector<int64_t> shape = sizes.get(i).toIntVector();
    const int64_t offset = offsets.get(i++);
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    if (numel == 0) return at::empty(shape, empty.options());
    return copy.bytes.narrow(0, offset, numel * static_cast<int64_t>(empty.element_size()))
        .view(empty.scalar_type())
        .view(shape);
  });
}

// Sends `mine` to rank `to` and returns what rank `from` sent: the two lengths, then the
// structure and the data (each an owned tensor: a transfer aborted by a failure may still be read
// by the transport). On Gloo the sends and the receives are in flight together, so that the bytes
// move both ways at once. NCCL's sends and receives block on the device unless grouped: there even
// ranks send first and odd ranks receive first. Either way no ring of senders waits on itself.
FlatCopy pass_along(ProcessGroup& group, const FlatCopy& mine, int to, int from, at::Tensor reuse) {
  at::Tensor out_sizes = at::tensor({static_cast<int64_t>(mine.structure.size()), mine.bytes.numel()}, at::kLong);
  at::Tensor out_structure = bytes_tensor(mine.structure);
  at::Tensor out_bytes = mine.bytes;
  at::Tensor in_sizes = at::empty({2}, at::kLong);
  const bool both_ways = group.backend() == "gloo";
  std::vector<PendingWork> sent;
  auto send = [&] {
    sent.push_back(group.send_async(out_sizes, to, 7));
    if (out_structure.numel() > 0) sent.push_back(group.send_async(out_structure, to, 7));
    if (out_bytes.numel() > 0) sent.push_back(group.send_async(out_bytes, to, 7));
    if (!both_ways) {
      for (auto& w : sent) w.wait();
    }
  };
  FlatCopy in;
  at::Tensor in_structure;
  auto recv = [&] {
    group.recv(in_sizes, from, 7);
    const int64_t structure_bytes = in_sizes[0].item<int64_t>(), data_bytes = in_sizes[1].item<int64_t>();
    in_structure = at::empty({structure_bytes}, at::kByte);
    in.bytes = byte_buffer(data_bytes, std::move(reuse));
    std::vector<PendingWork> received;
    if (in_structure.numel() > 0) received.push_back(group.recv_async(in_structure, from, 7));
    if (in.bytes.numel() > 0) received.push_back(group.recv_async(in.bytes, from, 7));
    for (auto& w : received) w.wait();
  };
  if (both_ways || group.rank() % 2 == 0) {
    send();
    recv();
  } else {
    recv();
    send();
  }
  for (auto& w : sent) w.wait();
  in.structure = tensor_bytes(in_structure);
  return in;
}

void broadcast_copy(ProcessGroup& group, FlatCopy& copy, int root) {
  const bool mine = group.rank() == root;
  at::Tensor sizes = mine ? at::tensor({static_cast<int64_t>(copy.structure.size()), copy.bytes.numel()}, at::kLong)
                          : at::empty({2}, at::kLong);
  group.broadcast(sizes, root);
  at::Tensor structure = mine ? bytes_tensor(copy.structure) : at::empty({sizes[0].item<int64_t>()}, at::kByte);
  group.broadcast(structure, root);
  at::Tensor bytes = mine ? copy.bytes : at::empty({sizes[1].item<int64_t>()}, at::kByte);
  if (bytes.numel() > 0) group.broadcast(bytes, root);
  if (!mine) {
    copy.structure = tensor_bytes(structure);
    copy.bytes = bytes;
  }
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  }
  return text;
}


}  // namespace shardopt::detail
