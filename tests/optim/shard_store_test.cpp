// The shard store (Note [State slabs] in csrc/optim/state_slabs.cpp): the optimizer state each
// rank holds lives in one flat slab per kind of state, the tensors torch::optim sees are views
// into them with the values an unsharded torch::optim holds, the fused pass over a run of the
// slab equals the per-tensor step bit for bit, a new layout moves exactly the state whose
// holder changed, state that moves arrives whole in payload pieces, mixed precision's masters
// live in a slab beside their state, adjacent parameters step as one segment, and the gradients
// a rank owns live in its gradient slab.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/fused_step.h>
#include <shardopt/optim/oss.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim.h>

#include <functional>
#include <map>
#include <string>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::Introspection;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

// A chain x -> tanh(x W^T + b) of four layers with uneven widths: 8 tensors of 3 to 2,640
// elements, so that split ranges cut tensors and whole parameters leave gaps.
const std::vector<int64_t> kWidths = {12, 40, 66, 9, 3};

Params make_chain() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);  // the same on every rank (thread)
  Params p;
  for (size_t l = 0; l + 1 < kWidths.size(); ++l) {
    p.push_back((at::randn({kWidths[l + 1], kWidths[l]}, gen) * 0.3).requires_grad_());
    p.push_back((at::randn({kWidths[l + 1]}, gen) * 0.1).requires_grad_());
  }
  return p;
}

at::Tensor chain(const Params& p, at::Tensor h) {
  for (size_t l = 0; l < p.size(); l += 2) h = at::tanh(at::addmm(p[l + 1], h, p[l].t()));
  return h;
}

std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + rank + 1);
  return {at::randn({5, kWidths.front()}, gen), at::randn({5, kWidths.back()}, gen)};
}

// The per-element state tensors of one torch::optim state, by PyTorch's names, read here from the
// state classes themselves.
std::map<std::string, at::Tensor> state_tensors(const optim::OptimizerParamState& state) {
  std::map<std::string, at::Tensor> out;
  auto put = [&](const char* name, const at::Tensor& t) {
    if (t.defined()) out[name] = t;
  };
  if (const auto* a = dynamic_cast<const optim::AdamParamState*>(&state)) {
    put("exp_avg", a->exp_avg()), put("exp_avg_sq", a->exp_avg_sq()), put("max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (const auto* w = dynamic_cast<const optim::AdamWParamState*>(&state)) {
    put("exp_avg", w->exp_avg()), put("exp_avg_sq", w->exp_avg_sq()), put("max_exp_avg_sq", w->max_exp_avg_sq());
  } else if (const auto* s = dynamic_cast<const optim::SGDParamState*>(&state)) {
    put("momentum_buffer", s->momentum_buffer());
  } else if (const auto* r = dynamic_cast<const optim::RMSpropParamState*>(&state)) {
    put("square_avg", r->square_avg()), put("momentum_buffer", r->momentum_buffer()), put("grad_avg", r->grad_avg());
  }
  return out;
}

struct Case {
  const char* name;
  std::function<std::unique_ptr<optim::Optimizer>(const Params&)> reference;
  OptimizerFactory factory;
};

std::vector<Case> cases() {
  return {
      {"Adam with AMSGrad", [](const Params& p) { return std::make_unique<optim::Adam>(p, optim::AdamOptions(1e-2).amsgrad(true)); },
       optimizer<optim::Adam>(optim::AdamOptions(1e-2).amsgrad(true))},
      {"AdamW", [](const Params& p) { return std::make_unique<optim::AdamW>(p, optim::AdamWOptions(1e-2).weight_decay(0.1)); },
       optimizer<optim::AdamW>(optim::AdamWOptions(1e-2).weight_decay(0.1))},
      {"SGD with Nesterov momentum",
       [](const Params& p) { return std::make_unique<optim::SGD>(p, optim::SGDOptions(0.05).momentum(0.9).nesterov(true)); },
       optimizer<optim::SGD>(optim::SGDOptions(0.05).momentum(0.9).nesterov(true))},
      // Not fused: the wrapped optimizer's own step makes the state, and the store adopts it.
      {"RMSprop, centered with momentum",
       [](const Params& p) { return std::make_unique<optim::RMSprop>(p, optim::RMSpropOptions(1e-2).centered(true).momentum(0.5)); },
       optimizer<optim::RMSprop>(optim::RMSpropOptions(1e-2).centered(true).momentum(0.5))},
  };
}

// Every state tensor this rank holds is a view into the slab of its kind at its holding's slot,
// and equals the reference optimizer's state over the holding's range. Returns the number of
// kept (frozen) holdings with state here.
int check_state_in_slabs(const OSS& oss, optim::Optimizer& reference, const Params& ref, const std::string& where) {
  const int rank = oss.process_group().rank();
  int kept = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    for (const auto& h : Introspection::holdings(oss, i)) {
      if (h.rank != rank) continue;
      auto mine = Introspection::local_optimizer(const_cast<OSS&>(oss)).state().find(h.tensor.unsafeGetTensorImpl());
      if (mine == Introspection::local_optimizer(const_cast<OSS&>(oss)).state().end()) continue;
      auto theirs = reference.state().find(ref[i].unsafeGetTensorImpl());
      EXPECT_NE(theirs, reference.state().end()) << where << ": rank " << rank << " holds state of parameter " << i
                                                 << " that the reference never made";
      const auto slot = Introspection::state_slot(oss, h.tensor);
      EXPECT_TRUE(slot.has_value()) << where << ": parameter " << i << " has state but no slot";
      if (!slot || theirs == reference.state().end()) continue;
      kept += slot->kept ? 1 : 0;
      const auto expected = state_tensors(*theirs->second);
      const auto actual = state_tensors(*mine->second);
      EXPECT_EQ(actual.size(), expected.size()) << where << ": parameter " << i;
      for (const auto& [kind, t] : actual) {
        const at::Tensor slab = Introspection::state_slab(oss, slot->group, kind);
        EXPECT_TRUE(slab.defined() && t.storage().is_alias_of(slab.storage()) &&
                    t.storage_offset() == slab.storage_offset() + slot->offset && t.is_contiguous())
            << where << ": rank " << rank << ", " << kind << " of parameter " << i << " is not a view of its slab";
        const at::Tensor want = expected.at(kind).reshape(-1).narrow(0, h.in_param.begin, h.in_param.size());
        EXPECT_LE(testing::rel_diff(t.reshape(-1), want), 1e-5)
            << where << ": rank " << rank << ", " << kind << " of parameter " << i << " differs from torch::optim's";
      }
    }
  }
  return kept;
}

