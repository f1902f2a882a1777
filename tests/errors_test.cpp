// Bad input gets a clear error on every rank, never a hang or a silent wrong result.
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <future>
#include <thread>


namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using testing::run_ranks_collect_errors;
using Params = std::vector<at::Tensor>;

OptimizerFactory adam() {
  return optimizer<optim::Adam>(optim::AdamOptions(1e-3));
}

// Every rank failed, and each message contains every one of `parts`.
void expect_all_ranks_fail(const std::vector<std::string>& errors, std::vector<std::string> parts) {
  for (size_t r = 0; r < errors.size(); ++r) {
    ASSERT_FALSE(errors[r].empty()) << "rank " << r << " did not fail";
    for (const auto& part : parts) EXPECT_NE(errors[r].find(part), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

std::vector<std::string> construct_on_ranks(int world, std::function<std::vector<optim::OptimizerParamGroup>(int rank)> groups) {
  return run_ranks_collect_errors(world, [&](std::shared_ptr<ProcessGroup> g) { OSS oss(groups(g->rank()), adam(), g); },
                                  std::chrono::seconds(20));
}

TEST(Errors, EmptyParameterList) {
  expect_all_ranks_fail(construct_on_ranks(2, [](int) { return std::vector<optim::OptimizerParamGroup>{optim::OptimizerParamGroup(Params{})}; }),
                        {"parameter list is empty"});
}

TEST(Errors, ParameterInTwoGroups) {
  expect_all_ranks_fail(construct_on_ranks(2, [](int) {
                          Params p = testing::make_params();
                          return std::vector<optim::OptimizerParamGroup>{optim::OptimizerParamGroup({p[0], p[1]}),
                                                                        optim::OptimizerParamGroup({p[2], p[1]})};
                        }),
                        {"parameter 3 (group 1)", "same tensor as parameter 1"});
}

TEST(Errors, NonLeafParameterOnOneRankFailsEveryRank) {
  expect_all_ranks_fail(construct_on_ranks(3, [](int rank) {
                          Params p = testing::make_params();
                          if (rank == 1) p[2] = p[2] * 2;
                          return std::vector<optim::OptimizerParamGroup>{optim::OptimizerParamGroup(p)};
                        }),
                        {"rank 1", "parameter 2", "not a leaf"});
}

TEST(Errors, SparseParameter) {
  expect_all_ranks_fail(construct_on_ranks(2, [](int) {
                          Params p{at::zeros({4, 3}).to_sparse().requires_grad_()};
                          return std::vector<optim::OptimizerParamGroup>{optim::OptimizerParamGroup(p)};
                        }),
                        {"parameter 0", "sparse"});
}

TEST(Errors, RanksWithDifferentParameterCountShapeOrDtype) {
  auto differ = [](std::function<void(Params&)> change) {
    return construct_on_ranks(2, [change](int rank) {
      Params p = testing::make_params();
      if (rank == 1) change(p);
      return std::vector<optim::OptimizerParamGroup>{optim::OptimizerParamGroup(p)};
    });
  };
  expect_all_ranks_fail(differ([](Params& p) { p.push_back(at::zeros({2}).requires_grad_()); }),
                        {"ranks disagree on the number of parameters: 5 on rank 0 but 6 on rank 1"});
  expect_all_ranks_fail(differ([](Params& p) { p[2] = at::zeros({3, 9}).requires_grad_(); }),
                        {"parameter 2", "[3, 8]", "rank 0", "[3, 9]", "rank 1"});
  expect_all_ranks_fail(differ([](Params& p) { p[1] = at::zeros({8}, at::kDouble).requires_grad_(); }),
                        {"parameter 1", "Float[8]", "Double[8]", "rank 1"});
}

// The roll call tells a rank that stopped after seeing a failure itself (it set its flag in its
// own roll call) from one that fell silent: rank 1 calls the roll, then its group goes; rank 0's
// roll call then names it as having seen the failure too.
TEST(Errors, ARankThatSawAFailureTooAndStoppedIsToldApartInTheRollCall) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::promise<void> rank1_gone;
  auto gone = rank1_gone.get_future();
  std::string rank0_says, rank1_says;
  auto form = [&](int r) {
    return init_process_group(store, InitOptions().backend("gloo").rank(r).world_size(2).timeout(std::chrono::seconds(60)));
  };
  std::thread one([&] {
    auto g = form(1);
    rank1_says = g->roll_call();  // rank 0 still beats: it names nobody
    g.reset();                    // its heartbeat stops with its group
    rank1_gone.set_value();
  });
  auto g = form(0);
  gone.wait();
  rank0_says = g->roll_call();
  one.join();
  EXPECT_EQ(rank1_says, "");
  EXPECT_NE(rank0_says.find("rank 1 saw a failure too and stopped"), std::string::npos) << rank0_says;
  EXPECT_EQ(rank0_says.find("stopped answering"), std::string::npos) << rank0_says;
}

TEST(Errors, RanksWithDifferentTrainableSetsAtStep) {
  auto errors = run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, adam(), g);
    if (g->rank() == 1) p[3].requires_grad_(false);
    oss.step();
  });
  expect_all_ranks_fail(errors, {"trainable set", "parameter 3", "rank 1"});
}

