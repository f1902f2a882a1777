#!/usr/bin/env python3
"""Runs the data-parallel comparison side by side and prints a markdown table.

    bash bench/ddp/setup_peers.sh $VENV/bin/python       # fairscale 0.4.13 into that environment
    python3 bench/ddp/run_ddp_comparison.py --build build --python $VENV/bin/python [--rounds 3] [--world 2]

For each model, every implementation runs once per round (rounds interleave the
implementations, so machine noise spreads over all of them), each as --world processes through
tools/launch. The peers: DDP + ZeroRedundancyOptimizer, DDP + Adam, FSDP2, fairscale's
ShardedDataParallel + OSS, DDP + fairscale's OSS. Every implementation times its steps the same
way (--timing). Reports, per implementation: the median over rounds of rank 0's median step
time, the largest per-rank peak RSS, and for shardopt the blocking cost of the trainability
check per step, one rebuild after a freeze, and the freeze measured with the partition kept
and re-partitioned (the re-partitioned runs are the main ones; kept runs add one per round).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPLS = ["shardopt-sharded", "shardopt-allreduce", "torch-ddp_zero", "torch-ddp_adam", "torch-fsdp2", "torch-fs_sdp",
         "torch-ddp_fsoss"]
PEERS = ["torch-ddp_zero", "torch-ddp_adam", "torch-fsdp2", "torch-fs_sdp", "torch-ddp_fsoss"]


def run(impl, model, args, extra=()):
    if impl.startswith("shardopt-"):
        cmd = [os.path.join(args.build, "bench", "ddp_bench"), "--impl", impl.split("-")[1], *extra]
    else:
        cmd = [args.python, os.path.join(ROOT, "bench", "ddp", "peers", "ddp_peers.py"), "--impl", impl.split("-")[1]]
    cmd += ["--model", model, "--steps", str(args.steps), "--warmup", str(args.warmup), "--timing", args.timing]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "launch"), "-n", str(args.world), "--timeout", "900",
                          *cmd],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{impl} {model} failed:\n{out.stdout}\n{out.stderr}")
    rows = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines() if "] {" in line]
    return {r["rank"]: r for r in rows}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", required=True, help="interpreter of the environment with the torch wheel")
    parser.add_argument("--models", default="gpt2,small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timing", choices=["back-to-back", "barrier"], default="back-to-back",
                        help="how every implementation times its steps: each from the end of the one before "
                             "(what a training loop sees), or each after a barrier")
    args = parser.parse_args()
    try:
        subprocess.run([args.python, "-c", "import fairscale"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        raise SystemExit("fairscale is not installed in that environment: run bench/ddp/setup_peers.sh " + args.python)

    for model in args.models.split(","):
        results = {impl: [] for impl in IMPLS}
        kept = []  # shardopt-sharded with OSSOptions::rebalance off, for the freeze measurement
        for _ in range(args.rounds):
            for impl in IMPLS:
                results[impl].append(run(impl, model, args))
            kept.append(run("shardopt-sharded", model, args, ("--rebalance", "0")))
        step = {i: statistics.median(r[0]["median_step_ms"] for r in results[i]) for i in IMPLS}
        peak = {i: max(max(r[k]["peak_rss_mb"] for k in r) for r in results[i]) for i in IMPLS}
        added = {i: max(max(r[k]["added_rss_mb"] for k in r) for r in results[i]) for i in IMPLS}
        params = results[IMPLS[0]][0][0]["params"]
        print(f"\n### model {model} ({params:,} parameters), world {args.world}, Gloo, 1 intra-op thread per rank, "
              f"steps timed {args.timing}\n")
        print("| implementation | step time (ms, median) | peak RSS per rank (MB) | RSS added after start-up (MB) |")
        print("|---|---|---|---|")
        for i in IMPLS:
            print(f"| {i} | {step[i]:.1f} | {peak[i]:.0f} | {added[i]:.0f} |")
        fastest = min(PEERS, key=lambda i: step[i])
        leanest = min(PEERS, key=lambda i: peak[i])
        print(f"\nstep time shardopt-sharded / fastest peer ({fastest}): {step['shardopt-sharded'] / step[fastest]:.2f}; "
              f"peak RSS shardopt-sharded / leanest peer ({leanest}): {peak['shardopt-sharded'] / peak[leanest]:.2f}")
        checks = [r[0]["check_ms"] for r in results["shardopt-sharded"]]
        rebuilds = [r[0]["rebuild_ms"] for r in results["shardopt-sharded"]]
        print(f"trainability check, blocking time per step: {statistics.median(checks):.3f} ms "
              f"({100 * statistics.median(checks) / step['shardopt-sharded']:.2f}% of a step); "
              f"one rebuild after a freeze: {statistics.median(rebuilds):.2f} ms")
        last = results["shardopt-sharded"][-1]
        print("shardopt-sharded gradient bytes after backward, fraction of all gradients: " +
              ", ".join(f"rank {k} {last[k]['grad_fraction']:.3f}" for k in sorted(last)) +
              f"; partition imbalance {last[0]['imbalance']:.4f}")
        rebal = results["shardopt-sharded"]
        med = lambda rows, key: statistics.median(r[0][key] for r in rows)
        print(f"after freezing the first two tensors: trainable-work imbalance kept {med(kept, 'freeze_imbalance'):.4f}"
              f" / re-partitioned {med(rebal, 'freeze_imbalance'):.4f}; re-partition took "
              f"{med(rebal, 'rebalance_ms'):.1f} ms and moved {med(rebal, 'moved_state_bytes') / 1e6:.1f} MB of "
              f"optimizer state on rank 0; step time after the freeze: kept {med(kept, 'after_freeze_step_ms'):.1f} ms"
              f" / re-partitioned {med(rebal, 'after_freeze_step_ms'):.1f} ms; peak RSS per rank including the "
              f"freeze: kept {max(max(r[k]['peak_rss_with_freeze_mb'] for k in r) for r in kept):.0f} MB / "
              f"re-partitioned {max(max(r[k]['peak_rss_with_freeze_mb'] for k in r) for r in rebal):.0f} MB")


if __name__ == "__main__":
    main()
