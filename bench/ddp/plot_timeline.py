#!/usr/bin/env python3
"""Draws one rank's timeline (ddp_bench --timeline FILE) as a picture: a row per lane (the
program's forward, backward and step(); each bucket's gradient reduction; its optimizer step; its
parameter sync; the waits), one step or more of it.

    python3 bench/ddp/plot_timeline.py TRACE.json --out PICTURE.png [--steps 2] [--title TEXT]

The steps drawn are the last ones the trace holds (from the start of a forward).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LANES = ["compute", "gradient reduction", "optimizer step", "parameter sync", "waits"]
COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "step()": "#c44e52"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2, help="the last this many steps")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    forwards = sorted(e["ts"] for e in events if e["name"] == "forward")
    if len(forwards) < args.steps:
        raise SystemExit(f"{args.trace}: {len(forwards)} forward spans, fewer than --steps {args.steps}")
    begin = forwards[-args.steps]
    shown = [e for e in events if e["ts"] >= begin]
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for row, lane in enumerate(LANES):
        for e in (e for e in shown if e["cat"] == lane):
            colour = COLOURS.get(e["name"], "#8172b2" if lane != "waits" else "#937860")
            ax.broken_barh([((e["ts"] - begin) / 1000.0, max(e["dur"], 1) / 1000.0)], (row - 0.4, 0.8),
                           facecolors=colour, edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(len(LANES)))
    ax.set_yticklabels(LANES)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(args.title or args.trace, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
