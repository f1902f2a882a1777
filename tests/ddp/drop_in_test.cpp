// Ordinary LibTorch habits under OSS + ShardedDDP give DDP's result: every way of clearing
// gradients, accumulation over several backward passes, a Sequential model.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "named_net.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/embedding.h>
#include <torch/csrc/api/include/torch/optim.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

using Net = testing::NamedNet;

constexpr int kClearingStyles = 10;
const char* clearing_name(int style) {
  static const char* names[] = {"oss.zero_grad(true)", "oss.zero_grad(false)", "oss.zero_grad()",
                                "Optimizer::zero_grad()", "module->zero_grad(true)", "module->zero_grad(false)",
                                "ddp.zero_grad(true)", "ddp.zero_grad(false)", "p.mutable_grad() = {}", "p.grad().zero_()"};
  return names[style];
}

void clear(int style, OSS& oss, ShardedDDP& ddp, Net& net) {
  switch (style) {
    case 0: oss.zero_grad(true); break;
    case 1: oss.zero_grad(false); break;
    case 2: oss.zero_grad(); break;
    case 3: static_cast<optim::Optimizer&>(oss).zero_grad(); break;
    case 4: net.zero_grad(true); break;
    case 5: net.zero_grad(false); break;
    case 6: ddp.zero_grad(true); break;
    case 7: ddp.zero_grad(false); break;
    case 8: for (auto& p : net.params) p.mutable_grad() = at::Tensor(); break;
    default:
      for (auto& p : net.params) {
        if (p.grad().defined()) p.grad().zero_();
      }
  }
}

struct Habits {
  int world = 2;
  int64_t bucket_bytes = 0;
  PartitionMode partition = PartitionMode::kAuto;
  int backwards = 1;        // backward passes per step, none under no_sync, no clearing between
  bool clear_each_step = true;
  int first_style = 0;      // clearing style of step 0; step t uses (first_style + t) % kClearingStyles
  bool clear_after_forward = false;  // out = forward(x); clear; backward (PyTorch's quickstart order)

  std::string name() const {
    return "world " + std::to_string(world) + " buckets " + std::to_string(bucket_bytes) + " partition " +
           std::to_string(static_cast<int>(partition)) + " backwards " + std::to_string(backwards);
  }

  void run() const {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      Params ref = testing::clone_params(net->params);
      optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
      OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
              OSSOptions().partition(partition));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(bucket_bytes));
      for (int step = 0; step < kClearingStyles; ++step) {
        // w2 and b2 are frozen for steps 3 and 4.
        for (Params* q : {&ref, &net->params}) {
          for (int i : {2, 3}) (*q)[i].requires_grad_(step < 3 || step > 4);
        }
        const int style = (first_style + step) % kClearingStyles;
        ref_opt.zero_grad(true);
        if (!clear_after_forward) clear(style, oss, ddp, *net);
        for (int k = 0; k < backwards; ++k) {
          auto data = testing::rank_data(step * backwards + k, g->rank(), 4);
          if (step == 0 && k == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          // DDP's reference: each backward's gradient averaged over the ranks, added to the last.
          Params fresh = testing::clone_params(ref);
          testing::loss(fresh, data, 4).backward();
          testing::allreduce_grads(fresh, *g);
          at::NoGradGuard no_grad;
          for (size_t i = 0; i < ref.size(); ++i) {
            if (!fresh[i].grad().defined()) continue;
            if (ref[i].grad().defined()) {
              ref[i].mutable_grad().add_(fresh[i].grad());
            } else {
              ref[i].mutable_grad() = fresh[i].grad().clone();
            }
          }
          at::AutoGradMode enable(true);
          at::Tensor out = ddp.forward(data.x);
          if (clear_after_forward && k == 0) clear(style, oss, ddp, *net);
          testing::loss_of(out, data, 4).backward();
        }
        for (auto& p : ref) {
          if (!p.requires_grad()) p.mutable_grad().reset();
        }
        ref_opt.step();
        oss.step();
        ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5))
            << "after step " << step << " cleared with " << clearing_name(style) << ", " << name();
      }
    });
  }
};

