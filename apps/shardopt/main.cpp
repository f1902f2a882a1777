// shardopt: the command-line tool.
//
//   shardopt train -n 2                          Fashion-MNIST CNN on 2 local ranks
//   shardopt train --freeze conv@2 --unfreeze conv@4 --checkpoint-dir run
//   torchrun --nproc-per-node 4 shardopt train   one rank per process under any launcher
//   shardopt memory --preset gpt2-small          measured memory per rank for DDP, ZeRO-1, ZeRO-2
//   shardopt plan --preset llama-70b             planned memory and traffic per rank at any world size
//
// Under a launcher (RANK or the Open MPI / PMI / SLURM variables set) the process is one rank;
// otherwise `-n N` starts N local ranks. Errors print one line and exit non-zero.
#include "local_ranks.h"
#include "memory.h"
#include "plan.h"
#include "train.h"
#include "fashion_mnist.h"

#include <shardopt/comm/launch_env.h>

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

namespace {

using namespace shardopt::app;

// The first line of an error, without the library's "shardopt: " prefix.
std::string one_line(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string m = c10 ? c10->what_without_backtrace() : e.what();
  m = m.substr(0, m.find('\n'));
  const std::string prefix = "shardopt: ";
  return m.rfind(prefix, 0) == 0 ? m.substr(prefix.size()) : m;
}

// Number checks whose message names the value: "--clip: must be non-negative, got -1".
CLI::Validator number_in(double low, double high, const std::string& what) {
  return CLI::Validator(
      [low, high, what](std::string& text) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(text, &used);
          if (used == text.size() && v >= low && v <= high) return "";
        } catch (const std::exception&) {
        }
        return "must be " + what + ", got " + text;
      },
      what);
}
constexpr double kUnbounded = std::numeric_limits<double>::max();
const CLI::Validator kNonNegative = number_in(0, kUnbounded, "non-negative");
const CLI::Validator kPositive = number_in(std::numeric_limits<double>::denorm_min(), kUnbounded, "positive");

