#!/usr/bin/env python3
"""DeiT-S attention step (B=8, H=6, L=197, D=64, Product ratio 1.9, class token), forward +
backward: rpe_torch.attention against the reference's modules composed as its RPEAttention does
(and rpe_torch's own modules composed the same way). Medians of --repeat rounds (each round runs
every implementation once), same threads.

    PYTHONPATH=bindings/torch .venv/bin/python bindings/torch/bench/bench_attention.py \
        [--reference /path/to/Cream/iRPE/DeiT-with-iRPE] [--threads 1] [--repeat 7] [--compare all]
        [--batch 64 --heads 4 --dim 16 --grid 8]      # the digits model's attention instead

Prints one line per (rpe_on, implementation) and the ratio reference / fused.

Then (``--compare torch`` or ``all``, the default) what a PyTorch user has, same shapes, same run,
medians (``--repeat``), a table with the ratio other / rpe_torch (> 1: rpe_torch is faster):

- iRPE-K (Product, contextual; and bias mode) with ``rpe_torch.attention``, forward and
  forward + backward, against ``scaled_dot_product_attention`` with the iRPE term materialised as
  a float ``attn_mask`` (the contextual term by torch ops: ``(q·s)·table`` gathered by the
  bucket ids; the bias term: ``table[:, ids]``);
- iRPE-K bias, forward under ``torch.no_grad``, against FlexAttention
  (``torch.nn.attention.flex_attention``, compiled: what runs on CPU) with a ``score_mod``
  reading the bias table through the bucket ids (``--no-flex`` skips its compile);
- ``rpe_torch.attention`` without RPE against ``scaled_dot_product_attention``: forward in grad mode
  (q, k, v require grad), forward under ``torch.no_grad``, forward + backward;
- a timm model (``--timm-model``, default DeiT-S; ``--timm-depth`` blocks) with
  ``rpe_torch.timm.swap_attention`` against timm's own: forward (no_grad) and one AdamW training
  step (``--no-timm`` skips it).
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


def _ids(skip, grid):
    """The (L, L) int64 bucket ids of Product ratio 1.9 on a grid x grid patch grid after skip tokens."""
    return rpe_torch.bucket_ids("product", 1.9, 3.8, 15.2, skip, grid, grid)[0].long()


def _sdpa_contextual(q, k, v, table, ids, scale):
    """SDPA with the contextual iRPE-K term by torch ops as its float attn_mask: (q·s)·table
    (B, H, L, K) gathered by the ids to (B, H, L, L)."""
    b, h, n, _ = q.shape
    qt = (q * scale) @ table  # table (1, D, K) -> (B, H, L, K)
    term = qt.gather(-1, ids.expand(b, h, n, n))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=term, scale=scale)


def _sdpa_bias(q, k, v, table, ids, scale):
    """SDPA with the iRPE-K bias table[:, ids] (1, H, L, L) as its float attn_mask."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=table[:, ids].unsqueeze(0),
                                                            scale=scale)


def _no_grad(fn, *args, **kwargs):
    """fn(*args, **kwargs) under torch.no_grad (inference: no autograd graph, q, k, v requiring grad
    or not)."""
    with torch.no_grad():
        return fn(*args, **kwargs)


def _row(rows, case, ours, other, ms, shown):
    """A table row: the case, rpe_torch's median, the other implementation's name and median."""
    rows.append((case, ms[ours], shown, ms[other]))