// Every way of clearing, in turn, with freezing in between, against DDP + Adam.
TEST(DropIn, EveryWayOfClearingGradientsGivesDdpsResult) {
  for (int world : {2, 3}) {
    for (int64_t bucket_bytes : {int64_t{0}, int64_t{160}}) {
      for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
        Habits h;
        h.world = world;
        h.bucket_bytes = bucket_bytes;
        h.partition = partition;
        h.first_style = world + static_cast<int>(bucket_bytes % 7);  // other neighbours each time
        SCOPED_TRACE(h.name());
        h.run();
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// The order of PyTorch's quickstart: forward, then clear, then backward.
TEST(DropIn, ClearingBetweenForwardAndBackwardGivesDdpsResult) {
  for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
    Habits h;
    h.world = 2;
    h.bucket_bytes = 160;
    h.partition = partition;
    h.clear_after_forward = true;
    SCOPED_TRACE(h.name());
    h.run();
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Two and three backward passes per step without no_sync and without clearing between them:
// each one's averaged gradient adds to the last, as with DDP, for parameters held whole and split
// (w2 and b2 frozen for steps 3 and 4; every clearing style between steps).
TEST(DropIn, AccumulationWithoutNoSyncAddsEachAveragedGradient) {
  for (int world : {2, 3}) {
    for (int backwards : {2, 3}) {
      for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
        Habits h;
        h.world = world;
        h.backwards = backwards;
        h.bucket_bytes = 160;
        h.partition = partition;
        h.first_style = backwards;
        SCOPED_TRACE(h.name());
        h.run();
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// Gradients zeroed in place through the OSS or ShardedDDP stay in their owner's bucket, and the
// next backward accumulates into them there: only the gradients of parameters another rank owns
// are copied into buckets. Without gradient_as_bucket_view, or for the gradients of a bucket whose
// memory the user holds another view of, every gradient is copied. DDP's result either way, and a
// gradient the user holds is the gradient after backward, as in LibTorch.
TEST(DropIn, GradientsZeroedInPlaceStayInTheirBucketWithDdpsResult) {
  for (bool view : {true, false}) {
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      Params ref = testing::clone_params(net->params);
      optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
      OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
              OSSOptions().partition(PartitionMode::kWholeParameters));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(160).gradient_as_bucket_view(view));
      int64_t all_bytes = 0, others_bytes = 0;  // every gradient; those of parameters another rank owns
      for (const auto& p : net->params) {
        all_bytes += static_cast<int64_t>(p.nbytes());
        if (oss.owner(p) != g->rank()) others_bytes += static_cast<int64_t>(p.nbytes());
      }
      ASSERT_LT(others_bytes, all_bytes) << "every rank owns a parameter here";
      for (int step = 0; step < 6; ++step) {
        ref_opt.zero_grad(true);
        if (step % 2) {
          ddp.zero_grad(false);
        } else {
          oss.zero_grad(false);
        }
        at::Tensor held, other_view;  // step 3: the user keeps a gradient, step 4 another view of one
        for (auto& p : net->params) {
          if (p.grad().defined() && step == 3) held = p.grad();
          if (p.grad().defined() && step == 4) other_view = p.grad().view(-1);
        }
        auto data = testing::rank_data(step, g->rank(), 4);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        testing::loss(ref, data, 4).backward();
        testing::allreduce_grads(ref, *g);
        testing::loss_of(ddp.forward(data.x), data, 4).backward();
        // Step 0 has no bucket yet to accumulate into; step 4's held view keeps one bucket copying.
        const bool in_place = view && step > 0 && step != 4;
        if (in_place) {
          EXPECT_EQ(testing::Introspection::copied_grad_bytes(ddp), others_bytes) << "step " << step;
        } else if (step != 4) {
          EXPECT_EQ(testing::Introspection::copied_grad_bytes(ddp), all_bytes) << "step " << step;
        } else {
          EXPECT_GT(testing::Introspection::copied_grad_bytes(ddp), others_bytes) << "step " << step;
        }
        if (held.defined()) {
          for (const auto& p : net->params) {
            if (p.grad().defined() && p.grad().data_ptr() == held.data_ptr()) EXPECT_TRUE(at::equal(p.grad(), held));
          }
          // As under DDP, the gradient the user holds is still the parameter's gradient.
          if (view) {
            bool found = false;
            for (const auto& p : net->params) found |= p.grad().unsafeGetTensorImpl() == held.unsafeGetTensorImpl();
            EXPECT_TRUE(found) << "the held gradient is no longer any parameter's gradient";
          }
        }
        ref_opt.step();
        oss.step();
        ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5))
            << "after step " << step << (view ? " with" : " without") << " gradient_as_bucket_view";
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Row buckets (the default partition for Adam): this rank's row of each bucket is its own memory,
// and after zero_grad(false) the whole parameters of that row accumulate there: only the other
// ranks' rows and the pieces of parameters cut across rows are copied. DDP's result.
TEST(DropIn, RowBucketGradientsZeroedInPlaceStayInTheOwnersRow) {
  // 5 -> 16 -> 16 -> 16 -> 3: 8 tensors, so that each rank's row holds whole parameters.
  auto make = [] {
    auto made = torch::nn::Sequential(torch::nn::Linear(5, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                                      torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
                                      torch::nn::Linear(16, 3));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    at::NoGradGuard no_grad;
    for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
    return made;
  };
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = make(), ref_net = make();
    Params params = net->parameters(), ref = ref_net->parameters();
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(params, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(net.ptr(), oss);
    ASSERT_TRUE(Introspection::split(oss));
    ASSERT_TRUE(oss.layout().buckets().at(0).rows());
    int64_t all_bytes = 0, in_row_bytes = 0;  // every gradient; the whole ones in this rank's rows
    for (const auto& p : params) all_bytes += static_cast<int64_t>(p.nbytes());
    for (const Piece& piece : oss.layout().pieces()) {
      if (piece.owner == g->rank() && piece.whole()) in_row_bytes += piece.in_param.size() * 4;
    }
    ASSERT_GT(in_row_bytes, 0) << "rank " << g->rank() << " holds whole parameters in its rows";
    for (int step = 0; step < 4; ++step) {
      ref_opt.zero_grad(true);
      ddp.zero_grad(false);
      auto data = testing::rank_data(step, g->rank(), 4);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      testing::loss_of(ref_net->forward(data.x), data, 4).backward();
      testing::allreduce_grads(ref, *g);
      testing::loss_of(ddp.forward(data.x), data, 4).backward();
      // Step 0 has no row memory yet to accumulate into.
      EXPECT_EQ(testing::Introspection::copied_grad_bytes(ddp), step == 0 ? all_bytes : all_bytes - in_row_bytes)
          << "step " << step << ", rank " << g->rank();
      ref_opt.step();
      oss.step();
      ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << "after step " << step;
    }
  });
}

// torch::autograd::grad() runs the hooks before accumulation but reduces nothing: the gradients
// are left as they were (a zeroed one stays where it is, none is set aside for good), and what the
// user adds to them before the next backward counts, as under DDP: after zero_grad(false), a
// weight-decay term added to each gradient, then backward, gives that term plus the average.
TEST(DropIn, AutogradGradBeforeBackwardLeavesTheGradientsAsTheyWere) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    Params ref = testing::clone_params(net->params);
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
            OSSOptions().partition(PartitionMode::kWholeParameters));
    ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(160));
    constexpr double kDecay = 0.1;
    for (int step = 0; step < 4; ++step) {
      auto data = testing::rank_data(step, g->rank(), 4);
      ref_opt.zero_grad(true);
      testing::loss(ref, data, 4).backward();
      testing::allreduce_grads(ref, *g);
      ddp.zero_grad(false);
      at::Tensor loss = testing::loss_of(ddp.forward(data.x), data, 4);
      if (step >= 1) {  // gradients exist (zeroed) from here on
        std::vector<at::Tensor> grads_before;
        for (auto& p : net->params) grads_before.push_back(p.grad());
        auto direct = torch::autograd::grad({loss}, net->params, {}, /*retain_graph=*/true);
        ASSERT_EQ(direct.size(), net->params.size());
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < net->params.size(); ++i) {
          // Under DDP every rank adds the term to its gradient; here the owner holds the gradient.
          ref[i].mutable_grad().add_(ref[i].detach(), kDecay);
          const at::Tensor& grad = net->params[i].grad();
          ASSERT_EQ(grad.defined(), grads_before[i].defined()) << "parameter " << i << ", step " << step;
          if (!grad.defined()) continue;
          EXPECT_EQ(grad.unsafeGetTensorImpl(), grads_before[i].unsafeGetTensorImpl());
          grad.add_(net->params[i].detach(), kDecay);
        }
      }
      loss.backward();
      ref_opt.step();
      oss.step();
      ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5)) << "after step " << step;
    }
  });
}

