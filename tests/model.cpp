#include "model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cstring>

namespace shardopt::testing {

void fill_seeded(const std::vector<at::Tensor>& params, uint64_t seed, double scale) {
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const auto& p : params) p.copy_(at::randn(p.sizes(), gen).mul_(scale));
}

at::Tensor seeded_randn(std::vector<int64_t> sizes, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen);
}

std::vector<at::Tensor> make_params(uint64_t seed) {
  std::vector<std::vector<int64_t>> shapes{{8, 5}, {8}, {3, 8}, {3}, {3}};
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    at::Tensor p = seeded_randn(shapes[i], seed * 1000 + i) * 0.5;
    if (i == 4) p = p + 1.0;
    params.push_back(p.requires_grad_());
  }
  return params;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(p.requires_grad()));
  return out;
}

Data global_data(int64_t step, int64_t first, int64_t count) {
  std::vector<at::Tensor> xs, ys;
  for (int64_t i = first; i < first + count; ++i) {
    xs.push_back(seeded_randn({1, 5}, 1000003ull * (step + 1) + 2 * i));
    ys.push_back(seeded_randn({1, 3}, 1000003ull * (step + 1) + 2 * i + 1));
  }
  return {at::cat(xs), at::cat(ys)};
}

Data rank_data(int64_t step, int rank, int per_rank) {
  return global_data(step, static_cast<int64_t>(rank) * per_rank, per_rank);
}

at::Tensor output(const std::vector<at::Tensor>& p, const at::Tensor& x, bool use_scale) {
  at::Tensor h = at::tanh(at::addmm(p[1], x, p[0].t()));
  at::Tensor o = at::addmm(p[3], h, p[2].t());
  return use_scale ? o * p[4] : o;
}

std::vector<at::Tensor> make_dominant_params(uint64_t seed) {
  std::vector<std::vector<int64_t>> shapes{{5, 80}, {80, 80}, {80, 3}, {3}};
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    params.push_back((seeded_randn(shapes[i], seed * 1000 + i) * 0.3).requires_grad_());
  }
  return params;
}

at::Tensor dominant_output(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  at::Tensor h = at::tanh(at::mm(x, p[0]));
  h = at::tanh(at::mm(h, p[1]) * 0.1);
  return at::addmm(p[3], h, p[2]);
}

at::Tensor loss_of(const at::Tensor& out, const Data& d, double divisor) {
  return (out - d.y).pow(2).sum() / divisor;
}

at::Tensor loss(const std::vector<at::Tensor>& p, const Data& d, double divisor, bool use_scale) {
  return loss_of(output(p, d.x, use_scale), d, divisor);
}

void allreduce_grads(const std::vector<at::Tensor>& params, ProcessGroup& group, bool average) {
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad();
    group.allreduce(g);
    if (average) g.div_(group.size());
  }
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a.detach() - b.detach()).abs().max().item<double>() / scale;
}

bool same_on_all_ranks(const std::vector<at::Tensor>& params, ProcessGroup& group) {
  std::vector<at::Tensor> flat;
  for (const auto& p : params) flat.push_back(p.detach().reshape(-1));
  at::Tensor mine = at::cat(flat);
  std::vector<at::Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(at::empty_like(mine));
  group.allgather(all, mine);
  for (const auto& t : all) {
    if (!t.equal(all[0])) return false;
  }
  return true;
}

std::vector<at::Tensor> everyones(ProcessGroup& group, const at::Tensor& mine) {
  std::vector<at::Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(at::empty_like(mine));
  group.allgather(all, mine);
  return all;
}

std::vector<char> broadcast_bytes(const std::vector<char>& bytes, ProcessGroup& group) {
  at::Tensor size = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  group.broadcast(size, 0);
  at::Tensor blob = at::zeros({size.item<int64_t>()}, at::kByte);
  if (group.rank() == 0 && !bytes.empty()) std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
  group.broadcast(blob, 0);
  const char* data = static_cast<const char*>(blob.data_ptr());
  return std::vector<char>(data, data + blob.numel());
}

bool differs_across_ranks(const at::Tensor& t, ProcessGroup& group) {
  const auto all = everyones(group, t.detach().reshape(-1).contiguous());
  for (int a = 0; a < group.size(); ++a) {
    for (int b = a + 1; b < group.size(); ++b) {
      if (all[a].equal(all[b])) return false;
    }
  }
  return true;
}

}  // namespace shardopt::testing
