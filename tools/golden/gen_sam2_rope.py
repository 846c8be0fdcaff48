#!/usr/bin/python3
"""Golden data for SAM2's memory-attention RoPE (rpe: form sam2 = rope::axial, theta 10000, keys at
the query grid repeated, trailing key tokens unrotated) from facebookresearch/sam2's own code.

For each case the generator builds sam2's RoPEAttention (sam2/modeling/sam/transformer.py) with
identity q/k/v projections and runs its forward on a query grid and keys made of `repeat` copies
of the grid (memory frames) followed by `suffix` object-pointer tokens (num_k_exclude_rope), with
torch's scaled_dot_product_attention replaced by a stand-in that records the rotated q and k it
is given (so the recorded values are the forward's own rotation: compute_axial_cis,
apply_rotary_enc with repeat_freqs_k). The keys' gradient of sum(k_rot * grad_k) is taken by
torch autograd through the same functions (position_encoding.apply_rotary_enc on the rotated
part, as the forward slices it).

Usage (by hand; `pip install --no-deps sam2==1.1.0` plus hydra-core, and PyTorch, needed only
here):
  /path/to/venv/bin/python tools/golden/gen_sam2_rope.py [out_dir]
out_dir defaults to tests/data/golden_vit/rope.
"""
import importlib.metadata
import json
import os
import sys

import numpy as np
import torch
from sam2.modeling import position_encoding as pe
from sam2.modeling.sam import transformer as tr

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CASES = [
    # name, head_dim, heads, grid side, repeat (memory frames), suffix (num_k_exclude_rope)
    ("sam2_d256_4x4_repeat3_suffix8", 256, 1, 4, 3, 8),  # SAM2's memory attention: d_model 256, one head
    ("sam2_d64_3x3_repeat2_suffix4", 64, 2, 3, 2, 4),
    ("sam2_d32_5x5_self", 32, 2, 5, 1, 0),               # self-attention: keys = the queries' grid
]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "golden_vit", "rope")
    version = importlib.metadata.version("sam2")
    for i, (name, d, h, side, repeat, suffix) in enumerate(CASES):
        c = d * h
        attn = tr.RoPEAttention(embedding_dim=c, num_heads=h, downsample_rate=1, rope_theta=10000.0,
                                rope_k_repeat=repeat > 1, feat_sizes=(side, side))
        with torch.no_grad():
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
                proj.weight.copy_(torch.eye(c))
                proj.bias.zero_()
        n = side * side
        lk = repeat * n + suffix
        gen = torch.Generator().manual_seed(2800 + i)
        q = torch.randn(1, n, c, generator=gen, dtype=torch.float32)
        k = torch.randn(1, lk, c, generator=gen, dtype=torch.float32)
        grad_k = torch.randn(1, h, lk, d, generator=gen, dtype=torch.float32)
        seen = {}

        def record(qr, kr, vr, dropout_p=0.0):
            seen["q"], seen["k"] = qr.detach().clone(), kr.detach().clone()
            return vr

        saved = tr.F.scaled_dot_product_attention
        tr.F.scaled_dot_product_attention = record
        try:
            with torch.no_grad():
                attn(q, k, k, num_k_exclude_rope=suffix)
        finally:
            tr.F.scaled_dot_product_attention = saved
        # the keys' gradient through the source's functions, sliced as RoPEAttention.forward
        qh = attn._separate_heads(q, h)
        kh = attn._separate_heads(k, h).clone().requires_grad_(True)
        nr = lk - suffix
        _, kr = pe.apply_rotary_enc(qh, kh[:, :, :nr], freqs_cis=attn.freqs_cis, repeat_freqs_k=attn.rope_k_repeat)
        k_rot = torch.cat([kr, kh[:, :, nr:]], dim=2)
        assert torch.equal(k_rot.detach(), seen["k"]), name
        (grad_kx,) = torch.autograd.grad((k_rot * grad_k).sum(), kh)
        out = os.path.join(out_dir, name)
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, "q.npy"), qh.detach().numpy())
        np.save(os.path.join(out, "q_rot.npy"), seen["q"].numpy())
        np.save(os.path.join(out, "k.npy"), kh.detach().numpy())
        np.save(os.path.join(out, "k_rot.npy"), seen["k"].numpy())
        np.save(os.path.join(out, "grad_k_rot.npy"), grad_k.numpy())
        np.save(os.path.join(out, "grad_k.npy"), grad_kx.numpy())
        meta = {"source": "sam2 %s sam2.modeling.sam.transformer.RoPEAttention.forward (compute_axial_cis, "
                          "apply_rotary_enc, repeat_freqs_k, num_k_exclude_rope)" % version,
                "form": "sam2", "layout": "pairs", "batch": 1, "heads": h, "head_dim": d, "height": side,
                "width": side, "repeat": repeat, "suffix": suffix, "L_q": n, "L_k": lk, "theta": 10000.0,
                "files": {"q.npy": "queries (B, H, L_q, D) (the grid)", "q_rot.npy": "rotated queries",
                          "k.npy": "keys (B, H, L_k, D): `repeat` copies of the grid, then `suffix` tokens",
                          "k_rot.npy": "rotated keys (the suffix unrotated)",
                          "grad_k_rot.npy": "upstream gradient of the rotated keys",
                          "grad_k.npy": "d sum(k_rot * grad_k_rot) / dk by torch autograd"}}
        json.dump(meta, open(os.path.join(out, "meta.json"), "w"), indent=1)
        print("wrote", out, "L_q =", n, "L_k =", lk)


if __name__ == "__main__":
    main()