void add_train_options(CLI::App& train, TrainOptions& o) {
  train.add_option("--data", o.data_dir, "folder with Fashion-MNIST's gzipped IDX files")->capture_default_str();
  train.add_option("--model", o.model, "cnn (two convolutions, two linear layers: conv1, conv2, fc1, fc2) or vit (a "
                                       "Vision Transformer on 7x7 patches: embed, block0 .. block3, norm, head)")
      ->check(CLI::IsMember({"cnn", "vit"}))
      ->capture_default_str();
  train.add_option("--epochs", o.epochs, "epochs")->capture_default_str();
  train.add_option("-b,--batch-size", o.batch_size, "global batch: samples per step over all ranks")->capture_default_str();
  train.add_option("--optimizer", o.optimizer, "adam, adamw, sgd (momentum 0.9) or muon (Muon on the conv and linear weights, AdamW on the biases)")
      ->check(CLI::IsMember({"adam", "adamw", "sgd", "muon"}))
      ->capture_default_str();
  train.add_option("--lr", o.lr, "learning rate")->capture_default_str();
  train.add_option("--lr-schedule", o.lr_schedule, "constant, cosine (to 0 over the run) or step (x0.1 at 2/3)")
      ->check(CLI::IsMember({"constant", "cosine", "step"}))
      ->capture_default_str();
  train.add_option("--warmup-steps", o.warmup_steps, "linear learning-rate warm-up")
      ->check(kNonNegative)
      ->capture_default_str();
  train.add_option("--weight-decay", o.weight_decay, "weight decay")->check(kNonNegative)->capture_default_str();
  train.add_option("--clip", o.clip, "clip the gradients' global L2 norm to this (0: off)")
      ->check(kNonNegative)
      ->capture_default_str();
  train.add_option("--seed", o.seed, "seed of the initial weights and the data order")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            const bool digits = !text.empty() && text.size() <= 20 &&
                                text.find_first_not_of("0123456789") == std::string::npos;
            if (digits && (text.size() < 20 || text <= "18446744073709551615")) return "";
            return "must be an integer from 0 to 18446744073709551615, got " + text;
          },
          "UINT64"))
      ->capture_default_str();
  train.add_option("--freeze", o.freeze, "PREFIX@EPOCH or PREFIX@sSTEP: freeze parameters whose names start with PREFIX "
                                         "(e.g. conv@2: from the start of epoch 2; fc1@s300: from step 300)");
  train.add_option("--unfreeze", o.unfreeze, "PREFIX@EPOCH or PREFIX@sSTEP: make them trainable again");
  CLI::Option* dir = train.add_option("--checkpoint-dir", o.checkpoint_dir, "save DIR/last.ckpt at each epoch's end "
                                                                           "(and every --checkpoint-every steps)");
  train.add_option("--checkpoint-every", o.checkpoint_every, "steps between checkpoints within an epoch (0: epochs only)")
      ->check(kNonNegative)
      ->needs(dir)
      ->capture_default_str();
  train.add_flag("--sharded-checkpoint", o.sharded_checkpoint, "each rank writes its own optimizer state")->needs(dir);
  train.add_flag("--sync-checkpoint", o.sync_checkpoint, "save checkpoints before going on (by default they are written "
                 "in the background while training goes on; always synchronous with --survive-failures)")
      ->needs(dir);
  train.add_flag("--resume", o.resume, "continue from DIR/last.ckpt");
  train.add_option("--stop-after-steps", o.stop_after_steps, "stop after this many steps of the run (0: run to the end), as an "
                   "interruption would: nothing is saved at the stop beyond the usual checkpoints")
      ->check(kNonNegative)
      ->capture_default_str();
  train.add_option("--train-samples", o.train_samples, "use only the first N training images (0: all)")
      ->check(kNonNegative)
      ->capture_default_str();
  train.add_option("--test-samples", o.test_samples, "use only the first N test images (0: all)")
      ->check(kNonNegative)
      ->capture_default_str();
  train.add_option("--metrics", o.metrics, "the metrics file (JSON lines: loss, accuracy, samples/s, each rank's "
                                          "state and gradient bytes, freeze and rebalance events) and its chart beside "
                                          "it (.png); default: DIR/metrics.jsonl under --checkpoint-dir DIR; off: none");
  train.add_option("--threads", o.threads, "intra-op threads per rank (0: cores / local ranks)")
      ->check(number_in(0, 1024, "from 0 to 1024"))
      ->capture_default_str();
  train.add_option("--timeout", o.timeout_s, "seconds any collective may wait")->check(kPositive)->capture_default_str();
  train.add_option("--device", o.device, "cpu (Gloo) or cuda (NCCL; each rank takes the GPU of its local rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  CLI::Option* survive = train.add_flag(
      "--survive-failures", o.survive_failures,
      "training goes on when a rank dies: every rank keeps a copy of another rank's shard in host memory, and the "
      "survivors roll back to the last copy and go on at the smaller world size (one line per recovery)");
  train.add_option("--refresh-every", o.refresh_every, "--survive-failures: steps between refreshes of the copies "
                   "(a failure rolls back at most this many steps less one)")
      ->check(kPositive)
      ->needs(survive)
      ->capture_default_str();
  train.add_option("--mixed-precision", o.mixed_precision, "off, bf16 or fp16: parameters and gradients in that "
                   "dtype, fp32 master weights and optimizer state sharded (fp16 with loss scaling)")
      ->check(CLI::IsMember({"off", "bf16", "fp16"}))
      ->capture_default_str();
  train.add_option("--gradient-wire", o.gradient_wire, "exact, bf16 or int8: how each rank's gradients travel to "
                   "their owners (bf16: rounded to bf16, summed in fp32, half the bytes; int8: blocks of 256 with a "
                   "scale each, a quarter)")
      ->check(CLI::IsMember({"exact", "bf16", "int8"}))
      ->capture_default_str();
  train.add_flag("--error-feedback", o.error_feedback, "with --gradient-wire bf16 or int8: each rank adds what rounding dropped "
                 "from its gradients to the next step's (ShardedDDPOptions::error_feedback)");
  train.add_option("--step-in-backward", o.step_in_backward, "auto, on or off: each bucket's optimizer step in the "
                   "backward, as soon as its gradients are reduced, and its parameters sent at once "
                   "(ShardedDDPOptions::step_in_backward); auto: on where the ranks span nodes, unless --clip, "
                   "--mixed-precision fp16, --optimizer muon, --survive-failures or --device cuda")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  train.add_option("--overlap-sync", o.overlap_sync, "auto, on or off: the parameter sync after the step runs "
                   "beside the next forward, the model waiting block by block for its own parameters "
                   "(ShardedDDPOptions::overlap_param_sync); auto: on where the ranks span nodes, unless "
                   "--survive-failures or --device cuda")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  train.add_option("--param-wire", o.param_wire, "exact, bf16 or int8: how the owners' updated parameters travel "
                   "(compressed: fp32 masters on the owners, every rank's parameters the rounded masters)")
      ->check(CLI::IsMember({"exact", "bf16", "int8"}))
      ->capture_default_str();
  train.add_option("--state-format", o.state_format, "fp32, bf16 or int8: how the owners keep the optimizer state "
                   "(bf16: half the bytes, Adam, AdamW and SGD; int8: 8-bit blockwise codes, about a quarter, "
                   "Adam, AdamW, SGD and Muon; OSSOptions::state_format)")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}))
      ->capture_default_str();
}

