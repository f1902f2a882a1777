#include "plan.h"

#include "charts.h"
#include "memory_worker.h"
#include "model_spec.h"
#include "shard_plan.h"
#include "units.h"

#include <shardopt/check.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

namespace shardopt::app {

namespace {

// One planned configuration and scenario, with what the table, the JSON and the CSV show.
struct Row {
  PlanConfig config;
  ScenarioPlan plan;
  double comm_seconds = 0;    // the slowest rank's time: its bytes at the link bandwidths, plus latency
  double latency_seconds = 0; // that rank's latency term
  int64_t collectives = 0;    // the collectives per step of the rank that takes part in the most
  nlohmann::json formula;     // the ZeRO paper's bytes per rank
  int64_t muon_numel = 0;
};

const RankPlan& busiest(const ScenarioPlan& p) {
  return *std::max_element(p.ranks.begin(), p.ranks.end(),
                           [](const RankPlan& a, const RankPlan& b) { return a.total() < b.total(); });
}

// The rank that moves the most bytes per step (sent or received).
const RankPlan& most_traffic(const ScenarioPlan& p) {
  return *std::max_element(p.ranks.begin(), p.ranks.end(), [](const RankPlan& a, const RankPlan& b) {
    return std::max(a.sent(), a.received()) < std::max(b.sent(), b.received());
  });
}

const RankPlan& least(const ScenarioPlan& p) {
  return *std::min_element(p.ranks.begin(), p.ranks.end(),
                           [](const RankPlan& a, const RankPlan& b) { return a.total() < b.total(); });
}

// The busiest rank's state and masters against the mean: how far the sharded part is from 1/N.
double state_imbalance(const ScenarioPlan& p) {
  double sum = 0, most = 0;
  for (const auto& r : p.ranks) {
    sum += r.state + r.masters;
    most = std::max(most, r.state + r.masters);
  }
  return sum > 0 ? most * static_cast<double>(p.ranks.size()) / sum - 1.0 : 0.0;
}

// Note [Plan latency]
// Each collective also pays a latency that does not depend on its bytes, in NCCL's own model of
// its algorithms (src/graph/tuning.cc): a base latency per collective, plus one hop latency per
// step of the algorithm, the steps that cross nodes at the network's. A chain (a reduce to an
// owner, a broadcast from one) and a ring reduce-scatter or all-gather over k ranks on n nodes
// take k - 1 steps, n - 1 of them across nodes; a ring all-reduce twice that; a tree all-reduce
// 2 ((k/n - 1) + log2 n) steps, log2 n of each half across nodes. NCCL picks the faster
// algorithm for an all-reduce, so the plan takes the smaller of ring and tree. Ranks are placed
// in node order, so a block of b ranks spans ceil(b / ranks_per_node) nodes, and the replica
// group, one rank per block, spans one node per block once blocks fill nodes.
double chain_latency(const PlanOptions& o, int k, int nodes) {
  if (k <= 1) return 0.0;
  return (o.collective_latency_us + (k - nodes) * o.hop_latency_us + (nodes - 1) * o.network_hop_latency_us) * 1e-6;
}

double allreduce_latency(const PlanOptions& o, int k, int nodes) {
  if (k <= 1) return 0.0;
  const double ring = o.collective_latency_us + 2.0 * (k - nodes) * o.hop_latency_us +
                      2.0 * (nodes - 1) * o.network_hop_latency_us;
  const double per_node = static_cast<double>(k) / nodes;
  const double tree = o.collective_latency_us + 2.0 * ((per_node - 1) * o.hop_latency_us +
                                                       std::log2(static_cast<double>(nodes)) * o.network_hop_latency_us);
  return std::min(ring, tree) * 1e-6;
}

int nodes_of(const PlanOptions& o, int ranks) { return (ranks + o.ranks_per_node - 1) / o.ranks_per_node; }

// Seconds to move each rank's bytes: a group that fits in one node moves at the intra-node
// bandwidth, one that spans nodes at the inter-node bandwidth (its ring crosses the slowest link);
// plus each of its collectives' latency (Note [Plan latency]). Sets the row's latency and
// collective count from the slowest and the busiest rank.
void add_comm_time(const PlanOptions& o, Row& row) {
  const PlanConfig& c = row.config;
  const ScenarioPlan& p = row.plan;
  const int block = c.mode == "ddp" || c.shard_group_size == 0 ? c.world_size : c.shard_group_size;
  const double block_bw = (block <= o.ranks_per_node ? o.intra_node_gbps : o.inter_node_gbps) * 1e9;
  const double across_bw = (c.world_size <= o.ranks_per_node ? o.intra_node_gbps : o.inter_node_gbps) * 1e9;
  const int blocks = c.world_size / block;
  const int block_nodes = nodes_of(o, block);
  // The replica group: one rank per block; on one node while the whole group is.
  const int replica_nodes = c.world_size <= o.ranks_per_node ? 1 : std::min(blocks, nodes_of(o, c.world_size));
  // An all-reduce "across" is over the replica group, or over the whole group when the mode
  // reduces there (ZeRO-1's and DDP's gradients, with blocks).
  const bool whole_group = c.mode.rfind("zero2", 0) != 0;
  const int across_k = whole_group ? c.world_size : blocks;
  const int across_nodes = whole_group ? nodes_of(o, c.world_size) : replica_nodes;
  double worst = 0;
  for (const auto& r : p.ranks) {
    const double latency = static_cast<double>(r.chains_block) * chain_latency(o, block, block_nodes) +
                           static_cast<double>(r.allreduces_block) * allreduce_latency(o, block, block_nodes) +
                           static_cast<double>(r.allreduces_across) * allreduce_latency(o, across_k, across_nodes);
    const double seconds = std::max(r.sent_block, r.received_block) / block_bw +
                           std::max(r.sent_across, r.received_across) / across_bw + latency;
    if (seconds >= worst) {
      worst = seconds;
      row.latency_seconds = latency;
    }
    row.collectives = std::max(row.collectives, r.collectives());
  }
  row.comm_seconds = worst;
}

nlohmann::json rank_json(const RankPlan& r) {
  return {{"rank", r.rank},
          {"params", r.params},
          {"grads", r.grads},
          {"buckets", r.buckets},
          {"masters", r.masters},
          {"feedback", r.feedback},
          {"state", r.state},
          {"total", r.total()},
          {"bytes_sent_per_step", r.sent()},
          {"bytes_received_per_step", r.received()},
          {"bytes_sent_within_block", r.sent_block},
          {"bytes_received_within_block", r.received_block},
          {"bytes_sent_across_blocks", r.sent_across},
          {"bytes_received_across_blocks", r.received_across}};
}

// Why the busiest rank differs from the ZeRO paper's formula, part by part.
std::string differences(const Row& row) {
  const RankPlan& b = busiest(row.plan);
  const double params = b.params - row.formula["params"].get<double>();
  const double grads = b.grads - row.formula["grads"].get<double>();
  const double state = b.state + b.masters - row.formula["state"].get<double>();
  std::string out;
  auto add = [&](double bytes, const char* why) {
    if (std::abs(bytes) < 0.5) return;
    out += fmt::format("{}{}{} {}", out.empty() ? "" : ", ", bytes > 0 ? "+" : "-", bytes_text(std::abs(bytes)), why);
  };
  add(params, "parameter padding");
  add(grads, "gradients (owned ranges)");
  add(b.buckets, "buckets");
  add(state, "state (imbalance, padding)");
  add(b.feedback, "error-feedback residuals");
  return out.empty() ? "equal" : out;
}

void print_table(const std::vector<Row>& rows, const ModelSpec& spec, const PlanOptions& o) {
  std::printf("plan per rank, %s (%s parameters, %s): the busiest rank of each configuration (all blocks are "
              "alike); traffic per step; communication at %.0f GB/s inside a node and %.0f GB/s across nodes (%d "
              "ranks each)\n",
              spec.name.c_str(), count_text(spec.numel()).c_str(),
              o.optimizer == "muon" ? "Muon on the matrices, Adam on the rest" : "Adam", o.intra_node_gbps,
              o.inter_node_gbps, o.ranks_per_node);
  std::printf("memory: the busiest rank's bytes, the least loaded rank's total; traffic: the bytes per step of the "
              "rank that moves the most, the most collectives per step of a rank, the slowest rank's communication "
              "time (bytes at the bandwidths, plus %.1f us per collective and %.1f us per step of its algorithm, %.1f "
              "us across nodes)\n",
              o.collective_latency_us, o.hop_latency_us, o.network_hop_latency_us);
  std::printf("%-10s %5s %5s  %-14s %9s %9s %9s %9s %9s %9s %9s | %9s %6s | %9s %9s %6s %9s | %s\n", "mode", "world",
              "block", "scenario", "params", "grads", "buckets", "masters", "feedback", "state", "total", "least", "imbal",
              "sent",
              "received", "colls", "comm", "against the ZeRO formula");
  for (const auto& row : rows) {
    const RankPlan& b = busiest(row.plan);
    const int block = row.config.mode == "ddp" || row.config.shard_group_size == 0 ? row.config.world_size
                                                                                   : row.config.shard_group_size;
    std::printf("%-10s %5d %5d  %-14s %9s %9s %9s %9s %9s %9s %9s | %9s %5.1f%% | %9s %9s %6lld %7.2fms | %s\n",
                row.config.mode.c_str(), row.config.world_size, block, row.plan.scenario.c_str(),
                bytes_text(b.params).c_str(), bytes_text(b.grads).c_str(), bytes_text(b.buckets).c_str(),
                bytes_text(b.masters).c_str(), bytes_text(b.feedback).c_str(), bytes_text(b.state).c_str(),
                bytes_text(b.total()).c_str(),
                bytes_text(least(row.plan).total()).c_str(), 100.0 * state_imbalance(row.plan),
                bytes_text(most_traffic(row.plan).sent()).c_str(), bytes_text(most_traffic(row.plan).received()).c_str(),
                static_cast<long long>(row.collectives), row.comm_seconds * 1e3,
                differences(row).c_str());
  }
}

nlohmann::json report_json(const std::vector<Row>& rows, const ModelSpec& spec, const PlanOptions& o) {
  nlohmann::json configs = nlohmann::json::array();
  for (const auto& row : rows) {
    configs.push_back({{"world_size", row.config.world_size},
                       {"mode", row.config.mode},
                       {"shard_group_size", row.config.shard_group_size},
                       {"scenario", row.plan.scenario},
                       {"optimizer", row.config.optimizer},
                       {"gradient_wire", row.config.gradient_wire},
                       {"param_wire", row.config.param_wire},
                       {"error_feedback", row.config.error_feedback},
                       {"state_format", row.config.state_format},
                       {"split", row.plan.split},
                       {"buckets", row.plan.buckets},
                       {"trainable", row.plan.trainable},
                       {"layout_imbalance", row.plan.layout_imbalance},
                       {"state_imbalance", state_imbalance(row.plan)},
                       {"comm_seconds_per_step", row.comm_seconds},
                       {"latency_seconds_per_step", row.latency_seconds},
                       {"collectives_per_step", row.collectives},
                       {"max_rank", rank_json(busiest(row.plan))},
                       {"min_rank", rank_json(least(row.plan))},
                       {"max_traffic_rank", rank_json(most_traffic(row.plan))},
                       {"formula", row.formula},
                       {"against_formula", differences(row)}});
  }
  return {{"model", spec.name},
          {"numel", spec.numel()},
          {"links", {{"intra_node_gbps", o.intra_node_gbps}, {"inter_node_gbps", o.inter_node_gbps},
                     {"ranks_per_node", o.ranks_per_node}, {"collective_latency_us", o.collective_latency_us},
                     {"hop_latency_us", o.hop_latency_us}, {"network_hop_latency_us", o.network_hop_latency_us}}},
          {"configs", configs}};
}

void write_csv(const std::vector<Row>& rows, const std::string& path) {
  std::ofstream f(path);
  SHARDOPT_CHECK(f, "cannot write '", path, "'");
  f << "mode,world,shard_group_size,scenario,rank,params,grads,buckets,masters,feedback,state,total,sent_within_block,"
       "received_within_block,sent_across_blocks,received_across_blocks\n";
  for (const auto& row : rows) {
    for (const auto& r : row.plan.ranks) {
      f << fmt::format("{},{},{},{},{},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f}\n",
                       row.config.mode, row.config.world_size, row.config.shard_group_size, row.plan.scenario, r.rank,
                       r.params, r.grads, r.buckets, r.masters, r.feedback, r.state, r.total(), r.sent_block, r.received_block,
                       r.sent_across, r.received_across);
    }
  }
}

}  // namespace

int run_plan(const PlanOptions& o) {
  const auto started = std::chrono::steady_clock::now();
  const ModelSpec spec = model_spec(o.preset, o.spec);
  SHARDOPT_CHECK(o.state_format != "bf16" || o.optimizer != "muon", "--state-format bf16 holds Adam's state, not "
                 "Muon's; use --state-format fp32 or int8 with --optimizer muon");
  SHARDOPT_CHECK(o.intra_node_gbps > 0, "--intra-node-bandwidth must be positive, got ", o.intra_node_gbps);
  SHARDOPT_CHECK(o.inter_node_gbps > 0, "--inter-node-bandwidth must be positive, got ", o.inter_node_gbps);
  SHARDOPT_CHECK(o.ranks_per_node >= 1, "--ranks-per-node must be positive, got ", o.ranks_per_node);
  SHARDOPT_CHECK(o.collective_latency_us >= 0, "--collective-latency-us must be >= 0, got ", o.collective_latency_us);
  SHARDOPT_CHECK(o.hop_latency_us >= 0, "--hop-latency-us must be >= 0, got ", o.hop_latency_us);
  SHARDOPT_CHECK(o.network_hop_latency_us >= 0, "--network-hop-latency-us must be >= 0, got ", o.network_hop_latency_us);
  SHARDOPT_CHECK(o.bucket_mb >= 0, "--bucket-mb must be >= 0, got ", o.bucket_mb);
  for (int w : o.world_sizes) {
    SHARDOPT_CHECK(w >= 1, "--world-sizes: ", w, " is not a positive world size");
    SHARDOPT_CHECK(o.shard_group_size == 0 || w % o.shard_group_size == 0, "--shard-group-size ", o.shard_group_size,
                   " does not divide the world size ", w);
  }
  const std::string python = chart_python(o.python, o.out_dir, !o.no_chart);
  int64_t muon_numel = 0;
  for (const auto& layer : spec.layers) {
    int64_t n = 1;
    for (int64_t d : layer.shape) n *= d;
    muon_numel += o.optimizer == "muon" && muon_matrix(layer) ? n : 0;
  }
  std::vector<Row> rows;
  for (int world : o.world_sizes) {
    for (const auto& mode : o.modes) {
      PlanConfig c;
      c.mode = mode;
      c.world_size = world;
      c.shard_group_size = mode == "ddp" || o.shard_group_size == world ? 0 : o.shard_group_size;
      c.optimizer = o.optimizer;
      c.partition = o.partition;
      c.bucket_bytes = static_cast<int64_t>(o.bucket_mb * (1 << 20));
      c.freeze_fraction = o.freeze_fraction;
      c.gradient_wire = o.gradient_wire;
      c.param_wire = o.param_wire;
      c.error_feedback = o.error_feedback;
      c.state_format = o.state_format;
      for (auto& plan : plan_config(spec, c)) {
        Row row{c, std::move(plan), 0.0, 0.0, 0, {}, 0};
        add_comm_time(o, row);
        const int sharded = c.shard_group_size > 0 ? c.shard_group_size : world;
        row.formula = zero_formula(mode, sharded, spec.numel(), row.plan.trainable, spec.numel(), muon_numel);
        rows.push_back(std::move(row));
      }
    }
  }
  print_table(rows, spec, o);
  std::ofstream(o.out_dir + "/plan.json") << report_json(rows, spec, o).dump(1) << "\n";
  write_csv(rows, o.out_dir + "/plan.csv");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!o.no_chart) draw_chart(python, "plot_plan.py", o.out_dir + "/plan.json", o.out_dir + "/plan.png");
  std::printf("planned %zu configurations in %.2f s; wrote %s/plan.json%s\n", rows.size(), seconds, o.out_dir.c_str(),
              o.no_chart ? " and plan.csv" : ", plan.csv and plan.png");
  return 0;
}

}  // namespace shardopt::app
