#!/usr/bin/env python3
"""DeiT-S attention step (B=8, H=6, L=197, D=64, Product ratio 1.9, class token), forward +
backward: rpe_torch.attention against the reference's modules composed as its RPEAttention does
(and rpe_torch's own modules composed the same way). Medians of --repeat rounds (each round runs
every implementation once), same threads.

    PYTHONPATH=bindings/torch /usr/bin/python3 bindings/torch/bench/bench_attention.py \
        --reference /path/to/Cream/iRPE/DeiT-with-iRPE [--threads 1] [--repeat 7]
        [--batch 64 --heads 4 --dim 16 --grid 8]      # the digits model's attention instead

Prints one line per (rpe_on, implementation) and the ratio reference / fused.
"""
import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rpe_torch  # noqa: E402


def composed(irpe_mods, q, k, v, scale):
    rq, rk, rv = irpe_mods
    qs = q * scale
    logits = qs @ k.transpose(-2, -1)
    if rk is not None:
        logits = logits + rk(qs)
    if rq is not None:
        logits = logits + rq(k * scale).transpose(2, 3)
    a = logits.softmax(-1)
    out = a @ v
    if rv is not None:
        out = out + rv(a)
    return out


def interleaved_medians(fns, repeat):
    """Median ms of each closure, timed in rounds (one run of each per round) so that a noisy
    machine's slow spells hit every implementation alike."""
    for fn in fns.values():
        fn()  # warm-up: allocations, id caches
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reference", help="folder of the reference's irpe.py")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--grid", type=int, default=14)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    impls = {"rpe_torch modules": rpe_torch}
    if args.reference:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = importlib.util.spec_from_file_location("irpe", Path(args.reference) / "irpe.py")
            ref = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(ref)
        impls["reference modules"] = ref
    B, H, L, D = args.batch, args.heads, (args.grid ** 2) + 1, args.dim
    scale = D ** -0.5
    g = torch.Generator().manual_seed(0)
    for rpe_on in ("k", "qkv"):
        q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3))
        fns = {}
        for name, pkg in impls.items():
            cfg = pkg.get_rpe_config(ratio=1.9, method=pkg.METHOD.PRODUCT, mode="contextual", shared_head=True, skip=1,
                                     rpe_on=rpe_on)
            mods = pkg.build_rpe(cfg, head_dim=D, num_heads=H)
            with torch.no_grad():
                for m in mods:
                    if m is not None:
                        m.lookup_table_weight.normal_(generator=g)

            def step(mods=mods):
                composed(mods, q, k, v, scale).sum().backward()

            fns[name] = step
            if pkg is rpe_torch:
                def fused(mods=mods):
                    rpe_torch.attention(q, k, v, *mods, height=args.grid, width=args.grid).sum().backward()

                fns["rpe_torch.attention (fused)"] = fused
        results = interleaved_medians(fns, args.repeat)
        for name, ms in results.items():
            print(f"bench_attention: rpe_on {rpe_on} {name}: {ms:.1f} ms (B={B} H={H} L={L} D={D}, "
                  f"threads {args.threads}, fwd+bwd, median of {args.repeat})")
        if "reference modules" in results:
            print(f"bench_attention: rpe_on {rpe_on} reference / fused = "
                  f"{results['reference modules'] / results['rpe_torch.attention (fused)']:.2f}x")


if __name__ == "__main__":
    main()
