"""PyTorch peers for the data-parallel comparison: one rank (run under tools/launch).

    tools/launch -n 2 $VENV/bin/python bench/ddp/peers/ddp_peers.py --impl ddp_zero --model gpt2

impl: ddp_zero = DistributedDataParallel + ZeroRedundancyOptimizer(Adam)
      ddp_adam = DistributedDataParallel + Adam
      ddp_bf16 = DistributedDataParallel with bf16_compress_hook (gradients all-reduced in bf16) + Adam
      fsdp2    = fully_shard (FSDP2) with reshard_after_forward=False (its ZeRO-2 mode) + Adam
      fs_sdp   = fairscale ShardedDataParallel + fairscale OSS(Adam) (ZeRO-2)
      ddp_fsoss = DistributedDataParallel + fairscale OSS(Adam) (ZeRO-1)
(fairscale 0.4.13 from PyPI: bench/ddp/setup_peers.sh installs it.)
The models mirror bench/ddp/ddp_bench.cpp exactly (shapes, forward, batch). Prints one JSON line per
rank, in the same format as the C++ bench.
"""
import argparse
import json
import math
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1])
    return resident * resource.getpagesize() / 1048576.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.d = d

    def forward(self, x):
        q, k, v = self.attn(self.ln1(x)).chunk(3, -1)
        att = torch.softmax(q @ k.t() / math.sqrt(self.d), -1)
        x = x + self.proj(att @ v)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


# GPT-2's shape at width 512, vocab 10000, context 512, 6 blocks: the tensors of GPT2Like in
# bench/ddp/ddp_bench.cpp (from models/gpt2.h), in the same order and layout (nn.Linear's
# weights [out, in]). The one definition of it on the Python side.
class GPT2Like(nn.Module):
    D, VOCAB, CTX, LAYERS = 512, 10000, 512, 6

    def __init__(self):
        super().__init__()
        self.wte = nn.Parameter(torch.randn(self.VOCAB, self.D) * 0.02)
        self.wpe = nn.Parameter(torch.randn(self.CTX, self.D) * 0.01)
        self.blocks = nn.ModuleList([Block(self.D) for _ in range(self.LAYERS)])
        self.lnf = nn.LayerNorm(self.D)

    def forward(self, tokens):
        x = F.embedding(tokens, self.wte) + self.wpe[: tokens.shape[0]]
        for b in self.blocks:
            x = b(x)
        return self.lnf(x) @ self.wte.t()


class SmallTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(16, 16) * 0.25) for _ in range(150)])
        self.bs = nn.ParameterList([nn.Parameter(torch.zeros(16)) for _ in range(150)])

    def forward(self, x):
        for w, b in zip(self.ws, self.bs):
            x = x + 0.1 * torch.tanh(F.linear(x, w, b))
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp_zero", "ddp_adam", "ddp_bf16", "fsdp2", "fs_sdp", "ddp_fsoss"], required=True)
    parser.add_argument("--model", choices=["gpt2", "small"], default="gpt2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--timing", choices=["back-to-back", "barrier"], default="back-to-back",
                        help="back-to-back: each step from the end of the one before; barrier: each step after a barrier")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = rss_mb()
    torch.manual_seed(0)
    model = GPT2Like() if args.model == "gpt2" else SmallTensors()
    nparams = sum(p.numel() for p in model.parameters())

    if args.impl in ("fs_sdp", "ddp_fsoss"):
        from fairscale.optim import OSS

        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
        if args.impl == "fs_sdp":
            from fairscale.nn.data_parallel import ShardedDataParallel

            wrapped = ShardedDataParallel(model, opt)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            wrapped = DDP(model)
    elif args.impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        units = model.blocks if args.model == "gpt2" else []
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        wrapped = model
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        if args.impl == "ddp_bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            wrapped.register_comm_hook(None, bf16_compress_hook)
        if args.impl == "ddp_zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    gen = torch.Generator().manual_seed(1000 + rank)

    def one_step():
        opt.zero_grad(set_to_none=True)
        if args.model == "gpt2":
            tok = torch.randint(GPT2Like.VOCAB, (args.tokens + 1,), generator=gen)
            loss = F.cross_entropy(wrapped(tok[:-1]), tok[1:])
        else:
            loss = wrapped(torch.randn(args.tokens, 16, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        one_step()
    times = []
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        if args.timing == "barrier":
            dist.barrier()
            t0 = time.perf_counter()
        one_step()
        t1 = time.perf_counter()
        times.append((t1 - t0) * 1000)
        t0 = t1
    times.sort()
    print(json.dumps({"impl": "torch-" + args.impl, "model": args.model, "rank": rank, "world": world,
                      "params": nparams, "median_step_ms": round(times[len(times) // 2], 2),
                      "peak_rss_mb": round(peak_rss_mb(), 1), "added_rss_mb": round(peak_rss_mb() - rss_start, 1)}),
          flush=True)
    # DDP + ZeroRedundancyOptimizer over Gloo sometimes aborts in its teardown in this wheel
    # ("terminate called without an active exception"); the results are out by now, so every
    # rank meets at a barrier and leaves without the teardown.
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
