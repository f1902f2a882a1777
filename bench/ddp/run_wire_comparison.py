#!/usr/bin/env python3
"""shardopt's wires against the peers, side by side, over loopback or over links shaped like a
network, and prints markdown tables.

    python3 bench/ddp/run_wire_comparison.py --python $VENV/bin/python [--link loopback|veth|RATE]
        [--model gpt2] [--world 2] [--rounds 3] [--steps 30] [--warmup 5] [--impls exact,bf16,int8,ddp_adam,...]

Every implementation runs once per round, in turn (rounds interleave them, so the machine's noise
spreads over all), as --world processes:
- --link loopback (the default): through tools/launch, every rank on 127.0.0.1;
- --link veth: through tools/launch_hosts, every rank on a host of its own (a network namespace)
  joined by a bridge, links not shaped;
- --link RATE (10gbit, 2500mbit, ...): the same, each link capped at RATE in each direction.

shardopt's implementations are `ddp_bench --impl sharded --gradient-wire W --param-wire W`
(exact, bf16, int8; int8_ef adds --error-feedback true; exact_after is exact with the step after
the backward, --step-in-backward off; exact_2m exact with 2 MiB buckets); the peers are `ddp_peers.py --impl P`:
ddp_adam, ddp_zero, fsdp2, fs_sdp, ddp_fsoss (exact) and ddp_bf16 (DDP with bf16_compress_hook).
Reports rank 0's median step per round, the median over rounds, each round's ratio to exact and
to the fastest exact peer of that round, and shardopt's bytes on the wire per rank and step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIRES = {"exact": ["--gradient-wire", "exact", "--param-wire", "exact"],
         "bf16": ["--gradient-wire", "bf16", "--param-wire", "bf16"],
         "int8": ["--gradient-wire", "int8", "--param-wire", "int8"],
         "int8_ef": ["--gradient-wire", "int8", "--param-wire", "int8", "--error-feedback", "true"],
         "exact_after": ["--gradient-wire", "exact", "--param-wire", "exact", "--step-in-backward", "off"],
         "exact_2m": ["--gradient-wire", "exact", "--param-wire", "exact", "--reduce-bucket-bytes", "2097152"]}
EXACT_PEERS = ["ddp_adam", "ddp_zero", "fsdp2", "fs_sdp", "ddp_fsoss"]
PEERS = EXACT_PEERS + ["ddp_bf16"]


def launcher(args):
    if args.link == "loopback":
        return [sys.executable, os.path.join(ROOT, "tools", "launch"), "-n", str(args.world), "--timeout", "900"]
    rate = [] if args.link == "veth" else ["--rate", args.link]
    return [sys.executable, os.path.join(ROOT, "tools", "launch_hosts"), "-n", str(args.world), *rate,
            "--timeout", "900"]


def run(impl, args):
    if impl in WIRES:
        cmd = [os.path.join(args.build, "bench", "ddp_bench"), "--impl", "sharded", "--freeze-steps", "0", *WIRES[impl]]
    else:
        cmd = [args.python, os.path.join(ROOT, "bench", "ddp", "peers", "ddp_peers.py"), "--impl", impl]
    cmd += ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(launcher(args) + cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{impl} failed:\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}")
    rows = [json.loads(line.split("] ", 1)[1]) for line in out.stdout.splitlines() if "] {" in line]
    return {r["rank"]: r for r in rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", required=True, help="interpreter of the environment with the torch wheel")
    parser.add_argument("--link", default="loopback", help="loopback, veth or a rate such as 10gbit")
    parser.add_argument("--model", choices=["gpt2", "small"], default="gpt2")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--impls", default="exact,bf16,int8,ddp_adam,ddp_bf16,fs_sdp,ddp_fsoss")
    args = parser.parse_args()
    impls = args.impls.split(",")
    for i in impls:
        if i not in WIRES and i not in PEERS:
            parser.error(f"unknown implementation '{i}' (expected one of {', '.join([*WIRES, *PEERS])})")
    if any(i in ("fs_sdp", "ddp_fsoss") for i in impls):
        try:
            subprocess.run([args.python, "-c", "import fairscale"], check=True, capture_output=True)
        except subprocess.CalledProcessError:
            raise SystemExit("fairscale is not installed in that environment: run bench/ddp/setup_peers.sh " + args.python)

    results = {i: [] for i in impls}
    for r in range(args.rounds):
        for i in impls:
            results[i].append(run(i, args))
            print(f"round {r + 1} {i}: {results[i][-1][0]['median_step_ms']:.1f} ms", file=sys.stderr, flush=True)

    step = {i: [res[0]["median_step_ms"] for res in results[i]] for i in impls}
    exact_peers = [i for i in impls if i in EXACT_PEERS]
    fastest = [min(step[p][r] for p in exact_peers) for r in range(args.rounds)] if exact_peers else None
    print(f"\nmodel {args.model}, world {args.world}, link {args.link}, {args.rounds} rounds of {args.steps} steps "
          f"after {args.warmup}; rank 0's median step (ms)\n")
    head = "| implementation | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " | median |"
    if "exact" in impls:
        head += " per round / exact |"
    if fastest:
        head += " per round / fastest exact peer |"
    head += " bytes per rank and step |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for i in impls:
        cells = [f"{t:.1f}" for t in step[i]] + [f"{statistics.median(step[i]):.1f}"]
        if "exact" in impls:
            cells.append(", ".join(f"{t / e:.2f}" for t, e in zip(step[i], step["exact"])))
        if fastest:
            cells.append(", ".join(f"{t / f:.2f}" for t, f in zip(step[i], fastest)))
        sent = results[i][-1][0].get("wire_bytes_per_step")
        cells.append("" if sent is None else f"{sent / 1e6:.1f} MB" if sent >= 1e6 else f"{sent / 1e3:.1f} kB")
        print(f"| {i} | " + " | ".join(cells) + " |")
    if fastest:
        names = [min(exact_peers, key=lambda p: step[p][r]) for r in range(args.rounds)]
        print(f"\nfastest exact peer per round: {', '.join(names)}")


if __name__ == "__main__":
    main()
