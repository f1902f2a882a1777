// The parameter sync after a step per bucket, where other sharded optimizers went wrong: a
// forward that uses the buckets in another order than they are sent gets each layer's current
// weights, and waits for that layer's buckets only (stale weights when the bucket order differs
// from the forward's: Megatron-LM #950); every bucket's all-gather in flight at once lands in its
// own rows (a reused gather buffer overwritten in flight: Megatron-LM PR #4609); a freeze or a
// freeze while the sync is in flight waits for it; frozen parameters send nothing. Against
// plain torch::optim::AdamW on all-reduced gradients, each rank's data different.
#include <shardopt/comm/timeline.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

// An input layer, four 12 x 12 layers registered a, b, c, d, and an output layer. The forward
// uses them in the order in, c, a, d, b, out, and calls `before_use` before each.
struct OutOfOrder : torch::nn::Module {
  OutOfOrder() {
    layers.emplace("in", register_module("in", torch::nn::Linear(5, 12)));
    for (const char* name : {"a", "b", "c", "d"}) layers.emplace(name, register_module(name, torch::nn::Linear(12, 12)));
    layers.emplace("out", register_module("out", torch::nn::Linear(12, 3)));
    testing::fill_seeded(parameters(), 5);
  }
  at::Tensor forward(at::Tensor x) {
    for (const char* name : {"in", "c", "a", "d", "b"}) x = at::tanh(use(name, x));
    return use("out", x);
  }
  at::Tensor use(const std::string& name, const at::Tensor& x) {
    if (before_use) before_use(name, layers.at(name)->parameters());
    return layers.at(name)->forward(x);
  }
  static std::vector<std::string> forward_order() { return {"in", "c", "a", "d", "b", "out"}; }
  std::map<std::string, torch::nn::Linear> layers;
  std::function<void(const std::string&, const Params&)> before_use;
};

OptimizerFactory adamw() { return optimizer<optim::AdamW>(optim::AdamWOptions(1e-2).weight_decay(0.01)); }

// The reference's step: this rank's loss, gradients averaged over the group, AdamW.
void reference_step(OutOfOrder& ref, optim::AdamW& opt, const testing::Data& data, ProcessGroup& g) {
  opt.zero_grad(true);
  testing::loss_of(ref.forward(data.x), data, 3).backward();
  Params ps = ref.parameters();
  for (auto& p : ps) {
    if (!p.requires_grad()) p.mutable_grad().reset();
  }
  testing::allreduce_grads(ps, g);
  opt.step();
}

void copy_into(const Params& from, const Params& to) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
}

// Whether `ok` holds on every rank (one all-reduce on each).
bool on_every_rank(bool ok, ProcessGroup& g) {
  at::Tensor failing = at::full({1}, ok ? 0.0 : 1.0, at::kDouble);
  g.allreduce(failing);
  return failing.item<double>() == 0;
}

// The buckets that hold a piece of one of `params` in OSS's layout.
std::set<int64_t> buckets_of(const OSS& oss, const Params& params) {
  std::set<int64_t> out;
  for (const auto& p : params) {
    const size_t i = testing::Introspection::index_of(oss, p);
    for (size_t piece : oss.layout().pieces_of(i)) out.insert(oss.layout().pieces()[piece].bucket);
  }
  out.erase(-1);
  return out;
}

struct Event {
  int64_t begin = 0, end = 0;
};

// Each rank's events by name, the last of each name.
std::map<int, std::map<std::string, Event>> read_trace(const std::string& path) {
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::map<int, std::map<std::string, Event>> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const int64_t ts = e.at("ts"), dur = e.at("dur");
    out[e.at("pid").get<int>()][e.at("name").get<std::string>()] = {ts, ts + dur};
  }
  return out;
}

