// `shardopt memory`: measured memory per rank for plain data parallel (DDP), OSS (ZeRO-1) and
// OSS + ShardedDDP (ZeRO-2) at several world sizes, beside the ZeRO paper's formula.
//
// For each world size and mode it starts that many local ranks (real processes, real Gloo
// groups), builds the real objects for the model's shapes and runs real steps of Adam. The
// model's forward is the sum of every parameter, which adds no parameter-sized temporary, so the
// memory measured is that of the data-parallel machinery, not of activations. Each rank counts,
// from the tensors themselves: parameters (the storages holding them), gradients (the gradient
// tensors it holds after the last step), optimizer state, communication buckets kept between
// steps (the model state); it reads its resident memory once the runtime is up and before the
// model exists (the runtime's fixed cost: LibTorch, Gloo) and its peak resident memory (VmHWM);
// "transient" is the peak minus the runtime and the model state (buffers that lived during a
// step). Then a fraction of the model is frozen and the same is measured after more steps. World
// sizes whose estimate does not fit the machine's available memory are reported as skipped.
#pragma once

#include <string>
#include <vector>

namespace shardopt::app {

struct MemoryOptions {
  std::string preset = "gpt2-mini";
  std::string spec;  // a JSON spec instead of a preset
  std::vector<int> world_sizes{1, 2, 4, 8};
  std::vector<std::string> modes{"ddp", "zero1", "zero2"};
  std::string optimizer = "adam";  // or "muon"
  int steps = 3;
  double freeze_fraction = 0.5;  // of the parameters (leading layers), frozen for the second measurement
  std::string gradient_wire = "exact";  // ZeRO-2's gradients on the wire (ShardedDDPOptions::gradient_wire)
  bool error_feedback = false;          // ZeRO-2: error feedback's residuals (ShardedDDPOptions::error_feedback)
  std::string state_format = "fp32";    // ZeRO-1/2's optimizer state on its owners (OSSOptions::state_format)
  std::string out_dir = "memory-report";
  std::string python;            // interpreter with matplotlib for the chart; empty: the build's
  bool no_chart = false;         // --no-chart: memory.json and memory.csv only
  // Set by the driver for the ranks it starts.
  std::string worker_mode, worker_out;
};

// Runs the measurement (driver) or one rank of it (worker); returns the exit code.
int run_memory(const MemoryOptions& options, char** argv);

}  // namespace shardopt::app