// ZeRO-1/2's optimizer state format, as `memory` and `plan` take it.
void add_state_format_option(CLI::App& app, std::string& format) {
  app.add_option("--state-format", format, "fp32, bf16 or int8: how ZeRO-1/2's owners keep the optimizer state "
                                           "(bf16: half the bytes, Adam's; int8: 8-bit blockwise codes, Adam's "
                                           "and Muon's; OSSOptions::state_format)")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}))
      ->capture_default_str();
}

// ZeRO-2's gradient wire and error feedback, as `memory` and `plan` take them.
void add_gradient_wire_options(CLI::App& app, std::string& wire, bool& feedback) {
  app.add_option("--gradient-wire", wire, "exact, bf16 or int8: how ZeRO-2's gradients travel to their owners "
                                          "(ShardedDDPOptions::gradient_wire)")
      ->check(CLI::IsMember({"exact", "bf16", "int8"}))
      ->capture_default_str();
  app.add_flag("--error-feedback", feedback, "with a compressed --gradient-wire: each rank's residuals (bf16, the "
               "whole trainable model's on every rank; ShardedDDPOptions::error_feedback), apart as feedback");
}

void add_memory_options(CLI::App& memory, MemoryOptions& o) {
  memory.add_option("--preset", o.preset, "cnn, gpt2-mini, gpt2-small, many-small, llama-7b or llama-70b")->capture_default_str();
  memory.add_option("--spec", o.spec, "a JSON file {\"layers\": [{\"name\": ..., \"shape\": [...]}, ...]} instead of a preset");
  memory.add_option("--world-sizes", o.world_sizes, "world sizes to measure")->delimiter(',')->capture_default_str();
  memory.add_option("--modes", o.modes, "ddp, zero1, zero2, and zero1-bf16, zero2-bf16 (bf16 parameters and "
                                      "gradients, fp32 master weights and state sharded)")
      ->delimiter(',')
      ->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero1-bf16", "zero2-bf16"}))
      ->capture_default_str();
  memory.add_option("--optimizer", o.optimizer, "adam, or muon (Muon on the weight matrices that are not embeddings, "
                                                "one momentum buffer each; Adam on the rest)")
      ->check(CLI::IsMember({"adam", "muon"}))
      ->capture_default_str();
  memory.add_option("--steps", o.steps, "steps before each measurement")->capture_default_str();
  add_gradient_wire_options(memory, o.gradient_wire, o.error_feedback);
  add_state_format_option(memory, o.state_format);
  memory.add_option("--freeze-fraction", o.freeze_fraction, "fraction of the parameters (leading layers) frozen for "
                                                            "the second measurement")->capture_default_str();
  memory.add_option("-o,--out", o.out_dir, "folder for memory.json, memory.csv and memory.png")->capture_default_str();
  memory.add_option("--python", o.python, "Python with matplotlib for the chart (default: the build's)");
  memory.add_flag("--no-chart", o.no_chart, "write memory.json and memory.csv, not the chart");
  memory.add_option("--worker-mode", o.worker_mode)->group("");
  memory.add_option("--worker-out", o.worker_out)->group("");
}

