"""Moves optimizer state between shardopt's OSS (C++) and torch.optim (Python).

    optim_interop.py step IN OUT [IN OUT ...]
                                   IN holds {"optimizer": name, "params", "grads", "state"} written by
                                   torch::pickle_save (a consolidated OSS state); loads the state
                                   into torch.optim.<name>, takes one step with the grads, writes
                                   the parameters to OUT (torch.save). With mixed precision the
                                   state's fp32 "master_weights" are the parameters.
    optim_interop.py make NAME OUT [NAME OUT ...]
                                   runs torch.optim.<NAME> for three steps on fixed parameters and
                                   gradients, writes {"params", "state", "grads", "after"} to OUT:
                                   the state, the next step's gradients and the parameters after
                                   that step.
    optim_interop.py muon-step IN OUT     as `step`, for an OSS of two optimizer groups, Muon's
                                   (the matrices) then AdamW's: the state is split into one
                                   torch.optim.Muon and one torch.optim.AdamW state dict.
    optim_interop.py muon-make OUT as `make`, for torch.optim.Muon on the matrices and AdamW on the
                                   vectors; the state is the two combined in OSS's layout (the
                                   Muon group first), the parameters in that order.

`step` and `make` take several pairs, one after the other (one interpreter start for them all).

An OSS of several optimizer groups has one state dict in PyTorch's layout: one param group per
optimizer, the parameters numbered across the groups in order. split() and combine() convert
between it and one state dict per torch.optim optimizer.
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


# Muon on the matrices, AdamW on the rest, with options other than the defaults.
MUON_OPTIONS = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adjust_lr_fn="match_rms_adamw")
ADAMW_OPTIONS = dict(lr=3e-3, betas=(0.85, 0.99), weight_decay=0.01)


def split(state_dict):
    """One state dict per param group of an OSS state dict, each numbered from 0."""
    out = []
    for group in state_dict["param_groups"]:
        ids = list(group["params"])
        local = dict(group, params=list(range(len(ids))))
        state = {k: state_dict["state"][i] for k, i in enumerate(ids) if i in state_dict["state"]}
        out.append({"state": state, "param_groups": [local]})
    return out


def combine(state_dicts):
    """The OSS layout of several optimizers' state dicts, numbered across them in order."""
    state, groups, first = {}, [], 0
    for sd in state_dicts:
        for group in sd["param_groups"]:
            groups.append(dict(group, params=[first + i for i in group["params"]]))
        for i, s in sd["state"].items():
            state[first + i] = s
        first += sum(len(g["params"]) for g in sd["param_groups"])
    return {"state": state, "param_groups": groups}


def muon_and_adamw(params):
    matrices = [p for p in params if p.dim() == 2]
    others = [p for p in params if p.dim() != 2]
    return torch.optim.Muon(matrices, lr=0.5), torch.optim.AdamW(others, lr=0.5)


def muon_step(src: str, dst: str) -> None:
    torch.set_num_threads(1)
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        blob = torch.load(src)
    params = [p.clone().requires_grad_(True) for p in blob["params"]]
    opts = muon_and_adamw(params)
    for opt, sd in zip(opts, split(blob["state"])):
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] != 0.5, "the loaded param group did not replace the options"
    for p, g in zip(params, blob["grads"]):
        p.grad = g.clone()
    for opt in opts:
        opt.step()
    torch.save([p.detach() for p in params], dst)


def muon_make(dst: str) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(5)
    shapes = [(8, 5), (3, 8), (8,), (3,), (3,)]
    params = [torch.randn(s, generator=gen).requires_grad_(True) for s in shapes]
    opts = (torch.optim.Muon(params[:2], **MUON_OPTIONS), torch.optim.AdamW(params[2:], **ADAMW_OPTIONS))
    for k in range(3):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        for opt in opts:
            opt.step()
    blob = {"params": [p.detach().clone() for p in params],
            "state": copy.deepcopy(combine([opt.state_dict() for opt in opts]))}
    nxt = grads_for(params, 3)
    for p, g in zip(params, nxt):
        p.grad = g
    for opt in opts:
        opt.step()
    blob["grads"] = nxt
    blob["after"] = [p.detach().clone() for p in params]
    torch.save(blob, dst)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command in ("step", "make"):
        assert args and len(args) % 2 == 0, f"{command} takes pairs of arguments, got {args}"
        for a, b in zip(args[::2], args[1::2]):
            (step if command == "step" else make)(a, b)
    else:
        {"muon-step": lambda: muon_step(args[0], args[1]), "muon-make": lambda: muon_make(args[0])}[command]()
