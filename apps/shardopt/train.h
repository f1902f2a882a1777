// `shardopt train`: a classifier of models/ (the CNN, or the ViT) on Fashion-MNIST with OSS + ShardedDDP + BalancedSampler,
// a freeze schedule, checkpoints and resume. One rank of the job (the caller starts the group).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt::app {

struct TrainOptions {
  std::string data_dir;
  std::string model = "cnn";         // cnn | vit (models/classifier.h)
  int64_t epochs = 5;
  int64_t batch_size = 120;          // global: samples per step over all ranks (divides among 1-6 or 8 ranks)
  std::string optimizer = "adam";    // adam | adamw | sgd
  double lr = 1e-3;
  std::string lr_schedule = "constant";  // constant | cosine (to 0 over the run) | step (x0.1 at 2/3 of the run)
  int64_t warmup_steps = 0;          // linear warm-up from 0
  double weight_decay = 0.0;
  double momentum = 0.9;             // sgd
  double clip = 0.0;                 // max global L2 norm of the gradients; 0: no clipping
  uint64_t seed = 0;
  std::vector<std::string> freeze, unfreeze;
  std::string checkpoint_dir;        // empty: no checkpoints
  int64_t checkpoint_every = 0;      // steps between checkpoints besides each epoch's end; 0: epochs only
  bool sharded_checkpoint = false;   // each rank writes its optimizer state (else consolidated on rank 0)
  bool sync_checkpoint = false;      // save synchronously (else in the background: save_checkpoint_async)
  bool resume = false;
  int64_t stop_after_steps = 0;      // > 0: stop after this many steps of the run (the schedule still spans all epochs)
  int64_t train_samples = 0;         // > 0: only the first samples of each split
  int64_t test_samples = 0;
  int threads = 0;                   // intra-op threads per rank; 0: the cores / local ranks
  int64_t timeout_s = 300;           // of every collective
  std::string mixed_precision = "off";  // off | bf16 | fp16 (fp16 with the sharded gradient scaler)
  std::string gradient_wire = "exact";  // exact | bf16 | int8 (ShardedDDPOptions::gradient_wire)
  std::string param_wire = "exact";     // exact | bf16 | int8 (OSSOptions::param_wire)
  std::string state_format = "fp32";    // fp32 | bf16 | int8 (OSSOptions::state_format)
  bool error_feedback = false;          // ShardedDDPOptions::error_feedback
  // auto | on | off (ShardedDDPOptions::step_in_backward); auto: on where it holds (steps_in_backward()).
  std::string step_in_backward = "auto";
  // auto | on | off (ShardedDDPOptions::overlap_param_sync, the model waiting block by block);
  // auto: on where the ranks span nodes (overlaps_sync()).
  std::string overlap_sync = "auto";
  std::string device = "cpu";        // cpu (Gloo) | cuda (NCCL, the GPU of each rank's LOCAL_RANK)
  // The metrics file (metrics_log.h) and its chart beside it: this path; empty: DIR/metrics.jsonl
  // under --checkpoint-dir DIR, else none; "off": none.
  std::string metrics;
  // Training goes on when a rank dies (shardopt/resilience/resilient.h): buddy copies of every
  // shard, refreshed every refresh_every steps.
  bool survive_failures = false;
  int64_t refresh_every = 1;
};

// Trains; returns the process exit code. Throws c10::Error on bad input.
int run_train(const TrainOptions& options);

}  // namespace shardopt::app
