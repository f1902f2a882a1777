#include "resilience/copies.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>

namespace shardopt::detail {

std::vector<at::Tensor> host_copies(const std::vector<at::Tensor>& tensors) {
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

// Sends `mine` to rank `to` and returns what rank `from` sent (a length, then the bytes, each an
// owned tensor: a transfer aborted by a failure may still be read by the transport). Even ranks
// send first and odd ranks receive first, so no ring of senders waits on itself.
std::vector<char> pass_along(ProcessGroup& group, const std::vector<char>& mine, int to, int from) {
  at::Tensor out_size = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor out = bytes_tensor(mine);
  at::Tensor in_size = at::empty({1}, at::kLong);
  auto send = [&] {
    group.send(out_size, to, 7);
    if (out.numel() > 0) group.send(out, to, 7);
  };
  at::Tensor in;
  auto recv = [&] {
    group.recv(in_size, from, 7);
    in = at::empty({in_size.item<int64_t>()}, at::kByte);
    if (in.numel() > 0) group.recv(in, from, 7);
  };
  if (group.rank() % 2 == 0) {
    send();
    recv();
  } else {
    recv();
    send();
  }
  return tensor_bytes(in);
}

// `value` with every tensor in it copied to host memory (a snapshot of live state, without the
// cost of serialising it; it is serialised only to be sent).
c10::IValue to_host(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor().detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), to_host(entry.value()));
    return out;
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(t.detach().to(at::kCPU, false, true));
    return out;
  }
  if (value.isList()) {
    const auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    for (const auto& item : list) out.push_back(to_host(item));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : value.toTupleRef().elements()) items.push_back(to_host(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return value;  // numbers, strings, None
}

int64_t host_bytes(const c10::IValue& value) {
  if (value.isTensor()) return static_cast<int64_t>(value.toTensor().nbytes());
  int64_t n = 0;
  if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) n += host_bytes(entry.value());
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList()) n += static_cast<int64_t>(t.nbytes());
  } else if (value.isList()) {
    for (const auto& item : value.toList()) n += host_bytes(item);
  } else if (value.isTuple()) {
    for (const auto& item : value.toTupleRef().elements()) n += host_bytes(item);
  }
  return n;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  }
  return text;
}


}  // namespace shardopt::detail
