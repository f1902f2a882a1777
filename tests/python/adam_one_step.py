"""Loads a consolidated shardopt OSS(Adam) state into torch.optim.Adam and takes one step.

Usage: adam_one_step.py IN OUT
IN holds {"params": [...], "grads": [...], "state": <OSS state_dict>} written by torch::pickle_save;
OUT receives the parameters after one torch.optim.Adam step, written by torch.save.
"""
import sys

import torch
import torch.jit._pickle


def main(src: str, dst: str) -> None:
    # torch::pickle_save tags typed containers with restore_type_tag; allow that one function
    # and keep the safe (weights-only) loader.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        blob = torch.load(src)
    params = [p.clone().requires_grad_(True) for p in blob["params"]]
    opt = torch.optim.Adam(params, lr=0.123)  # lr and betas must come from the loaded state
    opt.load_state_dict(blob["state"])
    assert opt.param_groups[0]["lr"] != 0.123, "the loaded param group did not replace the options"
    for p, g in zip(params, blob["grads"]):
        p.grad = g.clone()
    opt.step()
    torch.save([p.detach() for p in params], dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