TEST(Errors, StateDictMisuse) {
  auto errors = run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, adam(), g);
    EXPECT_THROW(
        {
          try {
            oss.state_dict();
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find("call consolidate_state_dict"), std::string::npos);
            throw;
          }
        },
        c10::Error);
    oss.consolidate_state_dict(5);
  });
  expect_all_ranks_fail(errors, {"recipient 5 is outside [0, 2)"});

  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, adam(), g);
    for (auto& t : p) t.mutable_grad() = at::ones_like(t);
    oss.step();
    oss.consolidate_state_dict(1);
    if (g->rank() == 0) {
      try {
        oss.state_dict();
        ADD_FAILURE() << "state_dict() on a rank that is not the recipient must throw";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("the last recipient was rank 1"), std::string::npos) << e.what();
      }
      return;
    }
    const auto sd = oss.state_dict();
    // Into an optimizer with fewer parameters.
    Params fewer{at::zeros({8, 5}).requires_grad_(), at::zeros({8}).requires_grad_()};
    OSS small(fewer, adam(), init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().backend("gloo").rank(0).world_size(1)));
    try {
      small.load_state_dict(sd);
      ADD_FAILURE() << "loading 5 parameters' state into 2 must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("has 5 parameters in the state but 2"), std::string::npos) << e.what();
    }
    // Into an optimizer whose parameter 2 has another shape.
    Params other = testing::make_params();
    other[2] = at::zeros({3, 7}).requires_grad_();
    OSS mismatched(other, adam(), init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().backend("gloo").rank(0).world_size(1)));
    try {
      mismatched.load_state_dict(sd);
      ADD_FAILURE() << "loading state of another shape must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("of parameter 2 has shape [3, 8] but Adam keeps it in shape [3, 7]"),
                std::string::npos)
          << e.what();
    }
  });
}

