#!/usr/bin/env python3
"""Golden data for a DETR encoder layer with iRPE over a padded batch of images of different sizes.

Runs the reference's own DETR-with-iRPE code (microsoft/Cream, iRPE/DETR-with-iRPE:
models/transformer.py TransformerEncoderLayer, whose self-attention is
models/rpe_attention/multi_head_attention.py RPEMultiheadAttention with irpe.py's pure PyTorch
path: rpe_ops is not built), imported from a checkout and never copied, on CPU, and writes small
.npy files plus meta.json under tests/data/golden_detr/<case>/. Run by hand, not by CI:

    /work/main/.venv/bin/python tools/golden/gen_detr_irpe.py --detr /path/to/Cream/iRPE/DETR-with-iRPE

(--detr defaults to $DETR_IRPE_SRC). Needs torch and numpy; easydict (irpe.py's only other import)
is replaced by a minimal attribute dict when it is not installed. Fixed seeds: a rerun with the
same torch writes the same values. What each file holds: tests/data/golden_detr/README.md.
"""
import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import types

import numpy as np

# Three images of different sizes, padded at the bottom and right to the batch's 5 x 5 grid, as
# DETR's NestedTensor batches them (util/misc.py nested_tensor_from_tensor_list).
SIZES = [(3, 4), (5, 3), (4, 5)]
D_MODEL, NHEAD, DIM_FF = 32, 4, 64
# --enc_rpe2d strings: the reference README's configuration (contextual Product, shared head, on
# keys, ratio 2.0: 9 x 9 buckets) and one with per-head tables on queries, keys and values.
CASES = ["rpe-2.0-product-ctx-1-k", "rpe-1.9-product-ctx-0-qkv"]
SEED = 26


def stub_easydict():
    """A dict with attribute access in place of easydict.EasyDict when easydict is missing."""
    try:
        importlib.import_module("easydict")
        return
    except ImportError:
        pass

    class AttrDict(dict):
        def __getattr__(self, name):
            try:
                return self[name]
            except KeyError as e:
                raise AttributeError(name) from e

        def __setattr__(self, name, value):
            self[name] = value

    mod = types.ModuleType("easydict")
    mod.EasyDict = AttrDict
    sys.modules["easydict"] = mod


def import_reference(detr):
    """models.transformer and models.rpe_attention.irpe without running models/__init__.py (it
    imports the backbone, which needs torchvision)."""
    stub_easydict()
    pkg = types.ModuleType("models")
    pkg.__path__ = [os.path.join(detr, "models")]
    sys.modules["models"] = pkg
    transformer = importlib.import_module("models.transformer")
    irpe = importlib.import_module("models.rpe_attention.irpe")
    return transformer, irpe


