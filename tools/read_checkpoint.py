#!/usr/bin/env python3
"""Reads a shardopt checkpoint in Python (the format of shardopt/checkpoint.h).

    python tools/read_checkpoint.py CKPT            # prints what the file holds

    import read_checkpoint
    d = read_checkpoint.load("run/last.ckpt")       # the payload dict, header and CRC checked
    opt.load_state_dict(d["optimizer"])             # consolidated optimizer state: torch.optim's layout
    model.load_state_dict(d["model"])               # parameters and buffers by name
"""
import io
import struct
import sys
import zlib

import torch

MAGIC = b"SHRDCKPT"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQI")


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size or data[:8] != MAGIC:
        raise ValueError(f"checkpoint '{path}' is not a shardopt checkpoint")
    _, version, _, length, crc = HEADER.unpack_from(data)
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint '{path}' has format version {version}; this reader reads {FORMAT_VERSION}")
    body = data[HEADER.size:]
    if len(body) != length:
        raise ValueError(f"checkpoint '{path}' is truncated: {len(body)} of {length} payload bytes")
    if zlib.crc32(body) & 0xFFFFFFFF != crc:
        raise ValueError(f"checkpoint '{path}' is corrupted (CRC-32 mismatch)")
    # The payload's dicts carry their key and value types (torch.jit's type tags).
    import torch.jit._pickle
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(io.BytesIO(body), weights_only=True)


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr if len(sys.argv) != 2 else sys.stdout)
        return 0 if len(sys.argv) == 2 else 2
    try:
        d = load(sys.argv[1])
    except (OSError, ValueError) as e:  # one line, not a traceback
        print(f"read_checkpoint: {e}", file=sys.stderr)
        return 1
    for key in sorted(d):
        value = d[key]
        if isinstance(value, dict):
            print(f"{key}: {len(value)} entries")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