def compare_torch(args):
    """The comparisons with PyTorch's own attention (module docstring); returns the table rows."""
    B, H, D, grid = args.batch, args.heads, args.dim, args.grid
    L, skip = grid * grid + 1, 1
    scale = D ** -0.5
    g = torch.Generator().manual_seed(1)
    ids = _ids(skip, grid)
    rows = []

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    q, k, v = leaf(B, H, L, D), leaf(B, H, L, D), leaf(B, H, L, D)
    # iRPE-K contextual (DeiT-iRPE's default) and bias, rpe_torch's modules holding the tables
    mods = {}
    for mode in ("contextual", "bias"):
        cfg = rpe_torch.get_rpe_config(ratio=1.9, method="product", mode=mode, shared_head=mode == "contextual",
                                       skip=skip, rpe_on="k")
        _, rk, _ = rpe_torch.build_rpe(cfg, head_dim=D, num_heads=H)
        with torch.no_grad():
            rk._table().normal_(generator=g)
        mods[mode] = rk
    ctx_table = mods["contextual"].lookup_table_weight  # (1, D, K)
    bias_table = mods["bias"].lookup_table_bias  # (H, K)

    def fused(mode):
        return rpe_torch.attention(q, k, v, rpe_k=mods[mode], height=grid, width=grid, scale=scale)

    with torch.no_grad():  # the same math on both sides before timing it
        for mode, other in (("contextual", _sdpa_contextual(q, k, v, ctx_table, ids, scale)),
                            ("bias", _sdpa_bias(q, k, v, bias_table, ids, scale))):
            torch.testing.assert_close(fused(mode), other, atol=1e-4, rtol=1e-4)
    fns = {
        "ctx fwd rpe": lambda: fused("contextual"),
        "ctx fwd sdpa": lambda: _sdpa_contextual(q, k, v, ctx_table, ids, scale),
        "ctx fwd+bwd rpe": lambda: fused("contextual").sum().backward(),
        "ctx fwd+bwd sdpa": lambda: _sdpa_contextual(q, k, v, ctx_table, ids, scale).sum().backward(),
        "bias fwd rpe": lambda: fused("bias"),
        "bias fwd sdpa": lambda: _sdpa_bias(q, k, v, bias_table, ids, scale),
        "bias fwd+bwd rpe": lambda: fused("bias").sum().backward(),
        "bias fwd+bwd sdpa": lambda: _sdpa_bias(q, k, v, bias_table, ids, scale).sum().backward(),
        "plain fwd rpe": lambda: rpe_torch.attention(q, k, v, scale=scale),
        "plain fwd sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale),
        "plain fwd no_grad rpe": lambda: _no_grad(rpe_torch.attention, q, k, v, scale=scale),
        "plain fwd no_grad sdpa": lambda: _no_grad(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                                                   scale=scale),
        "plain fwd+bwd rpe": lambda: rpe_torch.attention(q, k, v, scale=scale).sum().backward(),
        "plain fwd+bwd sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        .sum().backward(),
    }
    ms = interleaved_medians(fns, args.repeat)
    for case in ("ctx fwd", "ctx fwd+bwd", "bias fwd", "bias fwd+bwd", "plain fwd", "plain fwd no_grad",
                 "plain fwd+bwd"):
        what = {"ctx": "iRPE-K contextual", "bias": "iRPE-K bias", "plain": "no RPE"}[case.split()[0]]
        shown = "SDPA" if case.startswith("plain") else "SDPA + float attn_mask (torch ops)"
        step = " ".join(case.split()[1:]).replace(" no_grad", ", no_grad")
        _row(rows, f"{what} {step} (B={B} H={H} L={L} D={D})", f"{case} rpe", f"{case} sdpa", ms, shown)

    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        bias_d = bias_table.detach()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias_d[h, ids[q_idx, kv_idx]]

        qd, kd, vd = q.detach(), k.detach(), v.detach()  # CPU flex has no backward: inputs without grad
        try:
            flex = torch.compile(flex_attention, dynamic=False)
            with torch.no_grad():
                flex(qd, kd, vd, score_mod=score_mod, scale=scale)  # compile outside the timing
                torch.testing.assert_close(flex(qd, kd, vd, score_mod=score_mod, scale=scale),
                                           rpe_torch.attention(qd, kd, vd, rpe_k=mods["bias"], height=grid,
                                                               width=grid, scale=scale), atol=1e-4, rtol=1e-4)
            label = "flex (compiled)"
        except Exception as e:  # noqa: BLE001  (a CPU build without inductor: eager flex, named so)
            print(f"bench_attention: compiled flex_attention failed ({type(e).__name__}: {e}); timing it eager")
            flex, label = flex_attention, "flex (eager)"
        with torch.no_grad():
            ms = interleaved_medians({
                "rpe": lambda: rpe_torch.attention(qd, kd, vd, rpe_k=mods["bias"], height=grid, width=grid,
                                                   scale=scale),
                label: lambda: flex(qd, kd, vd, score_mod=score_mod, scale=scale),
            }, args.repeat)
        _row(rows, f"iRPE-K bias fwd, no_grad (B={B} H={H} L={L} D={D})", "rpe", label, ms,
             f"FlexAttention score_mod, {label.split()[1][1:-1]}")

    if not args.no_timm:
        import copy

        import timm

        import rpe_torch.timm as rt

        kwargs = {"depth": args.timm_depth} if args.timm_depth else {}
        torch.manual_seed(0)
        own = timm.create_model(args.timm_model, pretrained=False, **kwargs)
        swapped = rt.swap_attention(copy.deepcopy(own))
        x = torch.randn(B, 3, *own.patch_embed.img_size, generator=g)
        y = torch.randint(0, own.num_classes, (B,), generator=g)
        opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (own, swapped)}

        def forward(m):
            m.eval()
            with torch.no_grad():
                m(x)

        def train_step(m):
            m.train()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            opts[id(m)].zero_grad()
            loss.backward()
            opts[id(m)].step()

        ms = interleaved_medians({"fwd swap": lambda: forward(swapped), "fwd timm": lambda: forward(own),
                                  "step swap": lambda: train_step(swapped), "step timm": lambda: train_step(own)},
                                 args.repeat)
        name = f"{args.timm_model}{f' depth {args.timm_depth}' if args.timm_depth else ''} batch {B}"
        _row(rows, f"timm {name} forward, swap_attention", "fwd swap", "fwd timm", ms, "timm's own")
        _row(rows, f"timm {name} training step, swap_attention", "step swap", "step timm", ms, "timm's own")
    return rows


def print_table(rows, args):
    print(f"\nbench_attention vs PyTorch: threads {args.threads}, median of {args.repeat} (ms; ratio = other / rpe_torch)")
    print("| case | rpe_torch ms | other | other ms | other / rpe_torch |\n|---|---|---|---|---|")
    for case, ours_ms, other, other_ms in rows:
        print(f"| {case} | {ours_ms:.2f} | {other} | {other_ms:.2f} | {other_ms / ours_ms:.2f}x |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reference", help="folder of the reference's irpe.py")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--grid", type=int, default=14)
    p.add_argument("--compare", choices=("reference", "torch", "all"), default="all",
                   help="reference: the reference's modules (and rpe_torch's) only; torch: PyTorch's own attention only")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while)")
    p.add_argument("--no-timm", action="store_true", help="skip the timm model")
    p.add_argument("--timm-model", default="deit_small_patch16_224")
    p.add_argument("--timm-depth", type=int, default=0, help="blocks of the timm model (0: the model's own)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.compare != "reference":
        rows = compare_torch(args)
        print_table(rows, args)
        if args.compare == "torch":
            return
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
