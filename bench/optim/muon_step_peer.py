"""torch.optim.Muon + AdamW's step on GPT-2's shape in one process: the Python side of
bench/optim/muon_step_bench.cpp (the same shapes and options, one intra-op thread, the blocks'
weight matrices on Muon and the embeddings, norms and biases on AdamW). Prints one JSON line.

    python bench/optim/muon_step_peer.py [--steps 7] [--warmup 2]
"""
import argparse
import json
import time

import torch


def gpt2_shapes(d=512, vocab=10000, positions=512, blocks=6):
    """models/gpt2.h's gpt2_shapes."""
    shapes = [(vocab, d), (positions, d)]
    for _ in range(blocks):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) * 0.02).requires_grad_() for s in gpt2_shapes()]
    matrices = [p for i, p in enumerate(params) if p.dim() == 2 and i >= 2]
    others = [p for i, p in enumerate(params) if not (p.dim() == 2 and i >= 2)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    muon = torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(others, lr=3e-4)
    muon_ms, adamw_ms = [], []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        muon.step()
        t1 = time.perf_counter()
        adamw.step()
        t2 = time.perf_counter()
        if s >= args.warmup:
            muon_ms.append((t1 - t0) * 1e3)
            adamw_ms.append((t2 - t1) * 1e3)
    total = sorted(m + a for m, a in zip(muon_ms, adamw_ms))
    print(json.dumps({"impl": "torch.optim.Muon+AdamW", "median_step_ms": total[len(total) // 2],
                      "muon_ms": sorted(muon_ms)[len(muon_ms) // 2], "adamw_ms": sorted(adamw_ms)[len(adamw_ms) // 2],
                      "adamw_foreach": adamw.defaults["foreach"]}))


if __name__ == "__main__":
    main()