// Megatron-LM #950: its forward waited for the buckets in the order it assumed, not for the ones
// holding the layer it was about to use, and read stale weights where the two orders differed.
// Here each layer, used in an order that is neither the buckets' nor the registration's, reads
// the reference's weights of the last step; and from the timeline, every bucket holding a piece
// of a layer was seen complete before that layer ran, while the buckets of layers used later
// were not yet waited for when the first layer ran.
TEST(SyncPitfalls, AForwardThatUsesTheBucketsInAnotherOrderWaitsForEachLayersOwn) {
  const std::string dir = testing::temp_dir("sync-pitfalls");
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::string path = dir + "/world" + std::to_string(world) + ".json";
    std::map<std::string, std::set<int64_t>> buckets;  // rank 0's: each layer's buckets
    // The last of each event: the last step's syncs, and the uses of the forward after it.
    timeline::start();
    testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<OutOfOrder>(), ref = std::make_shared<OutOfOrder>();
      optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(1e-2).weight_decay(0.01));
      OSS oss(net->parameters(), adamw(), g, OSSOptions().partition(PartitionMode::kSplit));
      ShardedDDP ddp(net, oss,
                     ShardedDDPOptions().reduce_bucket_bytes(512).bucket_bytes_per_rank(0).overlap_param_sync(true));
      copy_into(net->parameters(), ref->parameters());  // rank 0's values, which ShardedDDP synced
      std::string stale;  // the first layer this rank used with other weights than the reference's
      net->before_use = [&](const std::string& name, const Params& ps) {
        ddp.wait_param_sync(ps);
        timeline::record(timeline::Lane::kCompute, "use " + name, g->rank(), timeline::now_us(), timeline::now_us());
        const Params theirs = ref->layers.at(name)->parameters();
        for (size_t k = 0; k < ps.size() && stale.empty(); ++k) {
          const double d = testing::rel_diff(ps[k], theirs[k]);
          if (!(d <= 1e-5)) stale = name + " (by " + std::to_string(d) + ")";
        }
      };
      // Steps 0 .. kSteps; the trace keeps the last of each event: the syncs of step kSteps - 1 and
      // the uses of the forward after them.
      constexpr int kSteps = 5;
      for (int step = 0; step <= kSteps; ++step) {
        const auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        ddp.zero_grad();
        ddp.pre_forward(/*finish_sync=*/false);
        at::Tensor out = net->forward(data.x);
        ASSERT_TRUE(on_every_rank(stale.empty(), *g)) << "step " << step << ": a layer read stale weights: " << stale;
        if (step == kSteps) {  // every rank's last forward is recorded (the all-reduce above): stop
          if (g->rank() == 0) timeline::stop();
          ASSERT_TRUE(on_every_rank(true, *g));
        }
        testing::loss_of(out, data, 3).backward();
        oss.step();
        EXPECT_TRUE(testing::Introspection::param_sync_in_flight(oss)) << "the sync is left to the next forward";
        reference_step(*ref, ref_opt, data, *g);
      }
      ddp.finish_param_sync();
      if (g->rank() == 0) {
        for (const auto& name : OutOfOrder::forward_order()) buckets[name] = buckets_of(oss, net->layers.at(name)->parameters());
      }
      EXPECT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5));
    });
    timeline::write(path);
    const auto events = read_trace(path);
    ASSERT_EQ(events.size(), static_cast<size_t>(world));
    std::set<int64_t> all;
    for (const auto& [name, ks] : buckets) {
      ASSERT_FALSE(ks.empty()) << name << " is in no bucket";
      all.insert(ks.begin(), ks.end());
    }
    ASSERT_GE(all.size(), 4u) << "the test needs the layers in buckets of their own";
    for (const auto& [rank, named] : events) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      const std::string first = OutOfOrder::forward_order().front();
      ASSERT_TRUE(named.count("use " + first));
      const int64_t first_use = named.at("use " + first).begin;
      size_t later = 0;  // buckets not yet seen complete when the first layer ran
      for (const auto& [name, ks] : buckets) {
        ASSERT_TRUE(named.count("use " + name)) << name;
        const int64_t used = named.at("use " + name).begin;
        for (int64_t k : ks) {
          const std::string sync = "bucket " + std::to_string(k) + " all-gather";
          ASSERT_TRUE(named.count(sync)) << sync;
          EXPECT_LE(named.at(sync).end, used) << name << " ran before " << sync << " was complete";
          later += named.at(sync).end > first_use;
        }
      }
      EXPECT_GT(later, 0u) << "every bucket was waited for before the first layer ran";
    }
  }
  testing::remove_tree(dir);
}

// One step of `net` through `ddp` and of the reference, from the same data.
void train_step(OutOfOrder& net, ShardedDDP& ddp, OSS& oss, OutOfOrder& ref, optim::AdamW& ref_opt, int step,
                ProcessGroup& g) {
  const auto data = testing::rank_data(step, g.rank(), 3);
  ddp.zero_grad();
  testing::loss_of(ddp.forward(data.x), data, 3).backward();
  oss.step();
  reference_step(ref, ref_opt, data, g);
}

void freeze(OutOfOrder& net, const std::vector<std::string>& names, bool frozen) {
  for (const auto& name : names) {
    for (auto& p : net.layers.at(name)->parameters()) p.requires_grad_(!frozen);
  }
}

// Megatron-LM PR #4609: a gather buffer reused while its all-gather was still in flight. Here
// every bucket's all-gather is in flight at once after the step (nothing waits for them until the
// parameters are read), the buckets stepped one after another, or in the backward, and each lands
// in its own rows: every rank ends with the reference's parameters.
TEST(SyncPitfalls, EveryBucketsAllGatherInFlightAtOnceLandsInItsOwnRows) {
  for (bool in_backward : {false, true}) {
    for (int world : {2, 3, 4}) {
      SCOPED_TRACE("world " + std::to_string(world) + (in_backward ? ", stepped in the backward" : ""));
      testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = std::make_shared<OutOfOrder>(), ref = std::make_shared<OutOfOrder>();
        optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(1e-2).weight_decay(0.01));
        OSS oss(net->parameters(), adamw(), g, OSSOptions().partition(PartitionMode::kSplit));
        ShardedDDP ddp(net, oss,
                       ShardedDDPOptions().reduce_bucket_bytes(128).bucket_bytes_per_rank(0).overlap_param_sync(true).step_in_backward(in_backward));
        ASSERT_GE(ddp.num_buckets(), 8u);
        copy_into(net->parameters(), ref->parameters());
        for (int step = 0; step < 4; ++step) {
          const auto data = testing::rank_data(step, g->rank(), 3);
          if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          ddp.zero_grad();
          testing::loss_of(ddp.forward(data.x), data, 3).backward();
          oss.step();
          ASSERT_TRUE(testing::Introspection::param_sync_in_flight(oss));
          reference_step(*ref, ref_opt, data, *g);
          ddp.finish_param_sync();  // every bucket's sync waited for here, at once
          ASSERT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5)) << "step " << step;
        }
      });
    }
  }
}

