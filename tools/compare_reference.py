#!/usr/bin/python3
"""Side-by-side timing of rpe and the reference iRPE implementation (microsoft/Cream, PyTorch).

Runs the same shapes, in one run and with the same thread count, through

* the reference's own Python module (``irpe.py`` from a checkout of its ``iRPE`` folder, which the
  user passes; nothing of it is copied into rpe), on its pure-PyTorch path (``rpe_ops``, the
  optional C++/CUDA extension, is not used even when built), and
* rpe's ``rpe_bench --benchmark_filter='^ref/'`` (Google Benchmark JSON, medians of repetitions),

then prints a table of time ratios and writes it as JSON and Markdown.

Cases (DeiT-S shapes: B=8, H=6, L=197 = 14x14 + class token, D=64; Product ratio 1.9 → α=1.9,
β=3.8, γ=15.2, K=50; float32):

=========================  =============================================================
ctx_product_k_fwd          contextual key term forward, shared table
ctx_product_k_fwd_bwd      the same, then backward (grads of x and table)
ctx_product_v_fwd          contextual value term forward, shared table
bias_product_k_fwd         bias key term forward, one table per head
bucket_ids_56x56           bucket ids of a 56x56 grid + class token, cold (int64 for the reference)
bucket_ids_128x128         the same at 128x128 (reference: ~2 min and >10 GB; only with --with-128)
=========================  =============================================================

The reference's forwards are timed twice: with autograd on (as in a training step: the module's
table requires grad, and so does x) and under ``torch.no_grad()`` (inference). Targets are
checked against the first; both ratios are printed.

Timing: per case a warm-up, then ``--repetitions`` repetitions of a batch of calls (at least
``--min-time`` seconds each); the median of per-call times is reported. With one thread the clock is
CPU time (``time.process_time`` here, Google Benchmark's cpu_time for rpe), which a loaded machine
disturbs least; with more threads it is wall time on both sides.

Needs Debian's ``/usr/bin/python3`` with python3-torch, python3-numpy, python3-easydict and
libopenblas0-openmp (without OpenBLAS, Debian's torch runs on the slow reference BLAS and the
comparison is unfair to the reference). The script says what is missing.

Usage::

    scripts/bench.sh --benchmark_filter='^ref/'          # builds rpe_bench (Release)
    /usr/bin/python3 tools/compare_reference.py --reference /path/to/Cream/iRPE --threads 1
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Speed-up targets of issue 5 (reference time / rpe time), where one is set.
TARGETS = {
    "ctx_product_k_fwd": 5.0,
    "ctx_product_k_fwd_bwd": 3.0,
    "bias_product_k_fwd": 10.0,
    "bucket_ids_56x56": 10.0,
    "bucket_ids_128x128": 10.0,
}
CASES = list(TARGETS)[:2] + ["ctx_product_v_fwd"] + list(TARGETS)[2:]

B, H, SIDE, SKIP, D, RATIO = 8, 6, 14, 1, 64, 1.9


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", required=True, type=Path,
                   help="the reference's iRPE folder (or its DeiT-with-iRPE folder, or irpe.py)")
    p.add_argument("--bench", type=Path, default=None,
                   help="rpe_bench executable (default: the first found under build*/)")
    p.add_argument("--threads", type=int, default=1, help="threads on both sides (default 1)")
    p.add_argument("--repetitions", type=int, default=7, help="timed repetitions per case (default 7)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per repetition, at least (default 0.3)")
    p.add_argument("--with-128", action="store_true",
                   help="also build the reference's 128x128 ids (about 2 minutes, >10 GB of memory)")
    p.add_argument("--json", type=Path, default=ROOT / "build" / "compare_reference.json", help="JSON output")
    p.add_argument("--markdown", type=Path, default=ROOT / "build" / "compare_reference.md", help="Markdown output")
    p.add_argument("--rpe-json", type=Path, default=ROOT / "build" / "bench_ref.json",
                   help="where rpe_bench writes its Google Benchmark JSON")
    return p.parse_args()


def check_environment() -> None:
    """Exits with a message naming every missing package."""
    missing = []
    for module, package in (("torch", "python3-torch"), ("numpy", "python3-numpy"), ("easydict", "python3-easydict")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if not Path("/usr/share/doc/libopenblas0-openmp").exists():
        missing.append("libopenblas0-openmp")
    if missing:
        sys.exit("compare_reference: missing Debian packages: " + " ".join(missing) +
                 f"\n  install them with: apt-get install {' '.join(missing)}"
                 "\n  and run this script with /usr/bin/python3 (the interpreter those packages serve)")


def blas_in_use() -> str:
    """The BLAS library torch's process has mapped (after one matmul), e.g. libopenblasp-r0.3.21.so."""
    import torch
    torch.ones(64, 64) @ torch.ones(64, 64)
    libs = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rsplit("/", 1)[-1].strip()
            if "blas" in name.lower() or "mkl" in name.lower():
                libs.add(name)
    return ", ".join(sorted(libs)) or "unknown"


