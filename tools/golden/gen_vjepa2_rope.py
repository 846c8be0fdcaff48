#!/usr/bin/python3
"""Golden data for rpe::rope::vjepa2 (V-JEPA 2's 3D RoPE) from huggingface/transformers' own code.

For each case the generator builds transformers' VJEPA2RopeAttention (models/vjepa2/modeling_vjepa2.py)
from a VJEPA2Config of the case's video grid (frames_per_clip / tubelet_size frames,
crop_size / patch_size rows and columns) and head dim, takes the (frame, row, col) ids of the
tokens from the module's own get_position_ids (every token of the clip, or the kept tokens of a
mask, as the context encoder and the predictor see them), rotates a random q with the module's
apply_rotary_embeddings (its rotate_queries_or_keys on three slices of 2*((D//3)//2) channels,
the rest passed through) and takes the gradient of sum(y * grad_y) by torch autograd. The source
fixes theta at 10000.

Usage (by hand; transformers >= 5 and PyTorch needed only here, e.g. a venv with
`pip install transformers==5.24.0` and the project's torch):
  /path/to/venv/bin/python tools/golden/gen_vjepa2_rope.py [out_dir]
out_dir defaults to tests/data/golden_vit/rope.
"""
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import VJEPA2Config
from transformers.models.vjepa2 import modeling_vjepa2 as vj

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CASES = [
    # name, head_dim, heads, frames (grid depth), side (grid rows = columns), kept token ids (None: all)
    ("vjepa2_d64_2x4x4", 64, 2, 2, 4, None),            # ViT-L head dim: slices of 20, 4 channels passed through
    ("vjepa2_d80_3x3x3_masked", 80, 1, 3, 3, [0, 2, 4, 5, 9, 13, 14, 17, 20, 22, 24, 25, 26]),  # ViT-H: slices of 26 (13 pairs), 2 through
    ("vjepa2_d96_2x3x3", 96, 1, 2, 3, None),            # slices of 32, none passed through
    ("vjepa2_d32_4x2x2", 32, 3, 4, 2, None),            # the predictor's head dim (384 / 12): slices of 10, 2 through
]
PATCH = 16
TUBELET = 2


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "golden_vit", "rope")
    for i, (name, d, h, frames, side, kept) in enumerate(CASES):
        config = VJEPA2Config(crop_size=side * PATCH, patch_size=PATCH, frames_per_clip=frames * TUBELET,
                              tubelet_size=TUBELET, hidden_size=d * h, num_attention_heads=h)
        attn = vj.VJEPA2RopeAttention(config, hidden_size=d * h, num_attention_heads=h)
        assert attn.grid_depth == frames and attn.grid_size == side and attn.attention_head_size == d, name
        l = frames * side * side if kept is None else len(kept)
        gen = torch.Generator().manual_seed(2700 + i)
        x = torch.randn(1, h, l, d, generator=gen, dtype=torch.float32, requires_grad=True)
        grad_y = torch.randn(1, h, l, d, generator=gen, dtype=torch.float32)
        tokens = torch.zeros(1, l, d * h)  # get_position_ids reads only its length (no mask)
        masks = None if kept is None else torch.tensor([kept], dtype=torch.long)
        pos_ids = attn.get_position_ids(tokens, masks=masks)
        y = attn.apply_rotary_embeddings(x, pos_ids)
        (grad_x,) = torch.autograd.grad((y * grad_y).sum(), x)
        frame, row, col = (p.reshape(-1, l)[0] for p in pos_ids)  # (L,) each (a mask's ids are per (B, H))
        positions = torch.stack([frame, row, col], dim=1).numpy().astype(np.float32)
        out = os.path.join(out_dir, name)
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, "x.npy"), x.detach().numpy())
        np.save(os.path.join(out, "y.npy"), y.detach().numpy())
        np.save(os.path.join(out, "grad_y.npy"), grad_y.numpy())
        np.save(os.path.join(out, "grad_x.npy"), grad_x.numpy())
        np.save(os.path.join(out, "positions.npy"), positions)
        meta = {"source": "transformers %s %s (VJEPA2RopeAttention.get_position_ids, apply_rotary_embeddings, "
                          "rotate_queries_or_keys)" % (transformers.__version__, vj.__name__),
                "form": "vjepa2", "layout": "vjepa2", "batch": 1, "heads": h, "head_dim": d, "L": l, "skip": 0,
                "suffix": 0, "theta": 10000.0, "grid_thw": [frames, side, side], "kept": kept,
                "slice": attn.d_dim, "passed_through": d - 3 * attn.d_dim,
                "files": {"x.npy": "input (B, H, L, D)", "y.npy": "rotated (B, H, L, D)",
                          "positions.npy": "(frame, row, col) ids (L, 3) from get_position_ids, as float32",
                          "grad_y.npy": "upstream gradient (B, H, L, D)",
                          "grad_x.npy": "d sum(y * grad_y) / dx by torch autograd"}}
        json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=1)
        print("wrote", out, "L =", l, "slice", attn.d_dim, "through", d - 3 * attn.d_dim)


if __name__ == "__main__":
    main()
