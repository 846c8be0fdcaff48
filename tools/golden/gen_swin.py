#!/usr/bin/env python3
"""Golden data for rpe's Swin / BEiT relative position bias and SwinV2 continuous position bias.

Runs timm's own functions and modules (imported from a timm source checkout, never copied) and
writes small .npy files under tests/data/golden_vit/{swin,beit,swinv2}/. Run by hand, not by CI:

    /usr/bin/python3 tools/golden/gen_swin.py --timm /path/to/timm-checkout [--out tests/data/golden_vit]

(--timm defaults to $TIMM_SRC). Needs torch and numpy; timm's optional imports (torchvision,
huggingface_hub) are stubbed, as only the position-encoding code is used.
What each file holds: tests/data/golden_vit/README.md.
"""
import argparse
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

import numpy as np


def stub_optional_imports():
    """Empty stand-ins for packages timm imports at module level but this script never uses."""

    class _Meta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (_Dummy,), {})

    class _Dummy(metaclass=_Meta):
        def __init__(self, *a, **k):
            pass

    class _StubModule(types.ModuleType):
        __path__ = []

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (_Dummy,), {})

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        roots = ("torchvision", "huggingface_hub")

        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in self.roots:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return _StubModule(spec.name)

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _Finder())


def save(folder, name, array):
    os.makedirs(folder, exist_ok=True)
    np.save(os.path.join(folder, name), np.ascontiguousarray(array))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timm", default=os.environ.get("TIMM_SRC"), help="timm source checkout (default $TIMM_SRC)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "golden_vit"))
    args = ap.parse_args()
    if not args.timm:
        ap.error("--timm (or TIMM_SRC) is required")
    sys.path.insert(0, os.path.abspath(args.timm))
    stub_optional_imports()
    import torch

    rel = importlib.import_module("timm.layers.pos_embed_rel")
    swin = importlib.import_module("timm.models.swin_transformer")
    swin2 = importlib.import_module("timm.models.swin_transformer_v2")
    beit = importlib.import_module("timm.models.beit")
    torch.manual_seed(0)
    out = os.path.abspath(args.out)

    # --- Swin: relative position index and bias (swin_transformer.py) -------------------------
    d = os.path.join(out, "swin")
    for wh, ww in [(7, 7), (3, 5), (4, 2)]:
        idx = swin.get_relative_position_index(wh, ww)
        assert torch.equal(idx, rel.gen_relative_position_index((wh, ww)))  # the layers' copy agrees
        save(d, f"index_{wh}x{ww}.npy", idx.numpy().astype(np.int32))
    attn = swin.WindowAttention(dim=8, num_heads=2, window_size=(3, 5))
    with torch.no_grad():
        attn.relative_position_bias_table.copy_(torch.randn_like(attn.relative_position_bias_table))
        bias = attn._get_rel_pos_bias()  # (1, H, N, N)
    save(d, "table_kh_3x5.npy", attn.relative_position_bias_table.detach().numpy())  # (K, H), timm layout
    save(d, "bias_3x5.npy", bias.numpy())

    # --- BEiT: index with the three class-token buckets, and bias (beit.py) --------------------
    d = os.path.join(out, "beit")
    for wh, ww in [(3, 4), (2, 2)]:
        save(d, f"index_{wh}x{ww}.npy", beit.gen_relative_position_index((wh, ww)).numpy().astype(np.int32))
    attn = beit.Attention(dim=8, num_heads=2, window_size=(3, 4))
    with torch.no_grad():
        attn.relative_position_bias_table.copy_(torch.randn_like(attn.relative_position_bias_table))
        bias = attn._get_rel_pos_bias()  # (1, H, N+1, N+1)
    save(d, "table_kh_3x4.npy", attn.relative_position_bias_table.detach().numpy())
    save(d, "bias_3x4.npy", bias.numpy())

    # --- SwinV2: log-spaced coordinates and the continuous position bias ----------------------
    d = os.path.join(out, "swinv2")
    coord_cases = {
        "coords_3x5.npy": dict(win_size=(3, 5)),
        "coords_8x8_pre12x12.npy": dict(win_size=(8, 8), pretrained_win_size=(12, 12)),
        "coords_4x6_pre3x5.npy": dict(win_size=(4, 6), pretrained_win_size=(3, 5)),
        "coords_3x5_cr.npy": dict(win_size=(3, 5), mode="cr"),
        "coords_1x4_cr.npy": dict(win_size=(1, 4), mode="cr"),
    }
    for name, kw in coord_cases.items():
        c = rel.gen_relative_log_coords(**kw)  # (2Wh-1, 2Ww-1, 2) float32
        save(d, name, c.reshape(-1, 2).numpy().astype(np.float32))
    # The window attention's own table (swin_transformer_v2.py) equals gen_relative_log_coords.
    for win, pre in [((3, 5), (0, 0)), ((8, 8), (12, 12)), ((4, 6), (3, 5))]:
        a = swin2.WindowAttention(dim=8, window_size=win, num_heads=2, pretrained_window_size=pre)
        assert torch.equal(a.relative_coords_table[0], rel.gen_relative_log_coords(win, pre))
        assert torch.equal(a.relative_position_index, swin.get_relative_position_index(*win))

    # CPB: timm's WindowAttention with fixed MLP weights; the bias lines of its forward().
    attn = swin2.WindowAttention(dim=8, window_size=(3, 5), num_heads=2, pretrained_window_size=(4, 4))
    with torch.no_grad():
        for p in attn.cpb_mlp.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    w1, b1, w2 = attn.cpb_mlp[0].weight, attn.cpb_mlp[0].bias, attn.cpb_mlp[2].weight
    raw = attn.cpb_mlp(attn.relative_coords_table).view(-1, attn.num_heads)  # (K, H)
    raw.retain_grad()
    n = attn.window_size[0] * attn.window_size[1]
    bias = raw[attn.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous()
    bias = 16 * torch.sigmoid(bias).unsqueeze(0)  # (1, H, N, N), as added to the logits
    g = torch.randn_like(bias)
    (bias * g).sum().backward()
    save(d, "cpb_coords_3x5_pre4x4.npy", attn.relative_coords_table[0].reshape(-1, 2).numpy())
    save(d, "cpb_w1.npy", w1.detach().numpy())  # (512, 2)
    save(d, "cpb_b1.npy", b1.detach().numpy())  # (512,)
    save(d, "cpb_w2.npy", w2.detach().numpy())  # (H, 512)
    save(d, "cpb_raw.npy", raw.detach().numpy())  # (K, H): the MLP's output
    save(d, "cpb_bias.npy", bias.detach().numpy())  # (1, H, N, N) = 16 sigmoid(raw[index])
    save(d, "cpb_grad_out.npy", g.numpy())  # (1, H, N, N)
    save(d, "cpb_grad_raw.npy", raw.grad.numpy())  # (K, H): d sum(bias * g) / d raw
    print("wrote", out)


if __name__ == "__main__":
    main()
