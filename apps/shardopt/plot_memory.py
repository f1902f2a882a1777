#!/usr/bin/env python3
"""Draws `shardopt memory`'s report as stacked bars per mode and world size.

    plot_memory.py memory.json memory.png

One panel per scenario (all trainable, part frozen); in each, a group of bars per world size and
a bar per mode, stacked: parameters, gradients, optimizer state, buckets, other (peak resident
memory minus what was counted). The largest rank of each run is drawn; a black tick marks the
ZeRO paper's formula (parameters + gradients + state).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PARTS = [("params", "parameters"), ("grads", "gradients"), ("state", "optimizer state (+ fp32 masters)"),
         ("buckets", "buckets")]
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#BBBBBB"]
MODE_NAMES = {"ddp": "DDP", "zero1": "OSS (ZeRO-1)", "zero2": "OSS + ShardedDDP (ZeRO-2)",
              "zero1-bf16": "OSS bf16 (ZeRO-1)", "zero2-bf16": "OSS + ShardedDDP bf16 (ZeRO-2)"}


def largest(rows):
    best = {}
    for r in rows:
        key = (r["scenario"], r["world"], r["mode"])
        if key not in best or r["state"] + r["grads"] > best[key]["state"] + best[key]["grads"]:
            best[key] = r
    return best


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
    best = largest(rows)
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    worlds = sorted({r["world"] for r in rows})
    modes = [m for m in MODE_NAMES if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 5.2), sharey=True, squeeze=False)
    width = 0.8 / len(modes)
    for ax, scenario in zip(axes[0], scenarios):
        for m, mode in enumerate(modes):
            for w, world in enumerate(worlds):
                r = best.get((scenario, world, mode))
                if r is None:
                    continue
                x = w + (m - (len(modes) - 1) / 2) * width
                bottom = 0.0
                counted = sum(r[k] for k, _ in PARTS)
                values = [r[k] for k, _ in PARTS] + [max(0.0, r["peak_rss"] - counted)]
                labels = [name for _, name in PARTS] + ["other (peak RSS - counted)"]
                for v, color, label in zip(values, COLORS, labels):
                    ax.bar(x, v / 2**20, width * 0.95, bottom=bottom / 2**20, color=color,
                           label=label if (m == 0 and w == 0) else None)
                    bottom += v
                formula = sum(r["formula"][k] for k in ("params", "grads", "state"))
                ax.plot([x - width * 0.45, x + width * 0.45], [formula / 2**20] * 2, color="black", linewidth=2,
                        label="ZeRO formula" if (m == 0 and w == 0) else None)
                ax.text(x, -0.02, MODE_NAMES[mode].split(" ")[0] if mode == "ddp" else mode, rotation=90,
                        ha="center", va="top", fontsize=7, transform=ax.get_xaxis_transform())
        ax.set_xticks(range(len(worlds)))
        ax.set_xticklabels([f"\n\n\nworld {w}" for w in worlds])
        ax.set_title(f"{report['model']}: {scenario}")
        ax.set_ylabel("MiB per rank (largest rank)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