// Three SGD steps through ddp.forward() against `reference` (a copy of the module's parameters,
// called as `reference_forward`) with its gradients all-reduced: DDP's result.
template <class F>
void expect_ddp_result_through_forward(ShardedDDP& ddp, OSS& oss, const Params& mine, const Params& reference,
                                       F reference_forward, ProcessGroup& g) {
  optim::SGD ref_opt(reference, optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    auto data = testing::rank_data(step, g.rank(), 4);
    ddp.zero_grad();
    testing::loss_of(ddp.forward(data.x), data, 4).backward();
    oss.step();
    ref_opt.zero_grad();
    testing::loss_of(reference_forward(data.x), data, 4).backward();
    testing::allreduce_grads(reference, g);
    ref_opt.step();
  }
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_LE(testing::rel_diff(mine[i], reference[i]), 1e-6) << "parameter " << i;
}

TEST(DropIn, SequentialGoesThroughForward) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    torch::nn::Sequential seq(torch::nn::Linear(5, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
    OSS oss(seq->parameters(), optimizer<optim::SGD>(optim::SGDOptions(0.1)), g);
    ShardedDDP ddp(seq, oss);  // the holder as given; every rank starts from rank 0's values
    ASSERT_EQ(ddp.module().get(), seq.ptr().get());
    auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
    expect_ddp_result_through_forward(ddp, oss, seq->parameters(), ref->parameters(),
                                      [&](const at::Tensor& x) { return ref->forward(x); }, *g);
  });
}

