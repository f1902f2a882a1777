// Parameters left to the user: ShardedDDP neither reduces nor touches them; their gradients are
// the rank's own, while the rest of the model matches the all-reduce reference.
#include <shardopt/ddp/sharded_ddp.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

// The test model's dense part plus a per-rank table the user owns: out += x @ table (5 x 3).
struct WithTable : torch::nn::Module {
  explicit WithTable(int rank) {
    auto p = testing::make_params();
    const char* names[] = {"w1", "b1", "w2", "b2", "s"};
    for (size_t i = 0; i < p.size(); ++i) dense.push_back(register_parameter(names[i], p[i]));
    table = register_parameter("table", at::full({5, 3}, 0.1 * (rank + 1)));  // differs across ranks
  }
  at::Tensor forward(at::Tensor x) { return testing::output(dense, x) + x.matmul(table); }
  Params dense;
  at::Tensor table;
};

TEST(IgnoredParameters, StayLocalWhileTheRestMatchesTheReference) {
  testing::run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<WithTable>(g->rank());
    Params ref = testing::clone_params(net->dense);
    at::Tensor ref_table = net->table.detach().clone().requires_grad_();
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(net->dense, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().ignored_parameters({net->table}).reduce_bucket_bytes(64));
    EXPECT_TRUE(at::equal(net->table, at::full({5, 3}, 0.1 * (g->rank() + 1))))
        << "ShardedDDP must not sync an ignored parameter at start-up";
    optim::SGD table_opt({net->table}, optim::SGDOptions(0.1));  // the user's own update
    for (int step = 0; step < 4; ++step) {
      auto data = testing::rank_data(step, g->rank(), 4);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      ddp.zero_grad();
      table_opt.zero_grad();
      testing::loss_of(ddp.forward(data.x), data, 4).backward();
      // The reference: dense gradients averaged over the ranks, the table's this rank's own.
      ref_opt.zero_grad();
      ref_table.mutable_grad() = at::Tensor();
      testing::loss_of(testing::output(ref, data.x) + data.x.matmul(ref_table), data, 4).backward();
      ASSERT_TRUE(at::allclose(net->table.grad(), ref_table.grad(), 1e-5, 1e-6)) << "step " << step;
      testing::allreduce_grads(ref, *g);
      oss.step();
      table_opt.step();
      ref_opt.step();
      {
        at::NoGradGuard no_grad;
        ref_table.sub_(ref_table.grad() * 0.1);
      }
      ASSERT_TRUE(testing::matches_reference(net->dense, ref, *g, 1e-5)) << "step " << step;
      ASSERT_TRUE(at::allclose(net->table, ref_table, 1e-5, 1e-6));
    }
  });
}

TEST(IgnoredParameters, BadListsAreErrorsOnEveryRank) {
  auto not_in_module = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<WithTable>(0);
    OSS oss(net->dense, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().ignored_parameters({net->table, at::zeros({2}).requires_grad_()}));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(not_in_module[r].find("ShardedDDP: ignored parameter 1 (of ignored_parameters) is not a parameter of "
                                    "the module"),
              std::string::npos)
        << "rank " << r << ": " << not_in_module[r];
  }
  auto also_in_oss = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<WithTable>(0);
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().ignored_parameters({net->table}));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(also_in_oss[r].find("parameter 'table' is in ignored_parameters and also in OSS 0; pass OSS only the "
                                  "parameters it should shard"),
              std::string::npos)
        << "rank " << r << ": " << also_in_oss[r];
  }
  // Ranks that ignore different parameters, and nothing else differs: rank 1 ignores 's' (module
  // position 4) beside the table and gives OSS a stand-in of the same shape and values in its
  // place, so that both OSS see five parameters of the same shapes and agree, and the first
  // check that can tell the ranks apart is ShardedDDP's agreement on the ignored parameters.
  // No start-up broadcast: were that check lost, the ranks (5 and 4 parameters to sync) would issue
  // different broadcasts and wait for the timeout; without it the trainable-set check right after
  // fails at once, with its own message, which the test tells apart.
  auto disagree = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<WithTable>(0);
    Params sharded = net->dense;
    Params ignored{net->table};
    if (g->rank() == 1) {
      ignored.push_back(net->dense[4]);
      sharded[4] = net->dense[4].detach().clone().requires_grad_();  // not a parameter of the module
    }
    OSS oss(sharded, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().ignored_parameters(ignored).sync_models_at_startup(false));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(disagree[r].find("ShardedDDP: ranks disagree on the ignored parameters (module positions): 5 on rank 0 "
                               "but [4, 5] on rank 1; every rank must pass the same module and ignored_parameters"),
              std::string::npos)
        << "rank " << r << ": " << disagree[r];
  }
  auto missing = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<WithTable>(0);
    OSS oss(net->dense, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(net, oss);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(missing[r].find("parameter 'table' of the module is in none of the OSS optimizers given to ShardedDDP "
                              "(list it in ShardedDDPOptions::ignored_parameters"),
              std::string::npos)
        << "rank " << r << ": " << missing[r];
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
