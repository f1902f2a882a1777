// The whole public surface of shardopt, one folder per layer:
//   comm/   process groups, collectives with timeouts
//   optim/  OSS (sharded optimizer state), the partition it uses, mixed precision, the gradient
//           scaler, Muon
//   ddp/    ShardedDDP (sharded gradients)
//   data/   BalancedSampler and its torch::data adapter
//   checkpoint/  save_checkpoint / load_checkpoint, save_checkpoint_async
//   resilience/  Resilient: training that goes on when a rank dies
//   testing/     what tests and benchmarks read of OSS's and ShardedDDP's insides (not included
//                here)
// and, beside them, check.h (errors), version.h and compat.h (LibTorch version differences);
// oss.h, sharded_ddp.h, sampler.h, comm.h, checkpoint.h and grad_scaler.h include their layer's
// headers under the older, shorter names.
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/optim/partition.h>
#include <shardopt/optim/oss.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/data/sampler.h>
#include <shardopt/data/data_sampler.h>
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/checkpoint/async_save.h>
#include <shardopt/optim/grad_scaler.h>
#include <shardopt/optim/muon.h>
#include <shardopt/resilience/resilient.h>
