#!/usr/bin/env python3
"""Measures Resilient's targets with survive_bench and prints, per target, the measured value and
whether it holds (exit 1 when one does not). Not a test: it times a loaded machine.

    python3 bench/resilience/check_targets.py [--build build] [--rounds 2]

Targets (docs/reliability.md, docs/benchmarks.md "Recovery when a rank dies"), GPT-2 shape,
OSS(Adam) + ShardedDDP:
  - copies refreshed every 10 steps cost at most 1.05x the step without copies (4 ranks);
  - from a SIGKILL to the survivors' first step after recovery: at most 2.5 s at 4 -> 3 ranks,
    3 s at 8 -> 7 (the slowest survivor, each round);
  - a rank stopped with SIGSTOP: at most the hung-rank timeout (10 s) + 2.5 s from the stop.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "tools", "launch")


def run(args):
    p = subprocess.run([sys.executable, LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=1800)
    records = [json.loads(m.group(0)) for m in re.finditer(r"\{.*\}", p.stdout)]
    return p, records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    bench = os.path.join(opts.build, "bench", "survive_bench")
    rows = []

    p, records = run(["-n", "4", bench, "--refresh-every", "0,10", "--steps", "100", "--rounds", str(opts.rounds)])
    ratio = [r["mean_ratio_to_first"] for r in records if r.get("refresh_every") == 10]
    rows.append(("copies every 10 steps, 4 ranks: mean step / without copies", "<= 1.05",
                 f"{ratio[0]:.3f}" if ratio else "no result", bool(ratio) and ratio[0] <= 1.05, p))

    with tempfile.TemporaryDirectory() as tmp:
        for world, limit, stop in ((4, 2.5, False), (8, 3.0, False), (4, 12.5, True)):
            for round_ in range(opts.rounds):
                stamp = os.path.join(tmp, f"stamp-{world}-{int(stop)}-{round_}")
                args = ["--keep-going", *(["--finish-grace", "5"] if stop else []), "-n", str(world), bench,
                        "--refresh-every", "10", "--steps", "30", "--kill-rank", "2", "--kill-at-step", "17",
                        "--kill-stamp", stamp, *(["--stop"] if stop else [])]
                p, records = run(args)
                times = [r["kill_to_first_step_s"] for r in records if "kill_to_first_step_s" in r]
                worst = max(times) if len(times) == world - 1 else None
                what = (f"{'SIGSTOP' if stop else 'SIGKILL'} of rank 2, {world} -> {world - 1} ranks: from the "
                        f"{'stop' if stop else 'kill'} to the slowest survivor's first step (round {round_ + 1})")
                rows.append((what, f"<= {limit} s", f"{worst:.2f} s" if worst is not None else
                             f"{len(times)} of {world - 1} survivors reported", worst is not None and worst <= limit, p))

    width = max(len(r[0]) for r in rows)
    print(f"{'target':<{width}}  {'bound':<9}  {'measured':<12}  result")
    for what, bound, measured, ok, _ in rows:
        print(f"{what:<{width}}  {bound:<9}  {measured:<12}  {'pass' if ok else 'FAIL'}")
    failed = [r for r in rows if not r[3]]
    for what, _, _, _, p in failed:
        print(f"\n--- {what}: the run's output ---\n{p.stdout[-3000:]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