def load_reference(path: Path):
    """Imports the reference's irpe module from the user's checkout, forced onto its pure-PyTorch path."""
    path = path.resolve()
    candidates = [path, path / "irpe.py", path / "DeiT-with-iRPE" / "irpe.py"]
    irpe_py = next((c for c in candidates if c.is_file() and c.name == "irpe.py"), None)
    if irpe_py is None:
        sys.exit(f"compare_reference: no irpe.py under {path} (pass the reference's iRPE folder)")
    import warnings
    sys.path.insert(0, str(irpe_py.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "rpe_ops is not built": expected, the pure-PyTorch path is measured
        import irpe  # noqa: E402  (the reference module, from the user's checkout)
    built = irpe.RPEIndexFunction is not None
    irpe.RPEIndexFunction = None  # measure the pure-PyTorch path in every case
    return irpe, irpe_py, built


def time_call(fn, repetitions: int, min_time: float, cpu: bool) -> dict:
    """Median seconds per call of fn over repetitions of batches of at least min_time seconds
    (min_time 0: one call per repetition, no warm-up: for the slow cold builds)."""
    clock = time.process_time if cpu else time.perf_counter
    calls = 1
    if min_time > 0:
        fn()  # warm-up
        t0 = clock()
        fn()
        calls = max(1, int(min_time / max(clock() - t0, 1e-6)))
    per_call = []
    for _ in range(repetitions):
        t0 = clock()
        for _ in range(calls):
            fn()
        per_call.append((clock() - t0) / calls)
    return {"median_s": statistics.median(per_call), "min_s": min(per_call), "max_s": max(per_call), "all_s": per_call,
            "repetitions": repetitions, "calls_per_repetition": calls}


def reference_cases(irpe, args: argparse.Namespace, cpu: bool) -> dict:
    import torch
    torch.manual_seed(0)
    l = SKIP + SIDE * SIDE
    results = {}

    def module(mode: str, rpe_on: str, shared: bool):
        config = irpe.get_rpe_config(ratio=RATIO, method="product", mode=mode, shared_head=shared, skip=SKIP, rpe_on=rpe_on)
        mods = irpe.build_rpe(config, head_dim=D, num_heads=H)
        m = mods["qkv".index(rpe_on)]
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0.0, 0.1)
        return m, config

    rpe_k, config_k = module("ctx", "k", True)
    x = torch.randn(B, H, l, D)
    xg = x.clone().requires_grad_(True)  # q·s of a training step: requires grad
    grad_out = torch.randn(B, H, l, l)
    rpe_v, _ = module("ctx", "v", True)
    a = torch.rand(B, H, l, l)
    ag = a.clone().requires_grad_(True)
    rpe_b, _ = module("bias", "k", False)

    def forward(m, inp):
        return lambda: m(inp, height=SIDE, width=SIDE)

    # Forward as in training (autograd on: what a training step pays; the reference's figures in
    # SPEC.md were taken so), and under torch.no_grad() (inference).
    for case, m, train_in, infer_in in (("ctx_product_k_fwd", rpe_k, xg, x), ("ctx_product_v_fwd", rpe_v, ag, a),
                                        ("bias_product_k_fwd", rpe_b, x, x)):
        results[case] = time_call(forward(m, train_in), args.repetitions, args.min_time, cpu)
        with torch.no_grad():
            results[case]["no_grad"] = time_call(forward(m, infer_in), args.repetitions, args.min_time, cpu)

    def ctx_k_fwd_bwd():
        xg.grad = None
        rpe_k.lookup_table_weight.grad = None
        rpe_k(xg, height=SIDE, width=SIDE).backward(grad_out)
    results["ctx_product_k_fwd_bwd"] = time_call(ctx_k_fwd_bwd, args.repetitions, args.min_time, cpu)

    c = config_k.rpe_k  # the reference's own α, β, γ from the ratio

    def ids(side: int):
        def build():
            irpe.BUCKET_IDS_BUF.clear()  # cold: the reference keeps one large grid per config
            irpe.get_bucket_ids_2d(method=irpe.METHOD.PRODUCT, height=side, width=side, skip=SKIP,
                                   alpha=c.alpha, beta=c.beta, gamma=c.gamma, dtype=torch.long)
        return build
    results["bucket_ids_56x56"] = time_call(ids(56), 3, 0.0, cpu)
    if args.with_128:
        results["bucket_ids_128x128"] = time_call(ids(128), 1, 0.0, cpu)
    irpe.BUCKET_IDS_BUF.clear()
    return results


def find_bench() -> Path:
    found = sorted(p for p in ROOT.glob("build*/**/rpe_bench") if p.is_file() and os.access(p, os.X_OK))
    if not found:
        sys.exit("compare_reference: no rpe_bench under build*/; run scripts/bench.sh --benchmark_filter='^ref/' first")
    return found[0]


def run_rpe_bench(bench: Path, args: argparse.Namespace, out: Path) -> dict:
    """Runs rpe_bench's ref/ cases; returns (name → per-repetition seconds, the JSON's context)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [str(bench), "--benchmark_filter=^ref/", f"--benchmark_repetitions={args.repetitions}",
           f"--benchmark_min_time={args.min_time}", f"--benchmark_out={out}", "--benchmark_out_format=json"]
    print("compare_reference: running", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    reps = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        name = b["run_name"].split("/", 1)[1]
        reps.setdefault(name, []).append((b["cpu_time"] if args.threads == 1 else b["real_time"]) * scale[b["time_unit"]])
    return reps, data.get("context", {})


def pooled(*runs: dict) -> dict:
    """Per case: median over the repetitions of every run."""
    out = {}
    for name in set().union(*runs):
        times = [t for r in runs for t in r.get(name, [])]
        out[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repetitions": len(times)}
    return out


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def main() -> int:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch starts its thread pools
    check_environment()
    import torch
    torch.set_num_threads(args.threads)
    cpu = args.threads == 1
    irpe, irpe_py, ops_built = load_reference(args.reference)
    bench = args.bench or find_bench()

    # rpe runs before and after the reference and its repetitions are pooled, so a change of the
    # machine's load during the run weighs on both sides.
    args.rpe_json.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    first, bench_context = run_rpe_bench(bench, args, args.rpe_json.with_suffix(".1.json"))
    print("compare_reference: running the reference (pure PyTorch) ...", file=sys.stderr)
    theirs = reference_cases(irpe, args, cpu)
    second, _ = run_rpe_bench(bench, args, args.rpe_json.with_suffix(".2.json"))
    load_after = os.getloadavg()
    ours = pooled(first, second)

    rows = []
    for case in CASES:
        r, o = theirs.get(case), ours.get(case)
        row = {"case": case, "reference_ms": r["median_s"] * 1e3 if r else None,
               "rpe_ms": o["median_s"] * 1e3 if o else None, "target": TARGETS.get(case)}
        row["speedup"] = row["reference_ms"] / row["rpe_ms"] if r and o else None
        row["target_met"] = None if row["speedup"] is None or row["target"] is None else row["speedup"] >= row["target"]
        # best of the repetitions on both sides: a loaded machine only ever adds time
        row["speedup_best"] = r["min_s"] / o["min_s"] if r and o else None
        ng = r.get("no_grad") if r else None
        row["reference_no_grad_ms"] = ng["median_s"] * 1e3 if ng else None
        row["speedup_no_grad"] = row["reference_no_grad_ms"] / row["rpe_ms"] if ng and o else None
        rows.append(row)

    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(), "logical_cpus": os.cpu_count(), "threads": args.threads,
        "clock": "CPU time" if cpu else "wall time", "repetitions": args.repetitions,
        "load_average_before": load_before, "load_average_after": load_after,
        "torch": torch.__version__, "blas": blas_in_use(), "reference": str(irpe_py),
        "reference_path": "pure PyTorch" + (" (rpe_ops is built but was not used)" if ops_built else " (rpe_ops not built)"),
        "rpe_bench": str(bench), "rpe_bench_context": bench_context,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows, "reference": theirs, "rpe": ours}, indent=2) + "\n")

    def fmt(v, spec):
        return "—" if v is None else format(v, spec)
    lines = [
        f"{meta['date_utc']}, {meta['cpu']} ({meta['logical_cpus']} logical CPUs), {args.threads} thread(s), "
        f"medians of {meta['clock']} over {args.repetitions} repetitions; torch {meta['torch']} with {meta['blas']}; "
        f"reference: {meta['reference_path']}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
        "",
        "| case | reference | reference, no_grad | rpe | speed-up | vs no_grad | best of reps | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        met = "—" if row["target_met"] is None else ("yes" if row["target_met"] else "**no**")
        if row["target_met"] is not None and row["speedup_no_grad"] is not None:
            met += " / " + ("yes" if row["speedup_no_grad"] >= row["target"] else "**no**") + " (no_grad)"
        lines.append(f"| `ref/{row['case']}` | {fmt(row['reference_ms'], '.2f')} ms | {fmt(row['reference_no_grad_ms'], '.2f')} ms | "
                     f"{fmt(row['rpe_ms'], '.3f')} ms | {fmt(row['speedup'], '.1f')}× | {fmt(row['speedup_no_grad'], '.1f')}× | "
                     f"{fmt(row['speedup_best'], '.1f')}× | "
                     f"{fmt(row['target'], '.0f')}{'×' if row['target'] else ''} | {met} |")
    lines += ["", "reference: forward with autograd on (a training step; a module whose table requires grad, inputs "
              "that require grad); no_grad: the same under torch.no_grad() (inference). rpe has one forward for both. "
              "Times are medians; 'best of reps' is the ratio of the fastest repetitions. Bucket ids: cold on both sides (the reference's BUCKET_IDS_BUF cleared, rpe::build_bucket_ids), int64 "
              "ids for the reference, 1 byte per pair for rpe."]
    text = "\n".join(lines) + "\n"
    args.markdown.write_text(text)
    print(text)
    print(f"compare_reference: wrote {args.json} and {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
