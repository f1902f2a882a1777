"""Moves optimizer state between shardopt's OSS (C++) and torch.optim (Python).

    optim_interop.py step IN OUT   IN holds {"optimizer": name, "params", "grads", "state"} written by
                                   torch::pickle_save (a consolidated OSS state); loads the state
                                   into torch.optim.<name>, takes one step with the grads, writes
                                   the parameters to OUT (torch.save). With mixed precision the
                                   state's fp32 "master_weights" are the parameters.
    optim_interop.py make NAME OUT runs torch.optim.<NAME> for three steps on fixed parameters and
                                   gradients, writes {"params", "state", "grads", "after"} to OUT:
                                   the state, the next step's gradients and the parameters after
                                   that step.
"""
import copy
import sys

import torch
import torch.jit._pickle

# Options other than the defaults, so that a loaded state must carry them.
OPTIONS = {
    "Adam": dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.01, amsgrad=True),
    "AdamW": dict(lr=0.02, betas=(0.85, 0.99), weight_decay=0.1),
    "SGD": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "RMSprop": dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True),
    "Adagrad": dict(lr=0.05, lr_decay=0.01, weight_decay=0.01),
}


def step(src: str, dst: str) -> None:
    # torch::pickle_save tags typed containers with restore_type_tag; allow that one function
    # and keep the safe (weights-only) loader.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        blob = torch.load(src)
    # A mixed-precision state carries the fp32 master weights beside "state": Python resumes
    # from them (torch.optim ignores the extra key).
    masters = blob["state"].get("master_weights")
    if masters is not None:
        blob["params"] = [masters[i] for i in range(len(blob["params"]))]
    params = [p.clone().requires_grad_(True) for p in blob["params"]]
    opt = getattr(torch.optim, blob["optimizer"])(params, lr=0.123)  # options come from the state
    opt.load_state_dict(blob["state"])
    assert opt.param_groups[0]["lr"] != 0.123, "the loaded param group did not replace the options"
    for p, g in zip(params, blob["grads"]):
        p.grad = g.clone()
    opt.step()
    torch.save([p.detach() for p in params], dst)


def grads_for(params, k):
    return [torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37 + k + i).reshape(p.shape)
            for i, p in enumerate(params)]


def make(name: str, dst: str) -> None:
    gen = torch.Generator().manual_seed(5)
    shapes = [(8, 5), (8,), (3, 8), (3,), (3,)]
    params = [torch.randn(s, generator=gen).requires_grad_(True) for s in shapes]
    opt = getattr(torch.optim, name)(params, **OPTIONS[name])
    for k in range(3):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        opt.step()
    # state_dict() holds the live state tensors: copy them before the next step changes them.
    blob = {"params": [p.detach().clone() for p in params], "state": copy.deepcopy(opt.state_dict())}
    nxt = grads_for(params, 3)
    for p, g in zip(params, nxt):
        p.grad = g
    opt.step()
    blob["grads"] = nxt
    blob["after"] = [p.detach().clone() for p in params]
    torch.save(blob, dst)


if __name__ == "__main__":
    {"step": lambda: step(sys.argv[2], sys.argv[3]), "make": lambda: make(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
