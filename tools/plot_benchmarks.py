#!/usr/bin/python3
"""Plots rpe's Google Benchmark JSON (and tools/compare_reference.py's JSON) as PNGs for docs/.

Reads one or more benchmark JSON files (later files win for a name present twice) and writes,
into --out (default docs/img/), whichever of these the data allows:

* ``terms_vs_grid.png``      time vs sequence length L per term variant (float32, batch 8, shared
                             table): Product's modes/targets with the naive O(L²·D) baseline, and the
                             contextual key term of every mapping
* ``naive_ratio.png``        naive / rpe time of the contextual key term vs L (the O(L²·D) vs
                             O(L·K·D) claim as a measured ratio), batch 1 and 8, float and double
* ``attention_overhead.png`` fused attention time without RPE, with iRPE on k and on q, k, v
* ``bucket_ids.png``         cold bucket-id build time and storage vs L, ours against int64 (L, L)
* ``reference.png``          speed-up over the reference per case of tools/compare_reference.py
                             (``ref/`` terms and bucket ids, the DeiT-S attention step forward and
                             forward + backward, the digits job), with the targets

With --tables it also prints the Markdown tables of docs/benchmarks.md. Times are medians of repetitions when the JSON holds aggregates (CPU time unless --wall), else the
single run's. Needs python3-matplotlib.

Usage::

    /usr/bin/python3 tools/plot_benchmarks.py build/bench.json --compare build/compare_reference.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import atomic_write  # tools/atomic_write.py: every output written to a temporary file, then renamed

ROOT = Path(__file__).resolve().parent.parent
SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def load(paths: list[Path], wall: bool) -> dict:
    """name → {"s": seconds, **counters}; medians where aggregates exist."""
    plain, medians = {}, {}
    for path in paths:
        for b in json.loads(path.read_text()).get("benchmarks", []):
            if b.get("error_occurred"):
                continue
            entry = {k: v for k, v in b.items() if isinstance(v, (int, float))}
            entry["s"] = (b["real_time"] if wall else b["cpu_time"]) * SCALE[b["time_unit"]]
            name = b.get("run_name", b["name"]).removesuffix("/real_time")  # UseRealTime() cases carry the suffix
            if b.get("run_type") == "aggregate":
                if b.get("aggregate_name") == "median":
                    medians[name] = entry
            else:
                plain.setdefault(name, entry)
    plain.update(medians)
    return plain


def savefig(fig, out: Path, name: str) -> None:
    fig.tight_layout()
    with atomic_write.replacing(out / name) as tmp:  # a failed savefig leaves the old PNG
        fig.savefig(tmp, dpi=110)
    print(f"plot_benchmarks: wrote {out / name}", file=sys.stderr)


def plot_terms(data: dict, out: Path, plt) -> None:
    grids = ["14x14+1", "25x38", "28x28", "56x56"]
    def series(prefix: str, suffix: str):
        pts = [(data[n]["L"], data[n]["s"] * 1e3) for g in grids if (n := f"{prefix}/{g}/{suffix}") in data and "L" in data[n]]
        return sorted(pts)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ax = axes[0]
    for mt, label in (("ctx_k", "contextual k"), ("ctx_q", "contextual q"), ("ctx_v", "contextual v"),
                      ("bias_k", "bias k"), ("bias_q", "bias q")):
        pts = series(f"term/product/{mt}/shared", "b8/f32")
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    pts = series("naive/ctx_k", "b8/f32")
    if pts:
        ax.plot(*zip(*pts), marker="x", linestyle="--", color="black", label="naive contextual k, O(L²·D)")
    ax.set_title("Product (ratio 1.9), B=8, H=6, D=64, float32, shared table")
    ax2 = axes[1]
    for m in ("product", "euclidean", "quantization", "cross", "euclidean_paper", "quantization_paper"):
        pts = series(f"term/{m}/ctx_k/shared", "b8/f32")
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=m)
    ax2.set_title("contextual k term per mapping, B=8, float32, shared table")
    for a in axes:
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("sequence length L (grids 14x14+1, 28x28, 25x38, 56x56)")
        a.set_ylabel("forward time (ms)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    savefig(fig, out, "terms_vs_grid.png")
    plt.close(fig)


def plot_naive_ratio(data: dict, out: Path, plt) -> bool:
    grids = ["14x14+1", "25x38", "28x28", "56x56"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drew = False
    for b in ("b1", "b8"):
        for f in ("f32", "f64"):
            pts = []
            for g in grids:
                naive, ours = f"naive/ctx_k/{g}/{b}/{f}", f"term/product/ctx_k/shared/{g}/{b}/{f}"
                if naive in data and ours in data:
                    pts.append((data[ours]["L"], data[naive]["s"] / data[ours]["s"]))
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=f"batch {b[1:]}, {'float' if f == 'f32' else 'double'}")
                drew = True
    if not drew:
        plt.close(fig)
        return False
    ax.set_xscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("naive time / rpe time")
    ax.set_title("contextual k term: naive O(L²·D) vs rpe O(L·K·D) + O(L²)\nProduct 1.9, H=6, D=64")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    savefig(fig, out, "naive_ratio.png")
    plt.close(fig)
    return True


def plot_attention(data: dict, out: Path, plt) -> bool:
    groups = [(f"{kind}/{shape}", f"{label}, {shape}") for shape in ("deit_s", "grid56")
              for kind, label in (("attention", "forward"), ("attention_fwd_bwd", "fwd+bwd"))]
    groups = [(g, label) for g, label in groups if f"{g}/none" in data]
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.25
    for i, (rpe, color) in enumerate((("none", "0.6"), ("k", "tab:blue"), ("qkv", "tab:orange"))):
        xs, ys = [], []
        for j, (g, _) in enumerate(groups):
            if f"{g}/{rpe}" in data:
                base = data[f"{g}/none"]["s"]
                xs.append(j + (i - 1) * width)
                ys.append(data[f"{g}/{rpe}"]["s"] / base)
        bars = ax.bar(xs, ys, width, label={"none": "no RPE", "k": "iRPE-K", "qkv": "iRPE-QKV"}[rpe], color=color)
        if rpe != "none":
            for bar, y in zip(bars, ys):
                ax.annotate(f"{(y - 1) * 100:+.0f}%", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([label for _, label in groups])
    ax.set_ylabel("time / time without RPE")
    ax.set_title("fused attention: RPE overhead (contextual Product 1.9, shared tables), float32")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    savefig(fig, out, "attention_overhead.png")
    plt.close(fig)
    return True


def plot_bucket_ids(data: dict, out: Path, plt) -> bool:
    by_mapping = defaultdict(list)
    for name, e in data.items():
        if name.startswith("bucket_ids/build/") and "L" in e:
            by_mapping[name.split("/")[2]].append((e["L"], e["s"] * 1e3, e.get("id_bytes", 0), e.get("int64_bytes", 0)))
    if not by_mapping:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m, pts in sorted(by_mapping.items()):
        pts.sort()
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    axes[0].set_title("cold bucket-id build time (rpe::build_bucket_ids)")
    axes[0].set_ylabel("time (ms)")
    pts = sorted(by_mapping.get("product", next(iter(by_mapping.values()))))
    axes[1].plot([p[0] for p in pts], [p[2] / 1e6 for p in pts], marker="o", label="rpe (1 byte per pair)")
    axes[1].plot([p[0] for p in pts], [p[3] / 1e6 for p in pts], marker="x", linestyle="--", label="int64 (L, L) table")
    axes[1].set_title("bucket-id storage, Product (one table)")
    axes[1].set_ylabel("MB")
    for a in axes:
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("sequence length L (grids up to 128x128)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    savefig(fig, out, "bucket_ids.png")
    plt.close(fig)
    return True


def short_case(case: str) -> str:
    """A compare_reference.py case name as an axis label: ref/ctx_product_k_fwd → ctx_k_fwd,
    attention_fwd_bwd/deit_s/qkv → attn fwd+bwd qkv, digits/a → digits a."""
    case = case.removeprefix("ref/").replace("_product", "").replace("bucket_ids_", "ids ")
    for long, short in (("attention_fwd_bwd/", "attn fwd+bwd "), ("attention/", "attn "), ("digits/", "digits ")):
        case = case.replace(long, short)
    return case.replace("deit_s/", "")


def plot_reference(compare: Path, out: Path, plt) -> bool:
    doc = json.loads(compare.read_text())
    if "rows" not in doc:
        sys.exit(f"plot_benchmarks: {compare} holds no 'rows'; pass the JSON of one tools/compare_reference.py run "
                 "(with several --threads values: one of its .t<N>.json files)")
    # attention_composed/ (rpe's unfused baseline, no target) stays in the table, out of the plot
    rows = [r for r in doc["rows"] if r.get("speedup") and not r["case"].startswith("attention_composed/")]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(9.0, 0.75 * len(rows)), 4.8))
    xs = range(len(rows))
    w = 0.38
    for x, r in zip(xs, rows):
        color = "tab:green" if r.get("target_met") in (True, None) else "tab:red"
        bar = ax.bar(x - w / 2, r["speedup"], w, color=color, label="vs reference forward with autograd" if x == 0 else None)[0]
        ax.annotate(f"{r['speedup']:.1f}×", (bar.get_x() + w / 2, r["speedup"]), ha="center", va="bottom", fontsize=8)
        if r.get("speedup_no_grad"):
            bar = ax.bar(x + w / 2, r["speedup_no_grad"], w, color=color, alpha=0.45, hatch="//",
                         label="vs reference under torch.no_grad()" if x == 0 else None)[0]
            ax.annotate(f"{r['speedup_no_grad']:.1f}×", (bar.get_x() + w / 2, r["speedup_no_grad"]), ha="center", va="bottom", fontsize=8)
        if r.get("target"):
            ax.plot([x - 0.45, x + 0.45], [r["target"]] * 2, color="black", linestyle="--", linewidth=1)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([short_case(r["case"]) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("reference time / rpe time\n(digits: rpe images/s / reference images/s)")
    meta = doc["meta"]
    ax.set_title(f"rpe vs reference (PyTorch, {meta['threads']} thread(s), {meta['clock']}); dashed: target\n"
                 "B=8, H=6, L=197, D=64, Product 1.9, float32; digits: images/s, 450 test images")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    savefig(fig, out, "reference.png")
    plt.close(fig)
    return True


def markdown_tables(data: dict) -> str:
    """The docs' tables: naive vs rpe per grid, term variants at DeiT-S, bucket-id builds."""
    grids = ["14x14+1", "25x38", "28x28", "56x56"]
    out = ["| grid | L | batch | scalar | rpe | naive O(L²·D) | naive / rpe |", "|---|---|---|---|---|---|---|"]
    for g in grids:
        for b in ("b1", "b8"):
            for f in ("f32", "f64"):
                naive, ours = f"naive/ctx_k/{g}/{b}/{f}", f"term/product/ctx_k/shared/{g}/{b}/{f}"
                if naive in data and ours in data:
                    out.append(f"| {g} | {data[ours]['L']:.0f} | {b[1:]} | {'float' if f == 'f32' else 'double'} | "
                               f"{data[ours]['s'] * 1e3:.2f} ms | {data[naive]['s'] * 1e3:.1f} ms | {data[naive]['s'] / data[ours]['s']:.1f}× |")
    out += ["", "| mapping | K | " + " | ".join(grids) + " |", "|---|---|" + "---|" * len(grids)]
    for mt in ("ctx_k", "ctx_q", "ctx_v", "bias_k", "bias_q"):
        for m in ("product", "euclidean", "quantization", "cross", "euclidean_paper", "quantization_paper"):
            cells = [data.get(f"term/{m}/{mt}/shared/{g}/b8/f32") for g in grids]
            if any(cells):
                k = next(c for c in cells if c).get("K", 0)
                out.append(f"| {m} {mt} | {k:.0f} | " + " | ".join(f"{c['s'] * 1e3:.2f} ms" if c else "—" for c in cells) + " |")
    out += ["", "| mapping | grid | L | build (cold) | id bytes | int64 (L, L) bytes | ratio |", "|---|---|---|---|---|---|---|"]
    for name, e in sorted(data.items(), key=lambda kv: (kv[0].split("/")[2], kv[1].get("L", 0))):
        if name.startswith("bucket_ids/build/"):
            out.append(f"| {name.split('/')[2]} | {name.split('/')[3]} | {e['L']:.0f} | {e['s'] * 1e3:.2f} ms | "
                       f"{e['id_bytes'] / 1e6:.2f} MB | {e['int64_bytes'] / 1e6:.1f} MB | {e['int64_bytes'] / e['id_bytes']:.0f}× |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="*", type=Path, default=[ROOT / "build" / "bench.json"], help="Google Benchmark JSON file(s)")
    p.add_argument("--compare", type=Path, help="tools/compare_reference.py's JSON")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="output folder (default docs/img)")
    p.add_argument("--wall", action="store_true", help="plot wall time instead of CPU time")
    p.add_argument("--tables", action="store_true", help="also print the docs' Markdown tables")
    args = p.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_benchmarks: python3-matplotlib is missing; apt-get install python3-matplotlib")
    args.out.mkdir(parents=True, exist_ok=True)
    data = load(args.json, args.wall)
    if any(n.startswith("term/") for n in data):
        plot_terms(data, args.out, plt)
    plot_naive_ratio(data, args.out, plt)
    plot_attention(data, args.out, plt)
    plot_bucket_ids(data, args.out, plt)
    if args.compare:
        plot_reference(args.compare, args.out, plt)
    if args.tables:
        print(markdown_tables(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