void train_and_check(const Case& c, int world, PartitionMode mode) {
  run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_chain();
    Params ref = testing::clone_params(params);
    auto ref_opt = c.reference(ref);
    OSS oss(params, c.factory, g, OSSOptions().partition(mode));
    const std::string where = std::string(c.name) + " at world " + std::to_string(world) +
                              (mode == PartitionMode::kSplit ? ", split" : ", whole parameters");
    int kept_seen = 0;
    for (int step = 0; step < 6; ++step) {
      const bool frozen = step == 2 || step == 3;  // the first layer, frozen for two steps
      for (Params* q : {&params, &ref}) (*q)[0].requires_grad_(!frozen), (*q)[1].requires_grad_(!frozen);
      const auto [x, y] = batch(step, g->rank());
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(x, *g)) << where;
      oss.zero_grad();
      ref_opt->zero_grad();
      at::mse_loss(chain(params, x), y).backward();
      at::mse_loss(chain(ref, x), y).backward();
      testing::allreduce_grads(params, *g);
      testing::allreduce_grads(ref, *g);
      ref_opt->step();
      oss.step();
      ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << where << ", step " << step;
      kept_seen += check_state_in_slabs(oss, *ref_opt, ref, where + ", step " + std::to_string(step));
    }
    // The first layer's kept state had a slot of its own while it was frozen, on some rank.
    at::Tensor kept = at::full({1}, kept_seen, at::kLong);
    g->allreduce(kept);
    EXPECT_GT(kept.item<int64_t>(), 0) << where;
  });
}

