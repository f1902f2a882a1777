// One rank of `shardopt memory`: builds one mode's objects for a model's shapes, runs steps,
// counts what it holds, freezes part of the model, runs and counts again.
#pragma once

#include "model_spec.h"

#include <nlohmann/json.hpp>

#include <string>

namespace shardopt::app {

// Fields of one measurement, in the order the ranks exchange them.
constexpr const char* kMeasured[] = {"params", "grads", "state", "buckets", "peak_rss"};

// Runs mode `mode` ("ddp", "zero1", "zero2", "zero1-bf16", "zero2-bf16") on the group from the environment; rank 0 writes
// every rank's rows to `out` (JSON). Collective.
void run_memory_worker(const ModelSpec& spec, const std::string& mode, int steps, double freeze_fraction,
                       const std::string& out);

// A "key: N kB" value of a /proc file ("/proc/self/status", "VmHWM:"); 0 when absent.
int64_t proc_kib(const std::string& file, const std::string& key);

// The ZeRO paper's bytes per rank for Adam. fp32: parameters 4 per element, gradients 4 per
// trainable element (divided by the world size under zero2), state 8 per element with state
// (divided by the world size under zero1 and zero2). "-bf16" modes: parameters 2, gradients 2
// (over the world size under zero2-bf16), state 12 over the world size (fp32 master, exp_avg,
// exp_avg_sq).
nlohmann::json zero_formula(const std::string& mode, int world, int64_t numel, int64_t trainable, int64_t with_state);

}  // namespace shardopt::app
