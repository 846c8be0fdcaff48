#!/usr/bin/env python3
"""rpe_torch's CUDA attention against what a PyTorch user has on the same GPU: one DeiT-S-like
attention step (default B=8, H=6, L=1+14·14=197, D=64), forward and forward + backward, in float32
and bfloat16, timed with CUDA events (medians of --repeat rounds; each round runs every line once,
after --warmup rounds). Needs rpe_torch's CUDA operators (RPE_TORCH_OPS) and a CUDA device.

    RPE_TORCH_OPS=build/bindings/torch/librpe_torch_ops.so PYTHONPATH=bindings/torch \\
        python bindings/torch/bench/bench_cuda.py [--batch 8 --heads 6 --dim 64 --grid 14] [--repeat 50]

Lines (ms per call; ratio = line / rpe_torch.attention of the same RPE and pass, > 1: rpe_torch is faster):

- ``none``: rpe_torch.attention without RPE, and ``scaled_dot_product_attention`` (PyTorch picks
  its fastest kernel: flash or memory-efficient attention);
- ``irpe_k``: iRPE-K (Product, ratio 1.9, contextual, shared heads, one class token) fused by
  rpe_torch.attention, and SDPA with the term materialised as its float ``attn_mask`` by the
  iRPE module (``rpe_k(q·scale)``, a (B, H, L, L) tensor: the reference's composition);
- ``irpe_qkv``: iRPE on queries, keys and values fused by rpe_torch.attention, and the reference's
  composition with rpe_torch's modules (logits, softmax, ``a·v + rpe_v(a)``) in PyTorch ops.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rpe_torch  # noqa: E402
from bench_attention import composed  # noqa: E402  (the reference's RPEAttention step in PyTorch ops)


def timed(fn, backward, grad):
    """Milliseconds of one call of fn (and its backward), by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    if backward:
        out.backward(grad)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--grid", type=int, default=14)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available() or not rpe_torch.has_cuda_kernels():
        sys.exit("bench_cuda: needs a CUDA device and rpe_torch's CUDA operators (RPE_TORCH_OPS)")
    B, H, D, side = args.batch, args.heads, args.dim, args.grid
    L = 1 + side * side
    scale = D ** -0.5
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; B={B} H={H} L={L} D={D}; "
          f"medians of {args.repeat} rounds (ms)")
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
        grad = torch.randn(B, H, L, D, device="cuda", dtype=dtype, generator=gen)
        mods = {}
        for on in ("q", "k", "v"):
            cfg = rpe_torch.get_rpe_config(ratio=1.9, method="product", mode="ctx", shared_head=True, skip=1, rpe_on=on)
            built = rpe_torch.build_rpe(cfg, head_dim=D, num_heads=H)
            mods[on] = built["qkv".index(on)].to(device="cuda", dtype=dtype)
            torch.nn.init.normal_(mods[on].lookup_table_weight, std=0.02)
        rq, rk, rv = mods["q"], mods["k"], mods["v"]
        lines = {
            ("none", "rpe_torch.attention"): lambda: rpe_torch.attention(q, k, v, height=side, width=side),
            ("none", "sdpa"): lambda: F.scaled_dot_product_attention(q, k, v),
            ("irpe_k", "rpe_torch.attention"): lambda: rpe_torch.attention(q, k, v, None, rk, None, height=side, width=side),
            ("irpe_k", "sdpa + materialised term"):
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=rk(q * scale)),
            ("irpe_qkv", "rpe_torch.attention"): lambda: rpe_torch.attention(q, k, v, rq, rk, rv, height=side, width=side),
            ("irpe_qkv", "composed (PyTorch ops)"): lambda: composed((rq, rk, rv), q, k, v, scale),
        }
        for key, fn in list(lines.items()):  # a line that cannot run is reported and left out
            try:
                fn().sum().backward()
            except Exception as e:  # noqa: BLE001 (a benchmark reports every failure and goes on)
                print(f"{str(dtype).removeprefix('torch.'):9s} {key[0]} {key[1]}: left out ({type(e).__name__}: {e})")
                del lines[key]
        for backward in (False, True):
            times = {key: [] for key in lines}
            for r in range(args.warmup + args.repeat):
                for key, fn in lines.items():
                    for t in (q, k, v):
                        t.grad = None
                    if backward:
                        ms = timed(fn, True, grad)
                    else:
                        with torch.no_grad():
                            ms = timed(fn, False, None)
                    if r >= args.warmup:
                        times[key].append(ms)
            med = {key: statistics.median(t) for key, t in times.items()}
            pass_name = "fwd+bwd" if backward else "fwd"
            for (rpe, impl), ms in med.items():
                ours = med.get((rpe, "rpe_torch.attention"), float("nan"))
                ratio = ms / ours
                print(f"{str(dtype).removeprefix('torch.'):9s} {pass_name:8s} {rpe:9s} {impl:26s} {ms:8.4f} ms  ratio {ratio:5.2f}")


if __name__ == "__main__":
    main()
