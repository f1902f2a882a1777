// The timeline (shardopt/comm/timeline.h): each bucket's reduction, its step and its parameter
// sync are on it, in that order, and the overlap they promise shows: with the step in the
// backward the first parameter sync starts inside the backward, and with the step per bucket
// before the last bucket's step ends.
#include <shardopt/comm/timeline.h>
#include <shardopt/ddp/sharded_ddp.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <fstream>
#include <limits>
#include <map>
#include <string>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;

torch::nn::Sequential make_net() {
  auto net = torch::nn::Sequential(torch::nn::Linear(5, 24), torch::nn::Tanh(), torch::nn::Linear(24, 24),
                                   torch::nn::Tanh(), torch::nn::Linear(24, 3));
  testing::fill_seeded(net->parameters(), 9);
  return net;
}

struct Span {
  int64_t begin = 0, end = 0;
};

// One step's events of each rank, by name (the last of each name).
std::map<int, std::map<std::string, Span>> read_trace(const std::string& path) {
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::map<int, std::map<std::string, Span>> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const int64_t ts = e.at("ts"), dur = e.at("dur");
    EXPECT_GE(ts, 0);
    EXPECT_GE(dur, 0);
    out[e.at("pid").get<int>()][e.at("name").get<std::string>()] = {ts, ts + dur};
  }
  return out;
}

TEST(Timeline, EachBucketsReductionStepAndSyncAreOnItAndOverlapAsPromised) {
  const std::string dir = testing::temp_dir("timeline");
  for (bool in_backward : {true, false}) {
    SCOPED_TRACE(in_backward ? "step in the backward" : "step per bucket after the backward");
    const std::string path = dir + (in_backward ? "/in_backward.json" : "/after.json");
    size_t buckets = 0;
    timeline::start();
    testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = make_net();
      OSS oss(net->parameters(), optimizer<optim::AdamW>(optim::AdamWOptions(1e-2)), g,
              OSSOptions().partition(PartitionMode::kSplit));
      ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().reduce_bucket_bytes(512).bucket_bytes_per_rank(0).step_in_backward(in_backward));
      if (g->rank() == 0) buckets = ddp.num_buckets();
      const auto data = testing::rank_data(0, g->rank(), 3);
      oss.zero_grad(true);
      {
        timeline::Span span("backward", g->rank());
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
      }
      oss.step();
    });
    timeline::stop();
    timeline::write(path);
    ASSERT_GE(buckets, 3u);
    const auto events = read_trace(path);
    ASSERT_EQ(events.size(), 2u) << "one process per rank";
    for (const auto& [rank, named] : events) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      ASSERT_TRUE(named.count("backward"));
      int64_t first_sync = std::numeric_limits<int64_t>::max(), last_step_end = 0;
      for (size_t k = 0; k < buckets; ++k) {
        const std::string b = "bucket " + std::to_string(k);
        ASSERT_TRUE(named.count(b + " reduce-scatter")) << b;
        ASSERT_TRUE(named.count(b + " step")) << b;
        ASSERT_TRUE(named.count(b + " all-gather")) << b;
        const Span reduce = named.at(b + " reduce-scatter"), step = named.at(b + " step"), sync = named.at(b + " all-gather");
        EXPECT_LE(reduce.end, step.begin) << b << ": stepped before its reduction was complete";
        EXPECT_LE(step.end, sync.begin) << b << ": sent before it was stepped";
        first_sync = std::min(first_sync, sync.begin);
        last_step_end = std::max(last_step_end, step.end);
      }
      EXPECT_LT(first_sync, last_step_end) << "the first sync waited for the last bucket's step";
      if (in_backward) EXPECT_LT(first_sync, named.at("backward").end) << "no sync started inside the backward";
      if (!in_backward) EXPECT_GE(first_sync, named.at("backward").end) << "a sync started inside the backward";
    }
  }
  // Not recording: nothing is kept.
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = make_net();
    OSS oss(net->parameters(), optimizer<optim::AdamW>(optim::AdamWOptions(1e-2)), g);
    ShardedDDP ddp(net.ptr(), oss);
    const auto data = testing::rank_data(0, g->rank(), 3);
    testing::loss_of(ddp.forward(data.x), data, 3).backward();
    oss.step();
  });
  timeline::write(dir + "/off.json");
  EXPECT_FALSE(timeline::recording());
  EXPECT_EQ(read_trace(dir + "/off.json").size(), 2u) << "what the last recording kept stays until the next start()";
  timeline::start();
  timeline::stop();
  timeline::write(dir + "/empty.json");
  EXPECT_TRUE(read_trace(dir + "/empty.json").empty());
  EXPECT_THROW(timeline::write(dir + "/no/such/folder/t.json"), c10::Error);
  testing::remove_tree(dir);
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