// A freeze and an unfreeze (each a new layout of the parameter buffers) while the last step's sync
// is in flight: refresh_trainable() waits for the sync first, so no all-gather writes into
// buffers laid out anew, and every forward reads the reference's weights.
TEST(SyncPitfalls, AFreezeWhileTheSyncIsInFlightWaitsForIt) {
  for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE("world " + std::to_string(world) + (partition == PartitionMode::kSplit ? ", split" : ", whole"));
      testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = std::make_shared<OutOfOrder>(), ref = std::make_shared<OutOfOrder>();
        optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(1e-2).weight_decay(0.01));
        OSS oss(net->parameters(), adamw(), g, OSSOptions().partition(partition));
        ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(256).overlap_param_sync(true));
        copy_into(net->parameters(), ref->parameters());
        for (int step = 0; step < 6; ++step) {
          if (step == 2 || step == 4) {
            ASSERT_TRUE(testing::Introspection::param_sync_in_flight(oss));
            const int64_t layout = testing::Introspection::layout_version(oss);
            freeze(*net, {"a", "d"}, step == 2);
            freeze(*ref, {"a", "d"}, step == 2);
            ddp.refresh_trainable();
            EXPECT_GT(testing::Introspection::layout_version(oss), layout) << "no new layout";
            EXPECT_FALSE(testing::Introspection::param_sync_in_flight(oss)) << "laid out with the sync in flight";
            ASSERT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5)) << "step " << step;
          }
          train_step(*net, ddp, oss, *ref, ref_opt, step, *g);
        }
        ddp.finish_param_sync();
        EXPECT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5));
      });
    }
  }
}

// A frozen parameter is in no bucket, so its values never travel: the all-gathers of a step move
// exactly the rows of the trainable buckets, fewer bytes than before the freeze, and the frozen
// parameters keep their bits on every rank.
TEST(SyncPitfalls, FrozenParametersSendNothing) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<OutOfOrder>(), ref = std::make_shared<OutOfOrder>();
      optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(1e-2).weight_decay(0.01));
      OSS oss(net->parameters(), adamw(), g, OSSOptions().partition(PartitionMode::kSplit));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(256).bucket_bytes_per_rank(0));
      copy_into(net->parameters(), ref->parameters());
      // The bytes the step's all-gathers moved on this rank, and those the layout's buckets hold.
      auto sync_bytes = [&](int step) {
        const auto data = testing::rank_data(step, g->rank(), 3);
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        g->reset_stats();
        oss.step();
        reference_step(*ref, ref_opt, data, *g);
        const auto& stats = g->stats();
        EXPECT_EQ(stats.bytes[CommStats::kBroadcast], 0) << "split parameters sync by all-gathers only";
        return stats.bytes[CommStats::kAllgather];
      };
      auto bucket_bytes = [&] {
        int64_t bytes = 0;
        for (const auto& b : oss.layout().buckets()) {
          EXPECT_TRUE(b.rows());
          bytes += b.rows_in_buffer(world).size() * static_cast<int64_t>(sizeof(float));
        }
        return bytes;
      };
      sync_bytes(0);
      const int64_t before = sync_bytes(1);
      EXPECT_EQ(before, bucket_bytes());
      freeze(*net, {"a", "c"}, true);
      freeze(*ref, {"a", "c"}, true);
      const Params frozen = testing::clone_params(net->layers.at("a")->parameters());
      sync_bytes(2);  // (the step that follows the new layout also moves state)
      const int64_t after = sync_bytes(3);
      EXPECT_EQ(after, bucket_bytes()) << "the step moved more than the trainable buckets' rows";
      EXPECT_LT(after, before);
      EXPECT_TRUE(buckets_of(oss, net->layers.at("a")->parameters()).empty()) << "a frozen layer is in a bucket";
      EXPECT_TRUE(buckets_of(oss, net->layers.at("c")->parameters()).empty()) << "a frozen layer is in a bucket";
      const Params now = net->layers.at("a")->parameters();
      for (size_t k = 0; k < now.size(); ++k) EXPECT_TRUE(now[k].equal(frozen[k])) << "a frozen parameter changed";
      EXPECT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5));
    });
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
