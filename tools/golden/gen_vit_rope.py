#!/usr/bin/python3
"""Golden data for rpe's 2D rotary position embedding (include/rpe/rope.hpp).

Runs the public sources' own functions (not copies) on small shapes:
  * naver-ai/rope-vit, deit/models_v2_rope.py: init_t_xy, compute_axial_cis, compute_mixed_cis,
    init_random_2d_freqs, apply_rotary_emb (RoPE-Axial, RoPE-Mixed), the skip (class) token
    left unrotated as RoPEAttention.forward does (q[:, :, 1:]);
  * timm, timm/layers/pos_embed_sincos.py: RotaryEmbeddingCat(...).get_embed() and
    apply_rot_embed_cat (EVA-02's configuration: in_pixels=False, ref_feat_shape, grid_offset,
    grid_indexing), prefix tokens left unrotated as timm's EvaAttention does.

Usage (run by hand, not by CI; PyTorch needed only here):
  ROPE_VIT_DIR=/path/to/rope-vit TIMM_DIR=/path/to/timm /usr/bin/python3 tools/golden/gen_vit_rope.py [out_dir]
out_dir defaults to tests/data/golden_vit/rope. rope-vit's module imports timm and its own
models_v2, so only the function definitions listed above are taken from its file (by name,
with Python's ast) and run; timm's pos_embed_sincos.py is loaded as a module with its three
sibling imports (_fx, grid, trace_utils) provided by stubs or their own files.
"""
import ast
import importlib.util
import json
import math
import os
import sys
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def load_rope_vit(path):
    src = open(os.path.join(path, "deit", "models_v2_rope.py")).read()
    tree = ast.parse(src)
    wanted = {"init_random_2d_freqs", "compute_mixed_cis", "compute_axial_cis", "init_t_xy",
              "reshape_for_broadcast", "apply_rotary_emb"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted, "rope-vit: functions not found"
    mod = ast.Module(body=body, type_ignores=[])
    from typing import Tuple
    ns = {"torch": torch, "Tuple": Tuple}
    exec(compile(mod, "models_v2_rope.py", "exec"), ns)
    return types.SimpleNamespace(**{k: ns[k] for k in wanted})


def load_timm_sincos(path):
    layers = os.path.join(path, "timm", "layers")
    pkg = types.ModuleType("timm_layers_stub")
    pkg.__path__ = []
    sys.modules["timm_layers_stub"] = pkg
    fx = types.ModuleType("timm_layers_stub._fx")
    fx.register_notrace_function = lambda f: f
    sys.modules["timm_layers_stub._fx"] = fx
    for name in ("grid", "trace_utils", "pos_embed_sincos"):
        spec = importlib.util.spec_from_file_location("timm_layers_stub." + name, os.path.join(layers, name + ".py"))
        m = importlib.util.module_from_spec(spec)
        sys.modules["timm_layers_stub." + name] = m
        spec.loader.exec_module(m)
    return sys.modules["timm_layers_stub.pos_embed_sincos"]


def save(d, name, a, files, meaning):
    a = np.ascontiguousarray(a)
    np.save(os.path.join(d, name), a)
    files[name] = {"shape": list(a.shape), "dtype": str(a.dtype), "meaning": meaning}


def case_dir(out, name):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    return d


def to_cos_sin(cis):  # complex (..., D/2) -> cos, sin float32
    return cis.real.float().numpy(), cis.imag.float().numpy()


def rope_vit_case(rv, out, name, form, B, H, D, height, width, theta, seed):
    torch.manual_seed(seed)
    skip = 1  # RoPEAttention rotates q[:, :, 1:]
    L = skip + height * width
    x = torch.randn(B, H, L, D)
    g = torch.randn(B, H, L, D)
    files = {}
    d = case_dir(out, name)
    meta = {"source": "naver-ai/rope-vit deit/models_v2_rope.py", "form": form, "theta": theta,
            "batch": B, "heads": H, "head_dim": D, "height": height, "width": width, "skip": skip, "L": L,
            "seed": seed}
    xr = x.clone().requires_grad_(True)
    if form == "axial":
        # compute_axial_cis(end_x = W // patch, end_y = H // patch): end_x is the grid's width
        cis = rv.compute_axial_cis(dim=D, end_x=width, end_y=height, theta=theta)  # (N, D/2)
        c, s = to_cos_sin(cis)
        freqs = None
    else:
        # as RoPE-Mixed's __init__: one layer (depth 1), freqs (2, depth, H*D/2) learned
        freqs0 = rv.init_random_2d_freqs(dim=D, num_heads=H, theta=theta)  # (2, H, D/2)
        freqs = torch.stack([freqs0], dim=1).view(2, 1, -1).clone().requires_grad_(True)
        t_x, t_y = rv.init_t_xy(end_x=width, end_y=height)
        cis = rv.compute_mixed_cis(freqs, t_x, t_y, num_heads=H)[0]  # (H, N, D/2)
        c, s = to_cos_sin(cis.detach())
        save(d, "freqs.npy", freqs.detach().view(2, H, D // 2).numpy(), files,
             "learned frequencies (2, H, D/2): [0] x, [1] y (rope-vit's freqs[:, layer] viewed (2, H, D/2))")
    q_rot, _ = rv.apply_rotary_emb(xr[:, :, skip:], xr[:, :, skip:], freqs_cis=cis)
    y = torch.cat([xr[:, :, :skip], q_rot], dim=2)
    (y * g).sum().backward()
    save(d, "x.npy", x.numpy(), files, "input q (or k) (B, H, L, D)")
    save(d, "y.npy", y.detach().numpy(), files, "rotated (B, H, L, D); token 0 (class) unrotated")
    save(d, "cos.npy", c, files, "cos of the angles: (L-skip, D/2) axial, (H, L-skip, D/2) mixed")
    save(d, "sin.npy", s, files, "sin of the angles, same shape as cos")
    save(d, "grad_y.npy", g.numpy(), files, "upstream gradient (B, H, L, D)")
    save(d, "grad_x.npy", xr.grad.numpy(), files, "gradient of sum(y * grad_y) w.r.t. x")
    if freqs is not None:
        save(d, "grad_freqs.npy", freqs.grad.view(2, H, D // 2).numpy(), files,
             "gradient of sum(y * grad_y) w.r.t. freqs (2, H, D/2)")
    meta["files"] = files
    json.dump(meta, open(os.path.join(d, "meta.json"), "w"), indent=1)


def timm_case(tm, out, name, B, H, D, height, width, skip, seed, **kw):
    torch.manual_seed(seed)
    L = skip + height * width
    x = torch.randn(B, H, L, D)
    g = torch.randn(B, H, L, D)
    rope = tm.RotaryEmbeddingCat(dim=D, feat_shape=[height, width], **kw)
    emb = rope.get_embed()  # (N, 2D): sin | cos, each pair-interleaved (repeat_interleave(2))
    xr = x.clone().requires_grad_(True)
    y = torch.cat([xr[:, :, :skip], tm.apply_rot_embed_cat(xr[:, :, skip:], emb)], dim=2)
    (y * g).sum().backward()
    sin_emb, cos_emb = emb.chunk(2, -1)
    files = {}
    d = case_dir(out, name)
    meta = {"source": "timm timm/layers/pos_embed_sincos.py RotaryEmbeddingCat + apply_rot_embed_cat (half=False)",
            "form": "cat", "batch": B, "heads": H, "head_dim": D, "height": height, "width": width, "skip": skip,
            "L": L, "seed": seed}
    meta.update({k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in kw.items()})
    save(d, "x.npy", x.numpy(), files, "input q (or k) (B, H, L, D)")
    save(d, "y.npy", y.detach().numpy(), files, "rotated (B, H, L, D); the first skip tokens unrotated")
    # every other entry: the pair's value (repeat_interleave(2) in build_rotary_pos_embed)
    save(d, "cos.npy", cos_emb[:, 0::2].numpy(), files, "cos of the angles (L-skip, D/2)")
    save(d, "sin.npy", sin_emb[:, 0::2].numpy(), files, "sin of the angles (L-skip, D/2)")
    assert torch.equal(cos_emb[:, 0::2], cos_emb[:, 1::2]) and torch.equal(sin_emb[:, 0::2], sin_emb[:, 1::2])
    save(d, "grad_y.npy", g.numpy(), files, "upstream gradient (B, H, L, D)")
    save(d, "grad_x.npy", xr.grad.numpy(), files, "gradient of sum(y * grad_y) w.r.t. x")
    meta["files"] = files
    json.dump(meta, open(os.path.join(d, "meta.json"), "w"), indent=1)


def main():
    rope_vit = os.environ.get("ROPE_VIT_DIR")
    timm_dir = os.environ.get("TIMM_DIR")
    if not rope_vit or not timm_dir:
        sys.exit("set ROPE_VIT_DIR (naver-ai/rope-vit checkout) and TIMM_DIR (timm checkout)")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "golden_vit", "rope")
    rv = load_rope_vit(rope_vit)
    tm = load_timm_sincos(timm_dir)
    rope_vit_case(rv, out, "axial_t100_3x4_skip1", "axial", 2, 2, 16, 3, 4, 100.0, 1)
    rope_vit_case(rv, out, "mixed_t10_4x3_skip1", "mixed", 2, 3, 8, 4, 3, 10.0, 2)
    # EVA-02 (timm eva.py, rope_type='cat'): in_pixels=False, temperature 10000, grid_offset 0,
    # grid_indexing 'ij', ref_feat_shape (16, 16) for a 16x16 grid; here a resized grid (3x4 on a 2x3 reference)
    timm_case(tm, out, "cat_eva02_3x4_ref2x3_skip1", 2, 2, 16, 3, 4, 1, 3,
              in_pixels=False, temperature=10000.0, ref_feat_shape=[2, 3])
    timm_case(tm, out, "cat_offset_xy_4x3_skip2", 1, 2, 8, 4, 3, 2, 4,
              in_pixels=False, temperature=100.0, grid_offset=0.5, grid_indexing="xy")
    timm_case(tm, out, "cat_pixels_3x5_skip0", 1, 1, 16, 3, 5, 0, 5, in_pixels=True, max_res=224)
    timm_case(tm, out, "cat_pixels_linear_2x3_ref4x4_skip1", 1, 1, 8, 2, 3, 1, 6, in_pixels=True, max_res=64,
              linear_bands=True, ref_feat_shape=[4, 4])


if __name__ == "__main__":
    main()
