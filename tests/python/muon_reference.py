"""torch.optim.Muon's steps, for the C++ Muon to match bit for bit.

    muon_reference.py OUT   writes to OUT (torch.save) a list of cases, each {"name", "options",
                            "params", "grads", "after"}: the options (PyTorch's names, None for
                            adjust_lr_fn's default), the parameters before the first step, the
                            gradients of each step (None: the parameter has no gradient then), and
                            the parameters after each step. Runs on one thread.
"""
import sys

import torch

SHAPES = [(8, 5), (3, 8), (6, 6), (4, 4)]
CASES = [
    ("defaults", dict(lr=0.02)),
    ("adjust_lr_fn None", dict(lr=0.02, adjust_lr_fn=None)),
    ("no nesterov, match_rms_adamw", dict(lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.01,
                                          adjust_lr_fn="match_rms_adamw")),
    ("own coefficients, steps and eps", dict(lr=0.05, momentum=0.5, weight_decay=0.0,
                                             ns_coefficients=(3.0, -3.2, 1.2), ns_steps=3, eps=1e-5)),
    ("original, no momentum", dict(lr=0.03, momentum=0.0, adjust_lr_fn="original")),
]
STEPS = 20


def grad(shape, step, index):
    n = shape[0] * shape[1]
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + 1.3 * step + index).reshape(shape)


def run(name, options):
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    case = {"name": name, "options": options, "params": [p.clone() for p in params], "grads": [], "after": []}
    live = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.Muon(live, **options)
    for step in range(STEPS):
        # The last parameter never has a gradient; the second has none in the middle step.
        grads = [None if i == 3 or (i == 1 and step == 1) else grad(s, step, i) for i, s in enumerate(SHAPES)]
        for p, g in zip(live, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
        case["grads"].append(grads)
        case["after"].append([p.detach().clone() for p in live])
    return case


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.save([run(name, options) for name, options in CASES], sys.argv[1])