def git_info(detr):
    try:
        commit = subprocess.run(["git", "-C", detr, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    path = os.path.join(detr, "models", "rpe_attention", "irpe.py")
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    return commit, sha


def save(folder, files, name, array, meaning):
    array = np.ascontiguousarray(array)
    np.save(os.path.join(folder, name), array)
    files[name] = {"shape": list(array.shape), "dtype": str(array.dtype), "meaning": meaning}


def fill_parameters(layer, torch, gen):
    """Every parameter random (seeded), so that biases, LayerNorm affine parameters and the iRPE
    tables (zero at the reference's initialisation) all take part."""
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "lookup_table" in name:
                p.copy_(0.5 * r)
            elif name.startswith("norm") and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            else:  # (out, in) weights: unit-variance outputs
                p.copy_(r / np.sqrt(p.shape[-1]))


def run_case(spec, transformer, irpe, torch, out_root, commit, sha):
    sp = spec.split("-")
    ratio, method, mode, shared_head, rpe_on = float(sp[1]), sp[2], sp[3], bool(int(sp[4])), sp[5]
    rpe_config = irpe.get_rpe_config(ratio=ratio, method=method, mode=mode, shared_head=shared_head, skip=0,
                                     rpe_on=rpe_on)
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    layer = transformer.TransformerEncoderLayer(D_MODEL, NHEAD, DIM_FF, dropout=0.0, activation="relu",
                                                normalize_before=False, rpe_config=rpe_config)
    fill_parameters(layer, torch, gen)
    layer.eval()

    B = len(SIZES)
    H = max(h for h, _ in SIZES)
    W = max(w for _, w in SIZES)
    L = H * W
    mask = torch.ones(B, H, W, dtype=torch.bool)  # True = padded, as DETR's NestedTensor mask
    for b, (h, w) in enumerate(SIZES):
        mask[b, :h, :w] = False
    mask = mask.flatten(1)  # (B, L)
    src = torch.randn(L, B, D_MODEL, generator=gen)  # (L, B, C): the reference's sequence-first layout
    pos = 0.5 * torch.randn(L, B, D_MODEL, generator=gen)

    def run(dtype):
        m = layer.to(dtype)
        with torch.no_grad():
            s, p = src.to(dtype), pos.to(dtype)
            qk = s + p
            attn = m.self_attn(qk, qk, value=s, key_padding_mask=mask, hw=(H, W))[0]
            y = m(s, src_key_padding_mask=mask, pos=p, hw=(H, W))
        return attn.transpose(0, 1).numpy(), y.transpose(0, 1).numpy()

    attn64, out64 = run(torch.float64)
    attn32, out32 = run(torch.float32)
    layer.float()

    folder = os.path.join(out_root, "layer_" + spec.replace(".", "_").replace("-", "_"))
    os.makedirs(folder, exist_ok=True)
    files = {}
    save(folder, files, "src.npy", src.transpose(0, 1).numpy(), "encoder input (B, L, C), N(0, 1) at every token")
    save(folder, files, "pos.npy", pos.transpose(0, 1).numpy(),
         "absolute position embedding (B, L, C) added to q and k (DETR's sine embedding in a real model), N(0, 0.25)")
    save(folder, files, "key_padding_mask.npy", mask.numpy().astype(np.uint8), "(B, L) 1 = padded token (key)")
    save(folder, files, "sizes.npy", np.array(SIZES, dtype=np.int32), "(B, 2) valid (height, width) of each image")
    names = {}
    for name, p in sorted(layer.named_parameters()):
        file = name.replace("self_attn.", "").replace(".lookup_table_weight", "_table").replace(".", "_") + ".npy"
        names[name] = file
        save(folder, files, file, p.detach().numpy(), f"parameter {name} {tuple(p.shape)}")
    save(folder, files, "attn_out.npy", attn32,
         "self_attn(src + pos, src + pos, src, key_padding_mask, hw) (B, L, C): RPEMultiheadAttention output, "
         "after out_proj, float32")
    save(folder, files, "attn_out_f64.npy", attn64, "the same in float64 (float32 inputs and parameters cast)")
    save(folder, files, "out.npy", out32, "layer(src, src_key_padding_mask, pos, hw) (B, L, C): the encoder layer, float32")
    save(folder, files, "out_f64.npy", out64, "the same in float64")

    valid = ~mask.numpy()
    diffs = {k: float(np.abs(a32 - a64)[valid].max()) for k, a32, a64 in
             [("attn_out.npy", attn32, attn64), ("out.npy", out32, out64)]}
    meta = {
        "kind": "detr_encoder_layer",
        "enc_rpe2d": spec,
        "ratio": ratio, "method": method, "mode": mode, "shared_head": shared_head, "skip": 0, "rpe_on": rpe_on,
        "alpha": ratio, "beta": 2 * ratio, "gamma": 8 * ratio,
        "num_buckets": {c: getattr(layer.self_attn, "rpe_" + c).num_buckets
                        for c in "qkv" if getattr(layer.self_attn, "rpe_" + c) is not None},
        "batch": B, "sizes": [list(s) for s in SIZES], "padded_height": H, "padded_width": W, "L": L,
        "d_model": D_MODEL, "nhead": NHEAD, "head_dim": D_MODEL // NHEAD, "dim_feedforward": DIM_FF,
        "activation": "relu", "normalize_before": False, "dropout": 0.0,
        "parameters": names,
        "layout": "token t of image b is row t // padded_width, column t % padded_width of the padded grid; image b "
                  "occupies rows < sizes[b][0] and columns < sizes[b][1]; the rest is padding (key_padding_mask 1). "
                  "Tensors are batch-first (B, L, C); the reference runs sequence-first (L, B, C)",
        "formula": "q, k, v = (src + pos, src + pos, src) @ in_proj_weight.T + in_proj_bias (rows 0:C, C:2C, 2C:3C), "
                   "split into heads (C = nhead * head_dim, head h = channels h*head_dim:(h+1)*head_dim); "
                   "logits = (q*s) k^T + rpe_k(q*s) + rpe_q(k*s)^T with s = head_dim**-0.5 and the ids of the "
                   "padded_height x padded_width grid (skip 0); padded keys -inf; softmax; o = a v + rpe_v(a); "
                   "attn_out = o @ out_proj_weight.T + out_proj_bias; x = norm1(src + attn_out); "
                   "out = norm2(x + linear2(relu(linear1(x)))) (post-norm, LayerNorm eps 1e-5)",
        "compare": "attn_out.npy and out.npy at valid query tokens (key_padding_mask 0); rows of padded queries are "
                   "ordinary (the reference computes them) but carry no meaning",
        "observed_max_abs_diff_f32_vs_f64_valid": diffs,
        "seed": SEED,
        "reference": {
            "repository": "microsoft/Cream", "path": "iRPE/DETR-with-iRPE/models/transformer.py",
            "attention": "iRPE/DETR-with-iRPE/models/rpe_attention/rpe_attention_function.py "
                         "rpe_multi_head_attention_forward",
            "commit": commit, "irpe_py_sha256": sha, "rpe_ops_built": False,
            "torch_version": torch.__version__, "numpy_version": np.__version__, "torch_threads": 1,
        },
        "files": files,
    }
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{spec}: {folder}, max |f32 - f64| at valid queries {diffs}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detr", default=os.environ.get("DETR_IRPE_SRC"),
                    help="the reference's iRPE/DETR-with-iRPE folder (default $DETR_IRPE_SRC)")
    ap.add_argument("--commit", default=None, help="the checkout's commit, when --detr is not a git work tree")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "golden_detr"))
    args = ap.parse_args()
    if not args.detr:
        ap.error("--detr (or DETR_IRPE_SRC) is required")
    detr = os.path.abspath(args.detr)
    sys.path.insert(0, detr)
    import torch

    torch.set_num_threads(1)
    transformer, irpe = import_reference(detr)
    commit, sha = git_info(detr)
    commit = args.commit or commit
    for spec in CASES:
        run_case(spec, transformer, irpe, torch, os.path.abspath(args.out), commit, sha)


if __name__ == "__main__":
    main()
