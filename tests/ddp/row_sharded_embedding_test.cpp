// User-defined parallelism beside ShardedDDP: an embedding table split row-wise across the
// ranks, looked up through the user's own exchange (an all-gather of the ids and an all-reduce of
// the partial rows, differentiable), and a dense part under OSS + ShardedDDP with the table in
// ignored_parameters. The whole model matches one process training on every rank's samples.
// docs/guide.md walks through this code.
#include <shardopt/ddp/sharded_ddp.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

constexpr int64_t kVocab = 12, kDim = 5, kBatch = 4;

// Sum over ranks, differentiable: the gradient of a sum is the sum of the gradients.
struct AllReduceSum : torch::autograd::Function<AllReduceSum> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, ProcessGroup* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    at::Tensor y = x.clone();
    group->allreduce(y);
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* group = reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
    at::Tensor g = grads[0].clone();
    group->allreduce(g);
    return {g, at::Tensor()};
  }
};

// This rank's rows [first, first + rows) of the table; looks up every rank's ids and returns
// the embeddings of this rank's own.
struct ShardedEmbedding : torch::nn::Module {
  ShardedEmbedding(const at::Tensor& full, ProcessGroup& g) : group(&g) {
    const int64_t rows = kVocab / g.size();
    first = g.rank() * rows;
    shard = register_parameter("shard", full.narrow(0, first, rows).clone());
  }
  at::Tensor forward(const at::Tensor& ids) {
    std::vector<at::Tensor> all;
    for (int r = 0; r < group->size(); ++r) all.push_back(at::empty_like(ids));
    group->allgather(all, ids);
    const at::Tensor every = at::cat(all);  // every rank's ids, in rank order
    const at::Tensor local = every - first;
    const at::Tensor mine = (local >= 0) & (local < shard.size(0));
    at::Tensor partial = shard.index_select(0, local.clamp(0, shard.size(0) - 1)) * mine.unsqueeze(1);
    const at::Tensor rows = AllReduceSum::apply(partial, group);
    return rows.narrow(0, group->rank() * ids.size(0), ids.size(0));
  }
  ProcessGroup* group;
  int64_t first = 0;
  at::Tensor shard;
};

struct Model : torch::nn::Module {
  Model(const at::Tensor& table, ProcessGroup& g) {
    auto p = testing::make_params();
    const char* names[] = {"w1", "b1", "w2", "b2", "s"};
    for (size_t i = 0; i < p.size(); ++i) dense.push_back(register_parameter(names[i], p[i]));
    embedding = register_module("embedding", std::make_shared<ShardedEmbedding>(table, g));
  }
  at::Tensor forward(at::Tensor x, at::Tensor ids) {
    return testing::output(dense, x + embedding->forward(ids));
  }
  Params dense;
  std::shared_ptr<ShardedEmbedding> embedding;
};

at::Tensor ids_of(int64_t step, int rank) {
  return (at::arange(kBatch, at::kLong) * 7 + step * 3 + rank * 5) % kVocab;  // differ across ranks
}

TEST(RowShardedEmbedding, MatchesOneProcessOnEveryRanksSamples) {
  at::manual_seed(9);
  const at::Tensor table = at::randn({kVocab, kDim}) * 0.3;
  constexpr int kWorld = 2, kSteps = 4;
  // One process: the full table and every rank's samples; the loss is the mean of the ranks'.
  Params ref = testing::make_params();
  at::Tensor ref_table = table.clone().requires_grad_();
  optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
  optim::SGD ref_table_opt({ref_table}, optim::SGDOptions(0.1));
  std::vector<Params> ref_after;
  for (int step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    ref_table_opt.zero_grad();
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < kWorld; ++r) {
      auto data = testing::rank_data(step, r, kBatch);
      loss = loss + testing::loss_of(testing::output(ref, data.x + ref_table.index_select(0, ids_of(step, r))), data,
                                     kBatch) / kWorld;
    }
    loss.backward();
    ref_opt.step();
    ref_table_opt.step();
  }

  testing::run_ranks(kWorld, [&](std::shared_ptr<ProcessGroup> g) {
    auto model = std::make_shared<Model>(table, *g);
    OSS oss(model->dense, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(model, oss, ShardedDDPOptions().ignored_parameters({model->embedding->shard}));
    optim::SGD shard_opt({model->embedding->shard}, optim::SGDOptions(0.1));
    for (int step = 0; step < kSteps; ++step) {
      auto data = testing::rank_data(step, g->rank(), kBatch);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      ddp.zero_grad();
      shard_opt.zero_grad();
      ddp.pre_forward();  // the module's forward takes two tensors: call it after pre_forward()
      testing::loss_of(model->forward(data.x, ids_of(step, g->rank())), data, kBatch).backward();
      // The shard's gradient is the sum over every rank's loss; the reference takes their mean.
      model->embedding->shard.mutable_grad().div_(g->size());
      oss.step();
      shard_opt.step();
    }
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_LE(testing::rel_diff(model->dense[i], ref[i]), 1e-5) << i;
    const auto& shard = model->embedding->shard;
    EXPECT_LE(testing::rel_diff(shard, ref_table.narrow(0, model->embedding->first, shard.size(0))), 1e-5);
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