// A module whose forward is a template: forward(x) calls it with the tensor.
struct TemplateForward : torch::nn::Module {
  TemplateForward() { fc = register_module("fc", torch::nn::Linear(5, 3)); }
  template <class T>
  at::Tensor forward(T&& x) { return fc->forward(std::forward<T>(x)); }
  torch::nn::Linear fc{nullptr};
};

// One whose template forward takes no single tensor: forward() names pre_forward().
struct PairForward : torch::nn::Module {
  PairForward() { fc = register_module("fc", torch::nn::Linear(5, 3)); }
  template <class A, class B>
  at::Tensor forward(A&& a, B&& b) { return fc->forward(a + b); }
  torch::nn::Linear fc{nullptr};
};

TEST(DropIn, TemplateForwardTakingATensorGoesThroughForward) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<TemplateForward>();
    OSS oss(net->parameters(), optimizer<optim::SGD>(optim::SGDOptions(0.1)), g);
    ShardedDDP ddp(net, oss);  // every rank starts from rank 0's values
    auto ref = torch::nn::Linear(5, 3);
    {
      at::NoGradGuard no_grad;
      ref->weight.copy_(net->fc->weight);
      ref->bias.copy_(net->fc->bias);
    }
    expect_ddp_result_through_forward(ddp, oss, {net->fc->weight, net->fc->bias}, {ref->weight, ref->bias},
                                      [&](const at::Tensor& x) { return ref->forward(x); }, *g);

    auto pair = std::make_shared<PairForward>();
    OSS pair_oss(pair->parameters(), optimizer<optim::SGD>(optim::SGDOptions(0.1)), g);
    ShardedDDP pair_ddp(pair, pair_oss);
    auto x = torch::randn({2, 5});
    try {
      pair_ddp.forward(x, x);
      ADD_FAILURE() << "forward() of a module it cannot call must fail";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("call pre_forward() and then the module"), std::string::npos) << e.what();
    }
    pair_ddp.pre_forward();  // the documented way
    EXPECT_EQ(pair->forward(x, x).size(1), 3);
  });
}

// Unfreezing a parameter between backward and step: it had no gradient in that backward and is
// not laid out as trainable yet, so it waits for the next step on every rank, as a parameter
// without a gradient does under DDP; ranks never diverge (a stale zeroed gradient stays unused).
TEST(DropIn, UnfreezingBetweenBackwardAndStepWaitsForTheNextStep) {
  for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      Params ref = testing::clone_params(net->params);
      optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
      OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g, OSSOptions().partition(partition));
      ShardedDDP ddp(net, oss);
      for (int step = 0; step < 4; ++step) {
        const bool frozen_in_backward = step == 1;
        for (Params* q : {&ref, &net->params}) (*q)[0].requires_grad_(!frozen_in_backward);
        ref_opt.zero_grad(true);
        ddp.zero_grad(false);  // in place: an owner keeps a zeroed gradient
        auto data = testing::rank_data(step, g->rank(), 4);
        testing::loss(ref, data, 4).backward();
        testing::allreduce_grads(ref, *g);
        testing::loss_of(ddp.forward(data.x), data, 4).backward();
        for (Params* q : {&ref, &net->params}) (*q)[0].requires_grad_(true);  // unfrozen before the step
        ref_opt.step();
        oss.step();
        ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5)) << "after step " << step;
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// A model whose only parameter is split: no rank holds a whole gradient that shows whether the
// user cleared with module->zero_grad() (which split pieces are out of reach of) or not at all, so
// a second backward after such clearing is an error on every rank, not a silent divergence.
// Clearing through the OSS (which reaches the pieces) is fine.
struct OneTensor : torch::nn::Module {
  OneTensor() { w = register_parameter("w", testing::seeded_randn({8, 4}, 3).to(at::kDouble)); }
  at::Tensor forward(at::Tensor x) { return x.matmul(w); }
  at::Tensor w;
};

