"""Gloo's own collectives against the same exchange as direct point-to-point transfers.

A small all-reduce (a few int64, as the trainability check and the clearing evidence are) by
Gloo's ring against one round of direct transfers (each rank sends its tensor to every other and
combines them in rank order); and a row bucket's reduce-scatter and all-gather (Note [Rows] in
csrc/comm/rows.cpp: direct transfers) against Gloo's all-reduce and all-gather of the same
buffer, and both as log2(world) rounds of one peer each (recursive halving and doubling, at a
power-of-two world size). What a rank pays for each, at a world size where every transfer is
latency:

    $VENV/bin/torchrun --nproc-per-node 16 bench/comm/gloo_latency.py

Rank 0 prints one line per operation and pass: the median of --iters timed calls (ms), each pass
after --warmup calls, and the CPU time one call costs all ranks together (each process's CPU
time, its transport threads included, over the timed calls, summed over the ranks, per call): on
a machine with fewer cores than ranks, what the operation takes from the compute beside it. The
operations alternate, two passes each; --only keeps those whose name contains a given text.
"""

import argparse
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-numel", type=int, default=2, help="int64 elements of the small all-reduce")
    parser.add_argument("--bucket-numel", type=int, default=40960, help="fp32 elements of the bucket")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--only", default="", help="run only the operations whose name contains this text")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    small = torch.tensor([rank] * args.small_numel, dtype=torch.int64)
    numel = args.bucket_numel - args.bucket_numel % world
    row = numel // world
    flat = torch.randn(numel)

    def exchange(send_of, recv_into, tag):
        works = []
        for k in range(1, world):
            dst, src = (rank + k) % world, (rank - k) % world
            works.append(dist.isend(send_of(dst), dst, tag=tag))
            works.append(dist.irecv(recv_into(src), src, tag=tag))
        for w in works:
            w.wait()

    def small_direct():
        got = [None] * world
        got[rank] = small

        def into(src):
            got[src] = torch.empty_like(small)
            return got[src]

        exchange(lambda dst: small, into, 1)
        out = got[0].clone()
        for t in got[1:]:
            torch.maximum(out, t, out=out)

    def rows_reduce_scatter():
        got = []

        def into(src):
            got.append(torch.empty(row))
            return got[-1]

        exchange(lambda dst: flat[dst * row:(dst + 1) * row], into, 2)
        mine = flat[rank * row:(rank + 1) * row].clone()
        for t in got:
            mine += t

    def rows_allgather():
        exchange(lambda dst: flat[rank * row:(rank + 1) * row], lambda src: flat[src * row:(src + 1) * row], 3)

    # The same exchanges in log2(world) rounds of one peer each (world a power of two): each rank
    # sends and receives the same bytes as by direct transfers, in 2 log2(world) transfers instead
    # of 2 (world - 1), but each round waits for the one before it.
    def halving_reduce_scatter():
        buf = flat.clone()
        lo, hi, mask = 0, world, world // 2
        while mask:
            peer, mid = rank ^ mask, (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))
            got = torch.empty((keep[1] - keep[0]) * row)
            works = [dist.isend(buf[give[0] * row:give[1] * row], peer, tag=4), dist.irecv(got, peer, tag=4)]
            for w in works:
                w.wait()
            buf[keep[0] * row:keep[1] * row] += got
            lo, hi = keep
            mask //= 2

    def doubling_allgather():
        lo, hi, mask = rank, rank + 1, 1
        while mask < world:
            peer, peer_lo = rank ^ mask, (lo // mask ^ 1) * mask
            works = [dist.isend(flat[lo * row:hi * row], peer, tag=5),
                     dist.irecv(flat[peer_lo * row:(peer_lo + mask) * row], peer, tag=5)]
            for w in works:
                w.wait()
            lo, hi = min(lo, peer_lo), max(hi, peer_lo + mask)
            mask *= 2

    def gloo_allgather():
        out = torch.empty(numel)
        dist.all_gather_into_tensor(out, flat[rank * row:(rank + 1) * row].clone())

    ops = [
        ("small all-reduce, Gloo's ring", lambda: dist.all_reduce(small, op=dist.ReduceOp.MAX)),
        ("small all-reduce, direct transfers", small_direct),
        ("bucket reduce-scatter, Gloo's all-reduce", lambda: dist.all_reduce(flat)),
        ("bucket reduce-scatter, direct transfers (rows)", rows_reduce_scatter),
        ("bucket all-gather, Gloo's", gloo_allgather),
        ("bucket all-gather, direct transfers (rows)", rows_allgather),
    ]
    if world & (world - 1) == 0:
        ops += [("bucket reduce-scatter, recursive halving", halving_reduce_scatter),
                ("bucket all-gather, recursive doubling", doubling_allgather)]
    ops = [(name, op) for name, op in ops if args.only in name]
    for _ in range(2):
        for name, op in ops:
            for _ in range(args.warmup):
                op()
            times = []
            cpu = 0.0
            for _ in range(args.iters):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                op()
                times.append(time.perf_counter() - start)
                cpu += time.process_time() - cpu_start
            cpu_all = torch.tensor([cpu / args.iters], dtype=torch.float64)
            dist.all_reduce(cpu_all)
            times.sort()
            if rank == 0:
                print(f"world {world}: {name}: {times[len(times) // 2] * 1e3:.3f} ms, "
                      f"cpu {cpu_all.item() * 1e3:.1f} ms (all ranks)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