void expect_init_error(InitOptions options, const std::string& part) {
  try {
    init_process_group(options);
    ADD_FAILURE() << "init_process_group should have thrown: " << part;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(Errors, UnknownBackendAndMalformedInitMethod) {
  expect_init_error(InitOptions().backend("mpi").rank(0).world_size(1), "unknown backend 'mpi'");
  expect_init_error(InitOptions().init_method("tcp://localhost").rank(0).world_size(1),
                    "malformed init_method 'tcp://localhost'");
  expect_init_error(InitOptions().init_method("tcp://localhost:http").rank(0).world_size(1), "must be an integer");
  expect_init_error(InitOptions().init_method("file://relative/path").rank(0).world_size(1), "malformed init_method");
  expect_init_error(InitOptions().init_method("udp://x:1").rank(0).world_size(1), "malformed init_method 'udp://x:1'");
  expect_init_error(InitOptions().init_method("tcp://127.0.0.1:1234").rank(2).world_size(2), "rank 2 is outside [0, 2)");
}

// Two ranks started with another world size, or another backend, fail at the join, each naming
// the field and both values, before any backend connects and long before the timeout (a rank
// waiting for a third rank that never comes is told at once).
TEST(Errors, RanksThatDisagreeOnWorldSizeOrBackendAtJoinFailEveryRank) {
  const auto base = [](int rank) { return InitOptions().rank(rank).timeout(std::chrono::seconds(30)); };
  const std::vector<std::pair<std::function<InitOptions(int)>, std::vector<std::string>>> cases = {
      {[&](int r) { return base(r).backend("gloo").world_size(r == 0 ? 2 : 3); },
       {"ranks disagree on world_size: 2 on rank 0 but 3 on rank 1", "start every rank with the same options"}},
      {[&](int r) { return base(r).world_size(2).backend(r == 0 ? "gloo" : "nccl"); },
       {"ranks disagree on backend: gloo on rank 0 but nccl on rank 1"}},
  };
  for (const auto& test_case : cases) {
    const auto& options = test_case.first;
    const auto& parts = test_case.second;
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::string> errors(2);
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          init_process_group(store, options(r));
          errors[r] = "";
        } catch (const c10::Error& e) {
          errors[r] = e.what_without_backtrace();
        }
      });
    }
    for (auto& t : threads) t.join();
    expect_all_ranks_fail(errors, parts);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(25)) << "told at once, not at the timeout";
  }
}

TEST(Errors, NcclWithoutACudaDeviceIsANamedError) {
  if (at::globalContext().hasCUDA()) {
    // With a GPU, the same request must create a working NCCL group.
    auto g = init_process_group(c10::make_intrusive<c10d::HashStore>(),
                                InitOptions().backend("nccl").rank(0).world_size(1));
    EXPECT_EQ(g->backend(), "nccl");
    return;
  }
  try {
    init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().backend("nccl").rank(0).world_size(1));
    ADD_FAILURE() << "nccl without a CUDA device must throw";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("no CUDA device is visible") != std::string::npos ||
                msg.find("this build has no NCCL backend") != std::string::npos)
        << msg;
  }
  // "auto" picks Gloo without a CUDA device (the GPU case returned above).
  auto g = init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().rank(0).world_size(1));
  EXPECT_EQ(g->backend(), "gloo");
}

TEST(Errors, RankThatNeverShowsUpTimesOut) {
  const auto start = std::chrono::steady_clock::now();
  const testing::ReservedPort port;
  expect_init_error(InitOptions()
                        .backend("gloo")
                        .init_method(port.tcp())
                        .rank(0)
                        .world_size(2)
                        .timeout(std::chrono::milliseconds(1500)),
                    "rank 0 of 2 could not connect to its peers within 1500 ms");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60)) << "must fail, not hang";
}

TEST(Errors, PeerThatSkipsACollectiveTimesOut) {
  auto errors = run_ranks_collect_errors(
      2,
      [](std::shared_ptr<ProcessGroup> g) {
        if (g->rank() == 1) return;  // never joins the all-reduce
        at::Tensor t = at::ones({4});
        g->allreduce(t);
      },
      std::chrono::milliseconds(1500));
  ASSERT_NE(errors[0].find("allreduce #1 on rank 0 failed or timed out"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("rank 1 stopped answering"), std::string::npos) << errors[0];
  EXPECT_TRUE(errors[1].empty());
}

// A phase user code names with CommPhase is named in the errors of the collectives it starts, as
// the library's own phases are; outside it, CommPhase::current() is empty again.
TEST(Errors, AUserPhaseIsNamedInTheErrorsOfItsCollectives) {
  auto errors = run_ranks_collect_errors(
      2,
      [](std::shared_ptr<ProcessGroup> g) {
        EXPECT_STREQ(CommPhase::current(), "");
        if (g->rank() == 1) return;  // never joins the all-reduce
        CommPhase phase("evaluating the validation set");
        EXPECT_STREQ(CommPhase::current(), "evaluating the validation set");
        at::Tensor t = at::ones({4});
        g->allreduce(t);
      },
      std::chrono::milliseconds(1500));
  EXPECT_NE(errors[0].find("allreduce #1 (evaluating the validation set) on rank 0 failed or timed out"),
            std::string::npos)
      << errors[0];
  EXPECT_TRUE(errors[1].empty());
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