TEST(DropIn, AccumulationThatCannotBeToldFromClearingIsAnErrorOnEveryRank) {
  auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<OneTensor>();
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
            OSSOptions().partition(PartitionMode::kSplit));
    ShardedDDP ddp(net, oss);
    ASSERT_EQ(oss.owners(net->w).size(), 2u) << "w must be split for this test";
    auto x = testing::seeded_randn({3, 8}, 10 + g->rank()).to(at::kDouble);
    for (int step = 0; step < 2; ++step) {  // cleared through the OSS: fine
      oss.zero_grad();
      ddp.forward(x).sum().backward();
      oss.step();
    }
    net->zero_grad();  // does not reach the split pieces
    ddp.forward(x).sum().backward();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("cannot tell whether the gradients of the last backward were cleared"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// An Embedding made with sparse(true) gives sparse gradients, which ShardedDDP cannot reduce into
// buckets: every rank refuses it at construction, naming the parameter.
TEST(DropIn, SparseGradientsAreAnErrorOnEveryRankNamingTheParameter) {
  auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    torch::nn::Sequential seq(torch::nn::Linear(3, 4), torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)));
    OSS oss(seq->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(seq, oss);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("parameter '1.weight' gets sparse gradients"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// A forward with a parameter frozen (an evaluation pass, say) and one after unfreezing it, with
// no step between: the ranges are cut twice and come back; the optimizer state stays with them.
TEST(DropIn, TwoLayoutsWithoutAStepKeepTheOptimizerState) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    Params ref = testing::clone_params(net->params);
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
            OSSOptions().partition(PartitionMode::kSplit));
    ShardedDDP ddp(net, oss);
    for (int step = 0; step < 4; ++step) {
      auto data = testing::rank_data(step, g->rank(), 4);
      if (step >= 1) {
        net->params[2].requires_grad_(false);
        at::NoGradGuard no_grad;
        ddp.forward(data.x);  // lays out without w2
        net->params[2].requires_grad_(true);
      }
      ref_opt.zero_grad(true);
      ddp.zero_grad(true);
      testing::loss(ref, data, 4).backward();
      testing::allreduce_grads(ref, *g);
      testing::loss_of(ddp.forward(data.x), data, 4).backward();  // lays out with w2 again
      ref_opt.step();
      oss.step();
      ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5)) << "after step " << step;
    }
  });
}

// A parameter an OSS holds beside the module's (used in the loss outside the module), frozen at
// construction and unfrozen later, trains like the module's own.
TEST(DropIn, AParameterOutsideTheModuleFrozenThenUnfrozenTrains) {
  for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      at::Tensor extra = (at::ones({3}) * 0.5).requires_grad_(false);
      Params ref = testing::clone_params(net->params);
      at::Tensor ref_extra = extra.detach().clone();
      ref.push_back(ref_extra);
      optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
      Params mine = net->parameters();
      mine.push_back(extra);
      OSS oss(mine, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g, OSSOptions().partition(partition));
      ShardedDDP ddp(net, oss);
      for (int step = 0; step < 4; ++step) {
        if (step == 2) extra.requires_grad_(true), ref.back().requires_grad_(true);
        auto data = testing::rank_data(step, g->rank(), 4);
        ref_opt.zero_grad(true);
        ddp.zero_grad(true);
        oss.zero_grad(true);
        Params ref_model(ref.begin(), ref.end() - 1);
        (testing::loss_of(testing::output(ref_model, data.x) * ref.back(), data, 4)).backward();
        testing::allreduce_grads(ref, *g);
        testing::loss_of(ddp.forward(data.x) * extra, data, 4).backward();
        ref_opt.step();
        oss.step();
        Params got = net->parameters();
        got.push_back(extra);
        ASSERT_TRUE(testing::matches_reference(got, ref, *g, 1e-5)) << "after step " << step;
      }
      EXPECT_FALSE(extra.equal(at::ones({3}) * 0.5)) << "the parameter outside the module never trained";
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
