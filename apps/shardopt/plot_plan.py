#!/usr/bin/env python3
"""Draws `shardopt plan`'s report.

    plot_plan.py plan.json plan.png

Per scenario, two panels. Above: the busiest rank's memory per configuration (mode at each world
size), stacked: parameters, gradients, buckets, fp32 masters, error-feedback residuals, optimizer
state, in GiB; a black
tick marks the least loaded rank's total, so an imbalance shows as a gap. Below: the bytes the
rank that moves the most sends per step, within its block and across blocks, and the communication time
they imply at the report's link bandwidths.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PARTS = [("params", "parameters"), ("grads", "gradients"), ("buckets", "buckets"), ("masters", "fp32 masters"),
         ("feedback", "error-feedback residuals"), ("state", "optimizer state")]
COLORS = ["#4C72B0", "#DD8452", "#C44E52", "#8172B3", "#937860", "#55A868"]
GIB = 2.0 ** 30


def label(c):
    block = f"/{c['shard_group_size']}" if c["shard_group_size"] else ""
    return f"{c['mode']}\n{c['world_size']}{block}"


def main(src, dst):
    report = json.load(open(src))
    configs = report["configs"]
    scenarios = list(dict.fromkeys(c["scenario"] for c in configs))
    per_scenario = len(configs) // len(scenarios)
    fig, axes = plt.subplots(2 * len(scenarios), 1, figsize=(max(9, 0.6 * per_scenario + 3), 4.2 * 2 * len(scenarios)),
                             squeeze=False)
    for row, scenario in enumerate(scenarios):
        cs = [c for c in configs if c["scenario"] == scenario]
        xs = range(len(cs))
        ax = axes[2 * row][0]
        bottom = [0.0] * len(cs)
        for (key, name), color in zip(PARTS, COLORS):
            values = [c["max_rank"].get(key, 0) / GIB for c in cs]
            ax.bar(xs, values, bottom=bottom, color=color, label=name, width=0.7)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.scatter(xs, [c["min_rank"]["total"] / GIB for c in cs], marker="_", s=300, color="black",
                   label="least loaded rank", zorder=3)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([label(c) for c in cs], fontsize=8)
        ax.set_ylabel("GiB per rank (busiest rank)")
        ax.set_title(f"{report['model']}: memory per rank, {scenario}")
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(axis="y", alpha=0.3)
        ax = axes[2 * row + 1][0]
        within = [c["max_traffic_rank"]["bytes_sent_within_block"] / GIB for c in cs]
        across = [c["max_traffic_rank"]["bytes_sent_across_blocks"] / GIB for c in cs]
        ax.bar(xs, within, color="#4C72B0", label="sent within a block", width=0.7)
        ax.bar(xs, across, bottom=within, color="#DD8452", label="sent across blocks", width=0.7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([label(c) for c in cs], fontsize=8)
        ax.set_ylabel("GiB sent per step (the rank that moves the most)")
        links = report["links"]
        ax.set_title(f"{scenario}: traffic per step; time at {links['intra_node_gbps']:g} GB/s in a node, "
                     f"{links['inter_node_gbps']:g} GB/s across", fontsize=10)
        twin = ax.twinx()
        twin.plot(list(xs), [c["comm_seconds_per_step"] * 1e3 for c in cs], "ko-", label="communication (ms)")
        twin.set_ylabel("ms per step")
        twin.set_ylim(bottom=0)
        handles, names = ax.get_legend_handles_labels()
        h2, n2 = twin.get_legend_handles_labels()
        ax.legend(handles + h2, names + n2, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
