// `shardopt plan`: per-rank memory and traffic for any world size, from the real layout, without
// allocating a tensor or starting a rank (shard_plan.h says what is counted and how).
//
// For each world size and mode it reports the busiest and the least loaded rank's bytes of
// parameters, gradients, buckets, masters and optimizer state, the imbalance, the bytes each rank
// sends and receives per step within a block and across blocks, the collectives it takes part
// in, and the communication time: those bytes at the given link bandwidths plus each
// collective's latency; beside it the ZeRO paper's formula and why the layout
// differs from it. Writes plan.json, plan.csv and plan.png.
#pragma once

#include <string>
#include <vector>

namespace shardopt::app {

struct PlanOptions {
  std::string preset = "gpt2-small";
  std::string spec;  // a JSON spec instead of a preset
  std::vector<int> world_sizes{8, 64, 512, 4096};
  std::vector<std::string> modes{"ddp", "zero1", "zero2"};
  int shard_group_size = 0;
  std::string optimizer = "adam";
  std::string partition = "auto";
  double bucket_mb = 8;           // ZeRO-2's reduce buckets, MiB
  double freeze_fraction = 0.0;
  std::string gradient_wire = "exact";  // exact or bf16: how ZeRO-2's gradients travel
  bool error_feedback = false;          // ZeRO-2 on a compressed gradient wire: residuals per rank
  std::string param_wire = "exact";     // exact or bf16: how ZeRO-1/2's parameter sync travels
  std::string state_format = "fp32";    // fp32, bf16 or int8: ZeRO-1/2's optimizer state (OSSOptions::state_format)
  double intra_node_gbps = 450;   // GB/s each way inside a node (NVLink)
  double inter_node_gbps = 50;    // GB/s each way across nodes (InfiniBand, 400 Gb/s per GPU)
  int ranks_per_node = 8;
  // The latency terms of a collective (Note [Plan latency] in plan.cpp), microseconds: NCCL's
  // own model for its ring algorithm with the Simple protocol (src/graph/tuning.cc: baseLat,
  // and hwLat per step over NVLink and over the network).
  double collective_latency_us = 8.4;
  double hop_latency_us = 3.4;          // per step between ranks of one node
  double network_hop_latency_us = 14.0; // per step between nodes
  std::string out_dir = "plan";
  std::string python;             // interpreter with matplotlib for the chart; empty: the build's
  bool no_chart = false;          // --no-chart: plan.json and plan.csv only
};

int run_plan(const PlanOptions& options);

}  // namespace shardopt::app