void add_plan_options(CLI::App& plan, PlanOptions& o) {
  plan.add_option("--preset", o.preset, "cnn, gpt2-mini, gpt2-small, many-small, llama-7b or llama-70b")->capture_default_str();
  plan.add_option("--spec", o.spec, "a JSON file {\"layers\": [{\"name\": ..., \"shape\": [...]}, ...]} instead of a preset");
  plan.add_option("--world-sizes", o.world_sizes, "world sizes to plan")->delimiter(',')->check(kPositive)->capture_default_str();
  plan.add_option("--modes", o.modes, "ddp, zero1, zero2, and zero1-bf16, zero2-bf16 (bf16 parameters and "
                                    "gradients, fp32 master weights and state sharded)")
      ->delimiter(',')
      ->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero1-bf16", "zero2-bf16"}))
      ->capture_default_str();
  plan.add_option("--shard-group-size", o.shard_group_size, "hierarchical sharding: shard within blocks of this many "
                                                            "ranks, one replica per block (0: the whole group)")
      ->check(kNonNegative)
      ->capture_default_str();
  plan.add_option("--optimizer", o.optimizer, "adam, or muon (Muon on the weight matrices that are not embeddings or "
                                            "the output layer; Adam on the rest)")
      ->check(CLI::IsMember({"adam", "muon"}))
      ->capture_default_str();
  plan.add_option("--partition", o.partition, "auto, split (equal ranges) or whole (whole parameters per owner)")
      ->check(CLI::IsMember({"auto", "split", "whole"}))
      ->capture_default_str();
  plan.add_option("--bucket-mb", o.bucket_mb, "ZeRO-2's reduce buckets, MiB: at least this, and 1 MiB per rank (0: one per "
                   "parameter, or one per group of split parameters)")
      ->check(kNonNegative)
      ->capture_default_str();
  plan.add_option("--freeze-fraction", o.freeze_fraction, "fraction of the parameters (leading layers) frozen for a "
                                                          "second scenario (0: none)")
      ->check(number_in(0, 0.999999, "in [0, 1)"))
      ->capture_default_str();
  add_gradient_wire_options(plan, o.gradient_wire, o.error_feedback);
  add_state_format_option(plan, o.state_format);
  plan.add_option("--param-wire", o.param_wire, "exact, bf16 or int8: how ZeRO-1/2's parameter sync travels, "
                                                "compressed with fp32 masters on the owners (OSSOptions::param_wire)")
      ->check(CLI::IsMember({"exact", "bf16", "int8"}))
      ->capture_default_str();
  plan.add_option("--intra-node-bandwidth", o.intra_node_gbps, "GB/s each way between ranks of one node (NVLink)")
      ->check(kPositive)
      ->capture_default_str();
  plan.add_option("--inter-node-bandwidth", o.inter_node_gbps, "GB/s each way between nodes, per rank (InfiniBand)")
      ->check(kPositive)
      ->capture_default_str();
  plan.add_option("--ranks-per-node", o.ranks_per_node, "ranks (GPUs) per node")->check(kPositive)->capture_default_str();
  plan.add_option("--collective-latency-us", o.collective_latency_us,
                  "latency of every collective, microseconds (NCCL's ring/Simple base latency)")
      ->check(kNonNegative)
      ->capture_default_str();
  plan.add_option("--hop-latency-us", o.hop_latency_us,
                  "latency of each step of a collective between ranks of one node, microseconds (NCCL's NVLink "
                  "ring/Simple figure)")
      ->check(kNonNegative)
      ->capture_default_str();
  plan.add_option("--network-hop-latency-us", o.network_hop_latency_us,
                  "latency of each step of a collective between nodes, microseconds (NCCL's network ring/Simple "
                  "figure)")
      ->check(kNonNegative)
      ->capture_default_str();
  plan.add_option("-o,--out", o.out_dir, "folder for plan.json, plan.csv and plan.png")->capture_default_str();
  plan.add_option("--python", o.python, "Python with matplotlib for the chart (default: the build's)");
  plan.add_flag("--no-chart", o.no_chart, "write plan.json and plan.csv, not the chart");
}

}  // namespace

// LibTorch's warnings (TORCH_WARN: a checkpoint that starts the residuals at zero, ...) as one line
// each, without c10's time stamp, source file and function.
class OneLineWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { std::fprintf(stderr, "warning: %s\n", warning.msg().c_str()); }
};

