#!/usr/bin/env python3
"""Draws `shardopt train`'s metrics file.

    plot_train.py metrics.jsonl metrics.png

Above: the loss of rank 0's batches at every step (faint) and its running mean, the test accuracy
at each epoch's end on the right axis. Below, in a panel each: every rank's optimizer state (with
fp32 masters) and gradient bytes over the steps, one line per rank and the band between the least
and the most loaded rank shaded. Freeze, unfreeze and rebalance events are vertical lines in
every panel.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    steps, losses, acc, memory, events, start = [], [], [], [], [], {}

    def before(step):
        """A resumed run repeats the steps after its checkpoint: what was recorded from there goes."""
        for records in (acc, memory, events):
            records[:] = [r for r in records if (r[0] if isinstance(r, tuple) else r["step"]) < step]
        while steps and steps[-1] >= step:
            steps.pop()
            losses.pop()

    with open(src) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") in ("start", "resume"):
                before(r.get("step", 0))
                start = r
            elif "event" in r and r["event"] != "done":
                events.append(r)
            elif "loss" in r:
                steps.append(r["step"])
                losses.append(r["loss"])
            elif "test_accuracy" in r and "event" not in r:
                acc.append((r["step"], r["test_accuracy"]))
            elif "state_bytes" in r and "event" not in r:
                memory.append(r)
    fig, (top, state_ax, grad_ax) = plt.subplots(3, 1, figsize=(10, 10), sharex=True,
                                                 gridspec_kw={"height_ratios": [3, 2, 2]})
    top.plot(steps, losses, color="#4C72B0", alpha=0.25, linewidth=0.8, label="loss (rank 0's batch)")
    window = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]
    top.plot(steps, smooth, color="#4C72B0", linewidth=1.8, label=f"loss, mean of {window} steps")
    top.set_ylabel("training loss")
    title = "shardopt train"
    if start:
        title += (f": {start.get('world', '?')} ranks, {start.get('optimizer', '')}, "
                  f"{'fp32' if start.get('mixed_precision', 'off') == 'off' else start['mixed_precision']}, "
                  f"global batch {start.get('batch_size', '?')}")
    top.set_title(title)
    handles, labels = top.get_legend_handles_labels()
    if acc:
        right = top.twinx()
        right.plot([a[0] for a in acc], [100 * a[1] for a in acc], "o-", color="#DD8452", label="test accuracy (%)")
        right.set_ylabel("test accuracy (%)")
        h2, l2 = right.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    top.legend(handles, labels, fontsize=8, loc="center right")
    # A run resumed at another world size has another number of ranks: the latest run's are drawn.
    memory = [m for m in memory if len(m["state_bytes"]) == len(memory[-1]["state_bytes"])] if memory else memory
    if memory:
        ranks = len(memory[0]["state_bytes"])
        xs = [m["step"] for m in memory]
        palette = plt.get_cmap("tab10")
        for ax, key, name in ((state_ax, "state", "optimizer state + fp32 masters"), (grad_ax, "grad", "gradients")):
            per_rank = [[(m[f"{key}_bytes"][r] + (m.get("master_bytes", [0] * ranks)[r] if key == "state" else 0)) / 2**20
                         for m in memory] for r in range(ranks)]
            low = [min(v[i] for v in per_rank) for i in range(len(xs))]
            high = [max(v[i] for v in per_rank) for i in range(len(xs))]
            ax.fill_between(xs, low, high, color="gray", alpha=0.2, step="post", label="least to most loaded rank")
            for r, v in enumerate(per_rank):
                label = f"rank {r}" if ranks <= 8 else ("each rank" if r == 0 else None)
                ax.step(xs, v, where="post", color=palette(r % 10), linewidth=1.2, label=label)
            ax.set_ylabel(f"{name}\nMiB per rank")
            ax.set_ylim(bottom=0, top=max(high) * 1.25 if max(high) > 0 else 1)
            ax.legend(fontsize=8, loc="upper right", ncol=min(ranks + 1, 5))
    grad_ax.set_xlabel("step")
    colors = {"freeze": "#8172B3", "unfreeze": "#937860", "freeze and unfreeze": "#DA8BC3"}
    for e in events:
        for ax in (top, state_ax, grad_ax):
            ax.axvline(e["step"], color=colors.get(e["event"], "gray"), linestyle="--", linewidth=1.0)
        text = e["event"] + (", rebalanced" if e.get("rebalanced") else "")
        top.annotate(text, (e["step"], 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=8,
                     va="top", ha="right", color=colors.get(e["event"], "gray"))
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
