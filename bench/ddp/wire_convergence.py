#!/usr/bin/env python3
"""Trains with each wire combination and draws their loss curves in one chart.

    wire_convergence.py --shardopt build/apps/shardopt/shardopt --model vit --world-sizes 2,4 \
        --out wires-vit.png [--epochs 5] [--combos exact,bf16,int8,int8+ef] [-- more train options]
    wire_convergence.py --shardopt build/apps/shardopt/shardopt --out wires-vit.png --replot wires-vit.json

Runs `shardopt train -n W --model M` with the model's freeze schedule (the CNN: conv frozen for
epoch 3, as in the README; the ViT: embed, block0 and block1 frozen for epoch 3) once per world
size and combination, from the same seed. A combination names both wires: "bf16" is
`--gradient-wire bf16 --param-wire bf16`, "int8" the same with int8, "+ef" adds
`--error-feedback`, and "grad-bf16" or "param-int8" compress one side only. Draws, one panel per
world size, the running mean of rank 0's loss (over 50 steps) of every combination, with each
run's final test accuracy in the legend, and below it each one's difference to exact's; prints a Markdown table of the test accuracy after each
epoch, the difference to exact's final accuracy and the wall time; and writes everything to the
chart's name with .json.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SCHEDULES = {
    "cnn": ["--freeze", "conv@3", "--unfreeze", "conv@4"],
    "vit": ["--freeze", "embed@3", "--freeze", "block0@3", "--freeze", "block1@3",
            "--unfreeze", "embed@4", "--unfreeze", "block0@4", "--unfreeze", "block1@4"],
}
WINDOW = 50


def wire_args(combo):
    """`exact`, `bf16`, `int8`, `grad-bf16`, `param-int8`, each with an optional `+ef`."""
    name, _, feedback = combo.partition("+")
    if feedback not in ("", "ef"):
        raise SystemExit(f"combination '{combo}': only '+ef' may follow the wires")
    args = []
    if name.startswith("grad-"):
        args = ["--gradient-wire", name[5:]]
    elif name.startswith("param-"):
        args = ["--param-wire", name[6:]]
    elif name != "exact":
        args = ["--gradient-wire", name, "--param-wire", name]
    return args + (["--error-feedback"] if feedback else [])


def run(shardopt, world, model, combo, epochs, extra, folder):
    metrics = os.path.join(folder, f"{model}-{world}-{combo}.jsonl")
    cmd = [shardopt, "train", "-n", str(world), "--model", model, "--epochs", str(epochs), *SCHEDULES[model],
           *wire_args(combo), "--metrics", metrics, *extra]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}")
    accuracy = [float(a) for a in re.findall(r"test accuracy (\d+\.\d+)% \(", p.stdout)]
    seconds = float(re.search(r"done: \d+ steps in ([\d.]+) s", p.stdout).group(1))
    losses = {}
    with open(metrics) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                losses[r["step"]] = r["loss"]
    return {"world": world, "combo": combo, "command": " ".join(cmd[1:]), "accuracy": accuracy, "seconds": seconds,
            "loss": [losses[s] for s in sorted(losses)]}


def running_mean(xs):
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - WINDOW] if i >= WINDOW else 0.0)
        out.append(total / min(i + 1, WINDOW))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shardopt", required=True)
    ap.add_argument("--model", choices=sorted(SCHEDULES), default="vit")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--combos", default="exact,bf16,int8,bf16+ef,int8+ef")
    ap.add_argument("--out", required=True, help="the chart (.png); the runs go to the same name with .json")
    ap.add_argument("--replot", metavar="JSON", help="draw the chart and the table of an earlier run's .json only")
    ap.add_argument("extra", nargs="*", help="more options for shardopt train, after --")
    a = ap.parse_args()
    if a.replot:
        with open(a.replot) as f:
            saved = json.load(f)
        a.model, a.epochs, runs = saved["model"], saved["epochs"], saved["runs"]
        worlds = list(dict.fromkeys(r["world"] for r in runs))
    else:
        worlds = [int(w) for w in a.world_sizes.split(",")]
        combos = a.combos.split(",")
        if combos[0] != "exact":
            raise SystemExit("--combos must start with exact: the others are compared with it")
        runs = []
        with tempfile.TemporaryDirectory(prefix="shardopt-wires-") as folder:
            for world in worlds:
                for combo in combos:
                    r = run(a.shardopt, world, a.model, combo, a.epochs, a.extra, folder)
                    print(f"world {world} {combo}: test accuracy {r['accuracy'][-1]:.2f}% in {r['seconds']:.1f} s",
                          flush=True)
                    runs.append(r)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump({"model": a.model, "epochs": a.epochs, "runs": runs}, f)
    # Above: each combination's loss; below: its difference to the exact wires' loss.
    fig, axes = plt.subplots(2, len(worlds), figsize=(6.5 * len(worlds), 7.5), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    for column, world in enumerate(worlds):
        ax, diff = axes[0][column], axes[1][column]
        exact = running_mean(next(r for r in runs if r["world"] == world and r["combo"] == "exact")["loss"])
        for r in (r for r in runs if r["world"] == world):
            mean = running_mean(r["loss"])
            line, = ax.plot(mean, linewidth=1.2, label=f"{r['combo']}: {r['accuracy'][-1]:.2f}%")
            diff.plot([m - e for m, e in zip(mean, exact)], linewidth=1.0, color=line.get_color())
        ax.set_title(f"{a.model}, {world} ranks, {a.epochs} epochs")
        ax.set_ylabel(f"loss (rank 0, mean of {WINDOW} steps)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(title="wires: test accuracy", fontsize=8)
        diff.set_xlabel("step")
        diff.set_ylabel("loss minus the exact wires' loss")
        diff.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"\n| ranks | wires | test accuracy per epoch (%) | against exact (pt) | wall time (s) |")
    print("|---|---|---|---|---|")
    for r in runs:
        exact = next(q for q in runs if q["world"] == r["world"] and q["combo"] == "exact")["accuracy"][-1]
        print(f"| {r['world']} | {r['combo']} | {', '.join(f'{x:.2f}' for x in r['accuracy'])} | "
              f"{r['accuracy'][-1] - exact:+.2f} | {r['seconds']:.1f} |")
    print(f"\nwrote {a.out} and {os.path.splitext(a.out)[0]}.json")


if __name__ == "__main__":
    sys.exit(main())
