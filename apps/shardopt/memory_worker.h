// One rank of `shardopt memory`: builds one mode's objects for a model's shapes, runs steps,
// counts what it holds, freezes part of the model, runs and counts again.
#pragma once

#include "memory.h"
#include "model_spec.h"

#include <nlohmann/json.hpp>

#include <string>

namespace shardopt::app {

// Fields of one measurement, in the order the ranks exchange them.
// runtime: the process's resident memory once LibTorch and the group are up, before the model
// exists: the runtime's fixed cost, the same whatever the model. feedback: error feedback's
// residuals (ShardedDDP::error_feedback_bytes()), apart from the gradients. rise_*: how far the
// resident size rose within each phase of the scenario's steps above where the phase began, the
// most over the steps (Note [Peaks by phase] in memory_worker.cpp; rise_rebuild: the
// re-partition after the freeze, 0 before it); rss_after_step: resident memory after the last
// step, of which malloc_free is what glibc's malloc holds free.
constexpr const char* kMeasured[] = {"params",       "grads",          "state",       "buckets",
                                     "peak_rss",     "runtime",        "feedback",    "rise_forward",
                                     "rise_backward", "rise_exchange", "rise_step",   "rise_rebuild",
                                     "rss_after_step", "malloc_free"};

// Runs mode o.worker_mode ("ddp", "zero1", "zero2", "zero1-bf16", "zero2-bf16") on the group from
// the environment, with o's optimizer ("adam", or "muon": Muon on the matrices that are not
// embeddings, Adam on the rest), steps, freeze fraction and ZeRO-2's gradient wire; rank 0 writes
// every rank's rows to o.worker_out (JSON). Collective.
void run_memory_worker(const ModelSpec& spec, const MemoryOptions& o);

// A "key: N kB" value of a /proc file ("/proc/self/status", "VmHWM:"); 0 when absent.
int64_t proc_kib(const std::string& file, const std::string& key);

// The ZeRO paper's bytes per rank for Adam. fp32: parameters 4 per element, gradients 4 per
// trainable element (divided by the world size under zero2), state 8 per element with state
// (divided by the world size under zero1 and zero2). "-bf16" modes: parameters 2, gradients 2
// (over the world size under zero2-bf16), state 12 over the world size (fp32 master, exp_avg,
// exp_avg_sq). Of the elements with state, `muon` are Muon's: 4 bytes each (momentum_buffer), 8
// with the fp32 master.
nlohmann::json zero_formula(const std::string& mode, int world, int64_t numel, int64_t trainable, int64_t with_state,
                            int64_t muon = 0);

}  // namespace shardopt::app
