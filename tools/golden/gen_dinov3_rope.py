#!/usr/bin/python3
"""Golden data for rpe::rope::dinov3 (DINOv3's RoPE) from timm's own RotaryEmbeddingDinoV3.

Runs timm's `timm.layers.pos_embed_sincos.RotaryEmbeddingDinoV3(...).get_embed((H, W))` (the
port that timm states matches facebookresearch/dinov3 RopePositionEmbedding numerically) and
`apply_rot_embed_cat(x, emb, half=True)` on small shapes, the CLS and storage tokens (skip)
left unrotated as DINOv3's attention does. Training-mode cases draw timm's augmentations
(shift, jitter, rescale) from a seeded torch generator; the drawn values are read back by
repeating the same draws from the same seed (the order of _apply_coord_augs: shift_hw (2),
jitter_hw (2), rescale (1)) and stored in meta.json, so that rpe is given them explicitly.

Usage (by hand; timm >= 1.0.20 and PyTorch needed only here):
  /path/to/venv/bin/python tools/golden/gen_dinov3_rope.py [out_dir]
out_dir defaults to tests/data/golden_vit/rope.
"""
import json
import math
import os
import sys

import numpy as np
import timm
import torch
from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3, apply_rot_embed_cat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CASES = [
    # name, head_dim, heads, H, W, skip, kwargs, train (augmentations), seed
    ("dinov3_base100_4x6_skip5", 32, 2, 4, 6, 5, dict(temperature=100.0, normalize_coords="separate"), False, 1),
    ("dinov3_minmax_5x3_max_skip1", 16, 2, 5, 3, 1, dict(temperature=None, min_period=0.5, max_period=40.0,
                                                         normalize_coords="max"), False, 2),
    ("dinov3_aug_3x4_min_skip5", 16, 3, 3, 4, 5, dict(temperature=100.0, normalize_coords="min", shift_coords=0.3,
                                                      jitter_coords=1.7, rescale_coords=2.0), True, 3),
]


def drawn_augs(seed, shift, jitter, rescale):
    """The values _apply_coord_augs draws after torch.manual_seed(seed), in its order."""
    torch.manual_seed(seed)
    s = torch.empty(2, dtype=torch.float32).uniform_(-shift, shift)
    j = torch.empty(2, dtype=torch.float32).uniform_(-math.log(jitter), math.log(jitter)).exp()
    r = torch.empty(1, dtype=torch.float32).uniform_(-math.log(rescale), math.log(rescale)).exp()
    return [float(v) for v in s], [float(v) for v in j], float(r[0])


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "golden_vit", "rope")
    for name, d, h, hh, ww, skip, kw, train, seed in CASES:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        rope = RotaryEmbeddingDinoV3(d, **kw)
        rope.train(train)
        torch.manual_seed(seed)
        emb = rope.get_embed((hh, ww))                      # (HW, 2D): [sin, cos], rotate-half layout
        gen = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn(1, h, skip + hh * ww, d, generator=gen, dtype=torch.float32)
        y = x.clone()
        y[:, :, skip:, :] = apply_rot_embed_cat(x[:, :, skip:, :], emb, half=True)
        meta = {"source": "timm %s RotaryEmbeddingDinoV3 + apply_rot_embed_cat(half=True)" % timm.__version__,
                "form": "dinov3", "layout": "half", "batch": 1, "heads": h, "head_dim": d, "height": hh, "width": ww,
                "skip": skip, "L": skip + hh * ww, "normalize": kw["normalize_coords"]}
        if kw.get("temperature") is not None:
            meta["base"] = kw["temperature"]
        else:
            meta["min_period"], meta["max_period"] = kw["min_period"], kw["max_period"]
        if train:
            shift, jitter, rescale = drawn_augs(seed, kw["shift_coords"], kw["jitter_coords"], kw["rescale_coords"])
            meta.update({"shift": shift, "jitter": jitter, "rescale": rescale})
            # the read-back values give timm's embedding again (timm's own grid and angle code)
            from timm.layers.pos_embed_sincos import _build_grid
            c = _build_grid((hh, ww), grid_type="centered", normalize_coords=kw["normalize_coords"], ndim=2).flatten(0, -2)
            c = (c + torch.tensor(shift)[None, :]) * torch.tensor(jitter)[None, :] * torch.tensor([rescale])
            sin, cos = rope._get_pos_embed_from_coords(c)
            assert torch.equal(torch.cat([sin, cos], -1), emb), name
        meta["files"] = {"x.npy": "input (B, H, L, D)", "y.npy": "rotated (B, H, L, D); the skip tokens unrotated"}
        if not train:  # DINOv3's own coordinates of the grid (timm's _build_grid), for per-token positions
            from timm.layers.pos_embed_sincos import _build_grid
            c = _build_grid((hh, ww), grid_type="centered", normalize_coords=kw["normalize_coords"], ndim=2).flatten(0, -2)
            np.save(os.path.join(out_dir, name, "positions.npy"), c.numpy().astype(np.float32))
            meta["files"]["positions.npy"] = "DINOv3 coordinates (H*W, 2) (h, w) of the grid, in (-1, 1)"
        out = os.path.join(out_dir, name)
        np.save(os.path.join(out, "x.npy"), x.numpy())
        np.save(os.path.join(out, "y.npy"), y.numpy())
        json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=1)
        print("wrote", out)


if __name__ == "__main__":
    main()