int main(int argc, char** argv) {
  // Ranks share their launcher's stderr: each line leaves in one write(), so ranks' lines never
  // mix (unbuffered, glibc writes a formatted line in pieces of 128 bytes).
  static char error_buffer[1 << 14];
  std::setvbuf(stderr, error_buffer, _IOLBF, sizeof(error_buffer));
  static OneLineWarnings warnings;
  c10::WarningUtils::set_warning_handler(&warnings);  // this thread's, where training runs
  CLI::App app{"shardopt: sharded optimizer state and gradients for LibTorch data-parallel training"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shardopt " SHARDOPT_VERSION);
  int ranks = 0;
  TrainOptions train_options;
  train_options.data_dir = kDefaultFashionMnistDir;
  CLI::App* train = app.add_subcommand("train", "train a CNN or a ViT on Fashion-MNIST with OSS + ShardedDDP, a freeze "
                                                "schedule and checkpoints");
  train->add_option("-n,--nproc", ranks, "start N local ranks (without a launcher; default: 1, or the launcher's)")
      ->check(kPositive);
  add_train_options(*train, train_options);
  MemoryOptions memory_options;
  CLI::App* memory = app.add_subcommand("memory", "measure memory per rank for plain data parallel, OSS (ZeRO-1) "
                                                  "and OSS + ShardedDDP (ZeRO-2) at several world sizes");
  add_memory_options(*memory, memory_options);
  PlanOptions plan_options;
  CLI::App* plan = app.add_subcommand("plan", "plan memory and traffic per rank for any world size from the real "
                                              "layout, without allocating tensors");
  add_plan_options(*plan, plan_options);

  if (argc > 1 && argv[1][0] != '-' && std::string(argv[1]) != "train" && std::string(argv[1]) != "memory" &&
      std::string(argv[1]) != "plan") {
    std::fprintf(stderr, "shardopt: unknown subcommand '%s' (the subcommands: train, memory, plan; see shardopt --help)\n", argv[1]);
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const char* sub = *train ? " train" : *memory ? " memory" : *plan ? " plan" : "";
    std::fprintf(stderr, "shardopt: %s (see shardopt%s --help)\n", e.what(), sub);
    return e.get_exit_code() == 0 ? 2 : e.get_exit_code();
  }

  const bool launched = under_a_launcher();
  const char* rank = shardopt::env_var("RANK");
  try {
    if (*train) {
      if (ranks < 0) throw std::invalid_argument("-n must be positive, got " + std::to_string(ranks));
      // Checked here too, so that N ranks do not each say it.
      if (ranks > 0 && train_options.batch_size % ranks != 0) {
        throw std::invalid_argument("--batch-size " + std::to_string(train_options.batch_size) +
                                    " (global) must be a positive multiple of the world size " + std::to_string(ranks));
      }
      if (!launched && ranks > 0) return run_local_ranks(ranks, argv, train_options.survive_failures);
      if (launched && ranks > 0) {
        const shardopt::LaunchEnv env = shardopt::read_launch_env(/*need_master=*/false);
        if (env.world_size == 1 && ranks > 1 && env.convention != "RANK/WORLD_SIZE") {
          // One task of srun or mpirun (a shell inside an allocation): it starts the ranks asked
          // for, as without a launcher; they must not read that task's variables as their own.
          std::printf("shardopt: one %s task (%s=1): -n %d starts %d ranks on this node\n", env.convention.c_str(),
                      env.variables[1].c_str(), ranks, ranks);
          std::fflush(stdout);
          for (const auto& v : env.variables) ::unsetenv(v.c_str());
          return run_local_ranks(ranks, argv, train_options.survive_failures);
        }
        if (env.world_size != ranks) {
          throw std::invalid_argument("-n " + std::to_string(ranks) + " contradicts " + env.variables[1] + "=" +
                                      std::to_string(env.world_size) + " from " +
                                      (env.convention == "RANK/WORLD_SIZE" ? std::string("the launcher") : env.convention) +
                                      " (drop -n, or ask the launcher for " + std::to_string(ranks) + " ranks)");
        }
      }
      if (!launched) {  // one rank, no launcher: a world of one
        setenv("RANK", "0", 1);
        setenv("WORLD_SIZE", "1", 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", "0", 1);  // any free port, bound by this process's store
      }
      return run_train(train_options);
    }
    if (*plan) return run_plan(plan_options);
    return run_memory(memory_options, argv);
  } catch (const std::exception& e) {
    if (launched && rank) {
      std::fprintf(stderr, "shardopt: rank %s: %s\n", rank, one_line(e).c_str());
    } else {
      std::fprintf(stderr, "shardopt: %s\n", one_line(e).c_str());
    }
    return 1;
  }
}
