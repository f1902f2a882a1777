#!/usr/bin/env python3
"""Draws `shardopt memory`'s report.

    plot_memory.py memory.json memory.png

One row per scenario (all trainable, part frozen). Left: the model state every rank holds, one bar
per rank, grouped by world size and mode, stacked: parameters, gradients, optimizer state (with
fp32 masters), buckets; a black line marks the ZeRO paper's formula for the mode, so the saving
and any imbalance between ranks are seen at a glance. Right, on its own scale: what the runtime
costs every process whatever the model (LibTorch and Gloo, measured before the model exists),
and the largest rank's transient memory (peak minus runtime minus model state) per run.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PARTS = [("params", "parameters"), ("grads", "gradients"), ("state", "optimizer state (+ fp32 masters)"),
         ("buckets", "buckets"), ("feedback", "error-feedback residuals")]
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#937860"]
MODE_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero1-bf16": "ZeRO-1\nbf16",
              "zero2-bf16": "ZeRO-2\nbf16"}
MIB = 2.0 ** 20


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        report = json.load(f)
    rows = report["rows"]
    if not rows:
        print("plot_memory.py: the report has no rows", file=sys.stderr)
        return 1
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    worlds = sorted({r["world"] for r in rows})
    modes = [m for m in MODE_NAMES if any(r["mode"] == m for r in rows)]
    runtime = max(r["runtime"] for r in rows)
    bars = sum(w for w in worlds) * len(modes)
    fig, axes = plt.subplots(len(scenarios), 2, figsize=(max(10, 0.16 * bars + 5), 4.8 * len(scenarios)),
                             squeeze=False, gridspec_kw={"width_ratios": [5, 1]})
    for row, scenario in enumerate(scenarios):
        ax, side = axes[row]
        x, ticks, labels, group_starts = 0.0, [], [], []
        transient = []
        top = 0.0  # the tallest bar or formula line, MiB
        for world in worlds:
            group_starts.append((x, world))
            for mode in modes:
                ranks = sorted((r for r in rows if r["scenario"] == scenario and r["world"] == world and r["mode"] == mode),
                               key=lambda r: r["rank"])
                if not ranks:
                    continue
                start = x
                for r in ranks:
                    bottom = 0.0
                    for (key, name), color in zip(PARTS, COLORS):
                        ax.bar(x, r.get(key, 0) / MIB, 0.85, bottom=bottom / MIB, color=color,
                               label=name if (x == 0 and row == 0) else None)
                        bottom += r.get(key, 0)
                    top = max(top, bottom / MIB)
                    x += 1
                formula = sum(ranks[0]["formula"][k] for k in ("params", "grads", "state"))
                top = max(top, formula / MIB)
                ax.plot([start - 0.45, x - 0.55], [formula / MIB] * 2, color="black", linewidth=1.6,
                        label="ZeRO formula" if (start == 0 and row == 0) else None)
                ticks.append((start + x - 1) / 2)
                labels.append(MODE_NAMES[mode])
                largest = max(ranks, key=lambda r: r["peak_rss"])
                counted = sum(largest.get(k, 0) for k, _ in PARTS)
                transient.append((f"{MODE_NAMES[mode].replace(chr(10), ' ')} @{world}",
                                  max(0.0, largest["peak_rss"] - largest["runtime"] - counted)))
                x += max(0.8, 3.0 - len(ranks))  # room for the label under a group of few bars
            x += 1.2
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=7)
        for gx, world in group_starts:
            ax.text(gx, -0.16, f"world {world}", transform=ax.get_xaxis_transform(), fontsize=9, ha="left")
        # Room above the tallest bar: a stacked bar's thin top segment (the buckets) pins
        # matplotlib's automatic limit to the stack's top, which would cut it off.
        ax.set_ylim(0, top * 1.08 if top > 0 else 1)
        ax.set_ylabel("MiB per rank (one bar per rank)")
        ax.set_title(f"{report['model']}: model state per rank, {scenario}")
        ax.grid(axis="y", alpha=0.3)
        side.bar([0], [runtime / MIB], 0.6, color="#BBBBBB")
        side.text(0, runtime / MIB, f"{runtime / MIB:.0f}", ha="center", va="bottom", fontsize=8)
        side.bar(range(1, len(transient) + 1), [t / MIB for _, t in transient], 0.6, color="#8172B3")
        side.set_xticks(range(len(transient) + 1))
        side.set_xticklabels(["runtime (any model)"] + [name for name, _ in transient], rotation=90, fontsize=6)
        side.set_title("fixed cost and transient\n(largest rank), MiB", fontsize=9)
        side.grid(axis="y", alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="lower center", ncol=len(names))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