TEST(ShardStore, StateTensorsAreViewsOfOneSlabPerKindWithTorchOptimsValues) {
  for (const auto& c : cases()) {
    for (int world : {2, 3}) {
      for (PartitionMode mode : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
        train_and_check(c, world, mode);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// Two groups with different options, one tensor over 100k elements (several chunks on each
// thread), and a parameter frozen for two steps, so that its step count differs from the
// others': OSS steps runs of equal options and step count over the slab in one pass each; the
// reference steps each tensor alone, with its own optimizer.
TEST(ShardStore, FusedPassOverTheSlabEqualsThePerTensorStepBitForBit) {
  const std::vector<std::vector<int64_t>> shapes = {{300, 350}, {350}, {7}, {64, 9}, {1}, {33, 3}};
  for (bool sgd : {false, true}) {
    for (int threads : {1, 2}) {
      run_ranks(1, [&](std::shared_ptr<ProcessGroup> g) {
        at::set_num_threads(threads);  // this thread's team (OpenMP's setting is per thread)
        auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
        Params params, ref;
        for (const auto& s : shapes) params.push_back(at::randn(s, gen).requires_grad_());
        ref = testing::clone_params(params);
        auto options = [&](size_t group) -> std::unique_ptr<optim::OptimizerOptions> {
          if (sgd) return std::make_unique<optim::SGDOptions>(optim::SGDOptions(0.01 * (group + 1)).momentum(0.9).weight_decay(0.01 * group));
          return std::make_unique<optim::AdamWOptions>(optim::AdamWOptions(1e-3 * (group + 1)).weight_decay(0.1).amsgrad(group == 1));
        };
        std::vector<optim::OptimizerParamGroup> groups;
        groups.emplace_back(Params(params.begin(), params.begin() + 3), options(0));
        groups.emplace_back(Params(params.begin() + 3, params.end()), options(1));
        OptimizerFactory factory = sgd ? optimizer<optim::SGD>(optim::SGDOptions(0.01)) : optimizer<optim::AdamW>(optim::AdamWOptions(1e-3));
        OSS oss(groups, factory, g);
        std::vector<std::unique_ptr<optim::Optimizer>> per_tensor;
        for (size_t i = 0; i < ref.size(); ++i) {
          std::vector<optim::OptimizerParamGroup> one;
          one.emplace_back(Params{ref[i]}, options(i < 3 ? 0 : 1));
          if (sgd) {
            per_tensor.push_back(std::make_unique<optim::SGD>(one, optim::SGDOptions(0.01)));
          } else {
            per_tensor.push_back(std::make_unique<optim::AdamW>(one, optim::AdamWOptions(1e-3)));
          }
        }
        for (int step = 0; step < 5; ++step) {
          const bool frozen = step == 1 || step == 2;
          params[3].requires_grad_(!frozen), ref[3].requires_grad_(!frozen);
          for (size_t i = 0; i < params.size(); ++i) {
            params[i].mutable_grad() = params[i].requires_grad() ? at::randn(shapes[i], gen) : at::Tensor();
            ref[i].mutable_grad() = params[i].grad().defined() ? params[i].grad().clone() : at::Tensor();
          }
          oss.step();
          ASSERT_TRUE(Introspection::stepped_fused(oss));
          for (auto& opt : per_tensor) {
            ASSERT_EQ(fused_step_unsupported(*opt), "");
            fused_step(*opt);
          }
          for (size_t i = 0; i < params.size(); ++i) {
            ASSERT_TRUE(at::equal(params[i], ref[i])) << (sgd ? "SGD" : "AdamW") << " on " << threads
                                                      << " threads: parameter " << i << " after step " << step;
          }
        }
      });
    }
  }
}

// Freezing the first two layers changes who holds what (split: the trainable and the kept runs are
// cut again; whole: the partition rebalances). The bytes sent and received are exactly Adam's 8
// bytes per element whose holder changed.
TEST(ShardStore, ANewLayoutMovesExactlyTheStateWhoseHolderChanged) {
  for (PartitionMode mode : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
      Params params = make_chain();
      OSS oss(params, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
              OSSOptions().partition(mode).rebalance_threshold(0.0));
      auto step = [&](int s) {
        const auto [x, y] = batch(s, g->rank());
        oss.zero_grad();
        at::mse_loss(chain(params, x), y).backward();
        testing::allreduce_grads(params, *g);
        oss.step();
      };
      step(0), step(1);
      const auto before = Introspection::state_holders(oss);
      const int64_t moves = Introspection::state_moves(oss);
      for (int k = 0; k < 4; ++k) params[k].requires_grad_(false);
      step(2);
      const auto after = Introspection::state_holders(oss);
      const int64_t changed = Introspection::holders_changed(before, after);
      const char* where = mode == PartitionMode::kSplit ? "split" : "whole parameters";
      ASSERT_GT(changed, 0) << where << ": the freeze should change some holders";
      ASSERT_EQ(Introspection::state_moves(oss), moves + 1) << where;
      at::Tensor bytes = at::tensor({oss.last_rebalance().state_bytes_sent, oss.last_rebalance().state_bytes_received});
      g->allreduce(bytes);
      EXPECT_EQ(bytes[0].item<int64_t>(), 8 * changed) << where << ": bytes sent";
      EXPECT_EQ(bytes[1].item<int64_t>(), 8 * changed) << where << ": bytes received";
    });
  }
}

// A freeze and an unfreeze lay the parameters and the state out again inside the memory they
// already hold (Note [Moving ranges in place] in csrc/optim/buffer_moves.h), so a run that
// freezes never holds the model or its state twice: the parameter buffer and each state slab
// keep their memory wherever the new layout fits in it, and the parameters stay those of a plain
// torch::optim::Adam stepping the ranks' averaged gradients.
TEST(ShardStore, AFreezeMovesParametersAndStateInsideTheMemoryTheyHold) {
  for (PartitionMode mode : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
      const char* where = mode == PartitionMode::kSplit ? "split" : "whole parameters";
      Params params = make_chain();
      Params ref = make_chain();
      OSS oss(params, optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
              OSSOptions().partition(mode).rebalance_threshold(0.0));
      optim::Adam plain(ref, optim::AdamOptions(1e-2));
      int in_place = 0, assembled = 0;
      for (int s = 0; s < 6; ++s) {
        const bool frozen = s == 2 || s == 3;
        // The memory each parameter's buffer and this rank's first state slab live in, and room.
        const void* param_memory = params[0].storage().data();
        const at::Tensor slab = Introspection::state_slab(oss, 0, "exp_avg");
        const void* slab_memory = slab.defined() ? slab.storage().data() : nullptr;
        const int64_t slab_room = slab.defined() ? static_cast<int64_t>(slab.storage().nbytes()) : 0;
        for (int k = 0; k < 4; ++k) params[k].requires_grad_(!frozen), ref[k].requires_grad_(!frozen);
        const auto [x, y] = batch(s, g->rank());
        if (s == 0) ASSERT_TRUE(testing::differs_across_ranks(x, *g)) << where;
        oss.zero_grad();
        at::mse_loss(chain(params, x), y).backward();
        testing::allreduce_grads(params, *g);
        plain.zero_grad();
        for (size_t i = 0; i < params.size(); ++i) {
          if (params[i].grad().defined()) ref[i].mutable_grad() = params[i].grad().clone();
        }
        oss.step();
        plain.step();
        ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << where << ", step " << s;
        for (size_t i = 0; i < params.size(); ++i) {
          ASSERT_EQ(params[i].storage().data(), param_memory)
              << where << ", step " << s << ": parameter " << i << " left the buffer's memory";
        }
        const at::Tensor now = Introspection::state_slab(oss, 0, "exp_avg");
        if (slab_memory && now.defined() && static_cast<int64_t>(now.nbytes()) <= slab_room) {
          ASSERT_EQ(now.storage().data(), slab_memory) << where << ", step " << s << ": the new slab fitted in the old";
          in_place += s == 2 || s == 4;
          // The state that stayed on this rank moved inside the slab, whole holdings and the
          // slices of holdings assembled from several alike: only what arrived was copied (Note
          // [State lands in its slot]).
          const RebalanceStats moved = oss.last_rebalance();
          if (s == 2 || s == 4) {
            EXPECT_EQ(moved.state_bytes_copied, moved.state_bytes_received) << where << ", step " << s;
            assembled += moved.state_bytes_received > 0;
          }
        }
      }
      EXPECT_GT(in_place, 0) << where << ": no new layout fitted in the old slab";
      if (mode == PartitionMode::kSplit) {  // (whole parameters: state arrives on some ranks only)
        EXPECT_GT(assembled, 0) << where << ": no state arrived where a layout fitted in the old slab";
      }
    });
  }
}

