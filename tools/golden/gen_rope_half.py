#!/usr/bin/python3
"""Golden data for rpe's rotate-half channel layout (rpe::rope::layout::half).

Runs timm's own rotate-half rotation, `timm.layers.pos_embed_sincos.apply_rot_embed_cat(x, emb,
half=True)` (x·cos + rope_rotate_half(x)·sin), with the angles of existing golden cases of
tests/data/golden_vit/rope (their cos.npy / sin.npy per channel pair, made by rope-vit's and
timm's code by gen_vit_rope.py), laid out for rotate-half: pair j's sin/cos on channels j and
j + D/2 (the table tiled twice). The skip (class) tokens are left unrotated.

Usage (by hand; timm and PyTorch needed only here):
  /path/to/venv/bin/python tools/golden/gen_rope_half.py [golden_rope_dir]
writes <case>_half/{x.npy, y.npy, meta.json} next to each case.
"""
import json
import os
import sys

import numpy as np
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CASES = ["axial_t100_3x4_skip1", "cat_eva02_3x4_ref2x3_skip1"]


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "golden_vit", "rope")
    for case in CASES:
        src = os.path.join(base, case)
        meta = json.load(open(os.path.join(src, "meta.json")))
        skip = meta["skip"]
        x = torch.from_numpy(np.load(os.path.join(src, "x.npy")))
        cos = torch.from_numpy(np.load(os.path.join(src, "cos.npy")))  # (N, D/2) per pair
        sin = torch.from_numpy(np.load(os.path.join(src, "sin.npy")))
        emb = torch.cat([sin.repeat(1, 2), cos.repeat(1, 2)], -1)      # rotate-half: channel j and j + D/2
        y = x.clone()
        y[:, :, skip:, :] = apply_rot_embed_cat(x[:, :, skip:, :], emb, half=True)
        out = os.path.join(base, case + "_half")
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, "x.npy"), x.numpy().astype(np.float32))
        np.save(os.path.join(out, "y.npy"), y.numpy().astype(np.float32))
        m = {k: meta[k] for k in meta if k != "files"}
        m.update({"layout": "half",
                  "source": "timm apply_rot_embed_cat(half=True) with the angles of " + case + " (" + meta["source"] + ")",
                  "files": {"x.npy": "input (B, H, L, D), rotate-half layout",
                            "y.npy": "rotated (B, H, L, D); the skip tokens unrotated"}})
        json.dump(m, open(os.path.join(out, "meta.json"), "w"), indent=1)
        print("wrote", out)


if __name__ == "__main__":
    main()
