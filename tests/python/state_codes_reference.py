"""torchao 0.18's 8-bit optimizer state, as the reference for shardopt's (tests/optim/state_codes_test.cpp).

  state_codes_reference.py codes OUT    the dynamic maps, and fp32 values with the codes and scales
                                        torchao gives them (blocks of 256; a short last block is coded
                                        by the same rule on its own elements)
  state_codes_reference.py adamw8 OUT   parameters, 20 steps of gradients, and the parameters after
                                        torchao's AdamW8bit and after torch.optim.AdamW (fp32 state)

OUT is written with torch.save. torch.compile is off: torchao's step is the same arithmetic eagerly.
"""
import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from torchao.optim import AdamW8bit  # noqa: E402
from torchao.optim.quant_utils import (  # noqa: E402
    create_dynamic_map,
    dequant_with_qmap,
    quantize_8bit_with_qmap,
    scale_tensor,
)

BLOCK = 256
# AdamW's options for `adamw8` (the test steps with the same).
LR, BETAS, EPS, WEIGHT_DECAY, STEPS = 1e-2, (0.9, 0.999), 1e-8, 0.01, 20


def code(values, qmap):
    """torchao's codes and scales of `values`, block by block."""
    codes, scales = [], []
    flat = values.reshape(-1)
    for begin in range(0, flat.numel(), BLOCK):
        block = flat[begin:begin + BLOCK]
        scaled, scale = scale_tensor(block, block.numel())
        codes.append(quantize_8bit_with_qmap(scaled, qmap))
        scales.append(scale)
    return torch.cat(codes).view(values.shape), torch.cat(scales)


def codes(dst):
    gen = torch.Generator().manual_seed(7)
    values = [
        torch.randn(4096, generator=gen),
        torch.randn(5000, generator=gen) * 1e-3,  # a short last block
        torch.randn(64, 80, generator=gen).exp(),  # positive, as a second moment
        torch.cat([torch.zeros(BLOCK), -torch.rand(BLOCK, generator=gen) * 1e-7, torch.randn(BLOCK, generator=gen)]),
    ]
    values[0][100] = -40.0  # a negative maximum
    maps = {"signed": torch.tensor(create_dynamic_map(signed=True)),
            "unsigned": torch.tensor(create_dynamic_map(signed=False))}
    # Per value: {"signed": {codes, scales, decoded}, "unsigned": ... (non-negative values only)}.
    coded = []
    for v in values:
        entry = {}
        for kind in ("signed", "unsigned"):
            if kind == "unsigned" and bool((v < 0).any()):
                continue
            c, s = code(v, maps[kind])
            decoded = torch.cat([dequant_with_qmap(c.reshape(-1)[b:b + BLOCK], maps[kind], s[b // BLOCK:b // BLOCK + 1])
                                 for b in range(0, v.numel(), BLOCK)])
            entry[kind] = {"codes": c, "scales": s, "decoded": decoded.view(v.shape)}
        coded.append(entry)
    out = {"maps": maps, "values": values, "coded": coded}
    torch.save(out, dst)


def adamw8(dst):
    gen = torch.Generator().manual_seed(11)
    shapes = [(4096,), (64, 128), (512, 24)]
    init = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=gen) * (1 + step % 3) for s in shapes] for step in range(STEPS)]

    def run(make):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = make(params)
        for step in range(STEPS):
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params], opt

    ao, ao_opt = run(lambda ps: AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY))
    fp32, _ = run(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY))
    assert all(type(s["exp_avg"]).__name__ == "OptimState8bit" for s in ao_opt.state.values()), "torchao kept fp32 state"
    torch.save({"init": init, "grads": grads, "torchao": ao, "fp32": fp32,
                "options": [LR, BETAS[0], BETAS[1], EPS, WEIGHT_DECAY]}, dst)


if __name__ == "__main__":
    {"codes": codes, "adamw8": adamw8}[sys.argv[1]](sys.argv[2])