// State that changes rank travels in payload pieces of at most 8 MiB (Note [State moves without
// pickling] in csrc/optim/state_migration.cpp), made one at a time from views of the old holdings
// (Note [Slices as views]): with two layers of three million elements, a freeze sends more
// than one piece (a tensor straddles the pieces' edge), and the parameters, the master weights
// included, stay those of a plain torch::optim::Adam through the freeze and the unfreeze.
TEST(ShardStore, StateThatMovesInManyPayloadPiecesArrivesWhole) {
  for (bool mixed : {false, true}) {
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
      auto make = [&] {
        Params p;
        for (auto [out, in] : {std::pair<int64_t, int64_t>{3000, 1000}, {1000, 3000}, {3, 1000}}) {
          p.push_back((at::randn({out, in}, gen) * 0.03).requires_grad_());
          p.push_back((at::randn({out}, gen) * 0.1).requires_grad_());
        }
        return p;
      };
      Params params = make();
      gen = at::make_generator<at::CPUGeneratorImpl>(9);
      Params ref = make();  // fp32 weights
      if (mixed) {
        for (size_t i = 0; i < params.size(); ++i) {
          params[i] = params[i].detach().to(at::kBFloat16).requires_grad_();
          ref[i] = params[i].detach().to(at::kFloat).requires_grad_();
        }
      }
      auto options = OSSOptions().partition(PartitionMode::kSplit);
      if (mixed) options.mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
      OSS oss(params, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g, options);
      optim::Adam plain(ref, optim::AdamOptions(1e-3));
      const char* where = mixed ? "bf16 parameters" : "fp32";
      int64_t most_sent = 0;
      for (int s = 0; s < 5; ++s) {
        const bool frozen = s == 2 || s == 3;
        for (int k = 0; k < 2; ++k) params[k].requires_grad_(!frozen), ref[k].requires_grad_(!frozen);
        auto data = at::make_generator<at::CPUGeneratorImpl>(100 * s + g->rank() + 1);
        const at::Tensor x = at::randn({4, 1000}, data), y = at::randn({4, 3}, data);
        if (s == 0) ASSERT_TRUE(testing::differs_across_ranks(x, *g)) << where;
        oss.zero_grad();
        const at::Tensor out = mixed ? chain(params, x.to(at::kBFloat16)).to(at::kFloat) : chain(params, x);
        at::mse_loss(out, y).backward();
        testing::allreduce_grads(params, *g);
        oss.step();
        at::Tensor sent = at::tensor({oss.last_rebalance().state_bytes_sent});
        g->allreduce(sent, Reduction::kMax);
        most_sent = std::max(most_sent, sent.item<int64_t>());
        // The reference steps fp32 weights with the same averaged gradients, widened; under mixed
        // precision the parameters are its weights rounded to bf16 (to within a bf16 step).
        plain.zero_grad();
        for (size_t i = 0; i < params.size(); ++i) {
          if (params[i].grad().defined()) ref[i].mutable_grad() = params[i].grad().to(at::kFloat);
        }
        plain.step();
        Params got;
        for (const auto& p : params) got.push_back(p.detach().to(at::kFloat));
        ASSERT_TRUE(testing::matches_reference(got, ref, *g, mixed ? 4e-3 : 1e-6)) << where << ", step " << s;
      }
      EXPECT_GT(most_sent, int64_t{8} << 20) << where << ": the freeze should send more than one piece";
    });
  }
}

// Mixed precision: each master a rank steps (the fp32 tensor keying its state) is a view of its
// group's master slab at the same offset as its state, through a freeze, a re-partition and an
// unfreeze, and it is the live master: the bf16 parameter is it rounded.
TEST(ShardStore, MastersLiveInASlabAtTheirStatesOffsets) {
  for (PartitionMode mode : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    for (int world : {2, 3}) {
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        Params params = make_chain();
        OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(1e-2)), g,
                OSSOptions().partition(mode).rebalance_threshold(0.0).mixed_precision(
                    MixedPrecision().param_dtype(at::kBFloat16)));
        const std::string where = std::string(mode == PartitionMode::kSplit ? "split" : "whole") + " at world " +
                                  std::to_string(world);
        int64_t in_slab = 0;
        for (int s = 0; s < 6; ++s) {
          const bool frozen = s == 2 || s == 3;
          for (int k = 0; k < 4; ++k) params[k].requires_grad_(!frozen);
          const auto [x, y] = batch(s, g->rank());
          oss.zero_grad();
          at::mse_loss(chain(params, x.to(at::kBFloat16)).to(at::kFloat), y).backward();
          testing::allreduce_grads(params, *g);
          oss.step();
          for (size_t i = 0; i < params.size(); ++i) {
            for (const auto& h : Introspection::holdings(oss, i)) {
              if (h.rank != g->rank()) continue;
              ASSERT_EQ(h.tensor.scalar_type(), at::kFloat) << where;
              const auto slot = Introspection::state_slot(oss, h.tensor);
              if (!slot) continue;
              const at::Tensor slab = Introspection::state_slab(oss, slot->group, "master");
              const at::Tensor exp_avg = Introspection::state_slab(oss, slot->group, "exp_avg");
              ASSERT_TRUE(slab.defined() && h.tensor.storage().is_alias_of(slab.storage()) &&
                          h.tensor.storage_offset() == slab.storage_offset() + slot->offset && h.tensor.is_contiguous())
                  << where << ", step " << s << ": the master of parameter " << i << " is not a view of its slab";
              ASSERT_EQ(slab.numel(), exp_avg.numel()) << where;
              const at::Tensor rounded = h.tensor.reshape(-1).to(at::kBFloat16);
              const at::Tensor param = params[i].detach().reshape(-1).narrow(0, h.in_param.begin, h.in_param.size());
              ASSERT_TRUE(at::equal(rounded, param)) << where << ", step " << s << ": parameter " << i
                                                     << " is not its master rounded";
              ++in_slab;
            }
          }
        }
        EXPECT_GT(in_slab, 0) << where;
      });
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// A Sequential of three Linear layers (5 -> 16 -> 16 -> 3, tanh between), its values drawn from
// `seed`: the same on every rank.
torch::nn::Sequential small_net(uint64_t seed) {
  auto made = torch::nn::Sequential(torch::nn::Linear(5, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                                    torch::nn::Tanh(), torch::nn::Linear(16, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

// Under ShardedDDP a rank's gradients sit in its buckets in the order of its shard, so the fused
// step joins adjacent parameters into one segment (one CUDA launch each: Note [Adjacent tensors in
// one pass]). With one bucket per rank that is one segment; with one bucket per parameter, one per
// holding. Both give the same bits (two ranks: each reduced element is one addition), and follow
// plain torch::optim::AdamW.
TEST(ShardStore, AdjacentParametersStepAsOneSegmentWithTheSameBits) {
  for (PartitionMode mode : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    Params final_params[2];
    for (int per_param = 0; per_param < 2; ++per_param) {
      const std::string where = std::string(mode == PartitionMode::kSplit ? "split" : "whole") +
                                (per_param ? ", a bucket per parameter" : ", one bucket");
      run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = small_net(7), ref_net = small_net(7);
        Params ref = ref_net->parameters();
        optim::AdamW ref_opt(ref, optim::AdamWOptions(1e-2).weight_decay(0.1));
        OSS oss(net->parameters(), optimizer<optim::AdamW>(optim::AdamWOptions(1e-2).weight_decay(0.1)), g,
                OSSOptions().partition(mode));
        // (1 byte: every parameter passes it, so each is a bucket of its own, a row bucket included)
        ShardedDDP ddp(net.ptr(), oss,
                       ShardedDDPOptions().reduce_bucket_bytes(per_param ? 1 : 1 << 20).bucket_bytes_per_rank(0));
        for (int step = 0; step < 4; ++step) {
          const auto data = testing::rank_data(step, g->rank(), 3);
          if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << where;
          ddp.zero_grad();
          testing::loss_of(ddp.forward(data.x), data, 3).backward();
          oss.step();
          int64_t held = 0;
          for (size_t i = 0; i < ref.size(); ++i) {
            for (const auto& h : Introspection::holdings(oss, i)) held += h.rank == g->rank() ? 1 : 0;
          }
          ASSERT_TRUE(Introspection::stepped_fused(oss)) << where;
          EXPECT_EQ(Introspection::fused_segments(oss), per_param ? held : std::min<int64_t>(held, 1))
              << where << ", rank " << g->rank() << ", step " << step << " (" << held << " holdings)";
          ref_opt.zero_grad(true);
          testing::loss_of(ref_net->forward(data.x), data, 3).backward();
          testing::allreduce_grads(ref, *g);
          ref_opt.step();
          ASSERT_TRUE(testing::matches_reference(net->parameters(), ref, *g, 1e-5)) << where << ", step " << step;
        }
        if (g->rank() == 0) final_params[per_param] = testing::clone_params(net->parameters());
      });
      if (::testing::Test::HasFatalFailure()) return;
    }
    for (size_t i = 0; i < final_params[0].size(); ++i) {
      EXPECT_TRUE(at::equal(final_params[0][i], final_params[1][i])) << "parameter " << i;
    }
  }
}


// The reduced gradients a rank owns live in ShardedDDP's gradient slab (Note [Gradient slab]): one
// allocation per layout, kept from step to step whether gradients are set to none or zeroed in
// place, a new one after a freeze lays the model out anew. Whatever the clearing, training follows
// plain torch::optim::AdamW.
TEST(ShardStore, OwnedGradientsLiveInOneGradientSlabPerLayout) {
  for (PartitionMode mode : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    for (bool set_to_none : {true, false}) {
      const std::string where = std::string(mode == PartitionMode::kSplit ? "split" : "whole") +
                                (set_to_none ? ", gradients set to none" : ", gradients zeroed in place");
      run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = small_net(11), ref_net = small_net(11);
        Params params = net->parameters(), ref = ref_net->parameters();
        optim::AdamW ref_opt(ref, optim::AdamWOptions(1e-2).weight_decay(0.1));
        OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(1e-2).weight_decay(0.1)), g,
                OSSOptions().partition(mode));
        // 256-byte buckets: several per rank.
        ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().reduce_bucket_bytes(256));
        const void* first_slab = nullptr;
        for (int step = 0; step < 6; ++step) {
          const bool frozen = step >= 3;  // the first layer, from step 3 on: a new layout
          for (Params* q : {&params, &ref}) (*q)[0].requires_grad_(!frozen), (*q)[1].requires_grad_(!frozen);
          const auto data = testing::rank_data(step, g->rank(), 3);
          if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << where;
          ddp.zero_grad(set_to_none);
          testing::loss_of(ddp.forward(data.x), data, 3).backward();
          const at::Tensor slab = Introspection::grad_slab(ddp, 0, 0);
          ASSERT_TRUE(slab.defined()) << where << ", step " << step;
          const auto* begin = static_cast<const char*>(slab.data_ptr());
          const auto* end = begin + slab.nbytes();
          int owned = 0;
          for (size_t i = 0; i < params.size(); ++i) {
            if (!params[i].requires_grad() || !params[i].grad().defined()) continue;
            const auto* at = static_cast<const char*>(params[i].grad().data_ptr());
            EXPECT_TRUE(at >= begin && at + params[i].grad().nbytes() <= end)
                << where << ", rank " << g->rank() << ", step " << step << ": the gradient of parameter " << i
                << " is not in the gradient slab";
            ++owned;
          }
          // Split, a rank may own only ranges of parameters (gradients the store holds); every
          // rank owns whole parameters otherwise.
          at::Tensor owners = at::full({1}, owned > 0 ? 1 : 0, at::kLong);
          g->allreduce(owners);
          EXPECT_GE(owners.item<int64_t>(), mode == PartitionMode::kSplit ? 1 : 3)
              << where << ", step " << step << ": ranks with whole gradients";
          // One allocation per layout: the same slab for the steps of one trainable set.
          if (step == 0 || step == 3) first_slab = slab.data_ptr();
          EXPECT_EQ(slab.data_ptr(), first_slab) << where << ", step " << step << ": the slab was allocated again";
          oss.step();
          ref_opt.zero_grad(true);
          testing::loss_of(ref_net->forward(data.x), data, 3).backward();
          testing::allreduce_grads(ref, *g);
          ref_opt.step();
          ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << where << ", step " << step;
        }
      });
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
