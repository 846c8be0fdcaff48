#!/usr/bin/python3
"""Side-by-side timing of rpe and the reference iRPE implementation (microsoft/Cream, PyTorch).

Runs the same work, in one run and with the same thread count, through

* the reference's own Python module (``irpe.py`` from a checkout of its ``iRPE`` folder, which the
  user passes; nothing of it is copied into rpe), on its pure-PyTorch path (``rpe_ops``, the
  optional C++/CUDA extension, is not used even when built), and
* rpe: ``rpe_bench`` (Google Benchmark JSON, per-repetition times) for the term, bucket-id and
  attention cases, and the ``vit_digits`` example executable for the digits job,

then prints a table of time ratios and writes it as JSON and Markdown.

Cases (DeiT-S shapes: B=8, H=6, L=197 = 14x14 + class token, D=64; Product ratio 1.9 → α=1.9,
β=3.8, γ=15.2, K=50; float32). The case name is rpe's benchmark name:

=================================  ====================================================================
ref/ctx_product_k_fwd              contextual key term forward, shared table
ref/ctx_product_k_fwd_bwd          the same, then backward (grads of x and table)
ref/ctx_product_v_fwd              contextual value term forward, shared table
ref/bias_product_k_fwd             bias key term forward, one table per head
ref/bucket_ids_56x56               bucket ids of a 56x56 grid + class token, cold (int64 for the reference)
ref/bucket_ids_128x128             the same at 128x128 (reference: ~2 min and >10 GB; only with --with-128)
attention/deit_s/{none,k,qkv}      the attention step of DeiT-S without RPE, with contextual iRPE on
                                   keys, on queries, keys and values (shared tables), forward:
                                   qs = q·s, qs·kᵀ + rpe_k(qs) + rpe_q(k·s)ᵀ, softmax, a·v + rpe_v(a)
attention_fwd_bwd/deit_s/...       the same, then backward (grads of q, k, v and every table)
attention_composed/deit_s/...      rpe's unfused composition of single terms against the same
                                   reference forward (no target; for comparison)
digits/a, digits/b                 the digits demo's job: a model's 450 test images, chunks of 64,
                                   best of 3 (examples/vit_digits against the same DeiT around the
                                   reference's build_rpe, tools/ref_digits_model.py), images/s
=================================  ====================================================================

For the reference's attention step the script calls the modules of ``irpe.build_rpe`` in the
order of its DeiT ``RPEAttention.forward`` (without the qkv and output projections, as rpe's
benchmark): the code around the modules is written here, not copied.

The reference's term and attention forwards are timed twice: with autograd on (as in a training
step: its tables are parameters and the inputs require grad) and under ``torch.no_grad()``
(inference). Targets are checked against the first; both ratios are printed. The digits job is
inference on both sides (``torch.no_grad()``).

Timing: per case a warm-up, then ``--repetitions`` repetitions of a batch of calls (at least
``--min-time`` seconds each); the median of per-call times is reported. With one thread the clock is
CPU time (``time.process_time`` here, Google Benchmark's cpu_time for rpe), which a loaded machine
disturbs least; with more threads it is wall time on both sides. rpe's benchmarks run before and
after the reference and their repetitions are pooled. The digits job is timed in wall time on both
sides (vit_digits prints the best of 3 passes over the 450 images): vit_digits runs before and
after the reference, the reference's model does two rounds of 3 passes; the best pass counts.

When rpe_bench has ``floor/…`` benchmarks (a lower bound for the attention step), every one is
reported, and the attention rows get an rpe / floor column (``floor/<kind>/deit_s[/<rpe>]``);
without them the column stays empty.

Needs Debian's ``/usr/bin/python3`` with python3-torch, python3-numpy, python3-easydict and
libopenblas0-openmp (without OpenBLAS, Debian's torch runs on the slow reference BLAS and the
comparison is unfair to the reference). The script says what is missing.

Usage::

    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DRPE_BUILD_BENCHMARKS=ON -DRPE_BUILD_EXAMPLES=ON
    cmake --build build --target rpe_bench vit_digits
    /usr/bin/python3 tools/compare_reference.py --reference /path/to/Cream/iRPE --threads 1 2

With several thread counts each runs in its own process (so torch and OpenBLAS start with that
count); the outputs then get a ``.t<N>`` suffix (``build/compare_reference.t1.json``, ...) and
the Markdown file holds every table.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import atomic_write  # tools/atomic_write.py: every output written to a temporary file, then renamed

ROOT = Path(__file__).resolve().parent.parent

B, H, SIDE, SKIP, D, RATIO = 8, 6, 14, 1, 64, 1.9
RPE_VARIANTS = ("none", "k", "qkv")

# Speed-up targets (reference time / rpe time; for the digits job rpe's images/s / the
# reference's). The attention targets hold for the forward and for forward + backward.
ATTENTION_TARGETS = {"none": 4.0, "k": 5.0, "qkv": 12.0}
TARGETS = {
    "ref/ctx_product_k_fwd": 5.0,
    "ref/ctx_product_k_fwd_bwd": 4.0,
    "ref/ctx_product_v_fwd": 20.0,
    "ref/bias_product_k_fwd": 10.0,
    "ref/bucket_ids_56x56": 10.0,
    "ref/bucket_ids_128x128": 10.0,
    **{f"attention/deit_s/{v}": t for v, t in ATTENTION_TARGETS.items()},
    **{f"attention_fwd_bwd/deit_s/{v}": t for v, t in ATTENTION_TARGETS.items()},
    "digits/a": 3.0,
    "digits/b": 3.0,
}
CASES = (["ref/ctx_product_k_fwd", "ref/ctx_product_k_fwd_bwd", "ref/ctx_product_v_fwd", "ref/bias_product_k_fwd",
          "ref/bucket_ids_56x56", "ref/bucket_ids_128x128"]
         + [f"{kind}/deit_s/{v}" for kind in ("attention", "attention_fwd_bwd", "attention_composed") for v in RPE_VARIANTS]
         + ["digits/a", "digits/b"])
# rpe_bench cases this script runs: the ref/ terms, the DeiT-S attention benchmarks, every floor.
BENCH_FILTER = "^(ref/|floor/|attention[a-z_]*/deit_s/)"
# Google Benchmark's run-option suffixes of a run_name, dropped to get the registered name.
BENCH_SUFFIX = re.compile(r"(/(real_time|process_time|manual_time|iterations:\d+|min_time:[0-9.]+s?|repeats:\d+|threads:\d+))+$")
DIGITS_LINE = re.compile(r"^model (\w): (\d+) images/s \(float, (\d+) images in ([0-9.]+) ms, best of (\d+), chunks of (\d+)\)")
DIGITS_DIFF = re.compile(r"^model (\w): argmax agreement (\d+)/(\d+), max \|logits - \S+\| = (\S+)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", required=True, type=Path,
                   help="the reference's iRPE folder (or its DeiT-with-iRPE folder, or irpe.py)")
    p.add_argument("--bench", type=Path, default=None,
                   help="rpe_bench executable (default: the first found under build*/)")
    p.add_argument("--digits-exe", type=Path, default=None,
                   help="rpe's vit_digits executable (default: the first found under build*/)")
    p.add_argument("--digits-data", type=Path, default=ROOT / "examples" / "data" / "digits",
                   help="the digits models and test images (default examples/data/digits)")
    p.add_argument("--no-digits", action="store_true", help="leave out the digits job")
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="threads on both sides (default 1); several values: one run per value, e.g. --threads 1 2")
    p.add_argument("--repetitions", type=int, default=7, help="timed repetitions per case (default 7)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per repetition, at least (default 0.3)")
    p.add_argument("--with-128", action="store_true",
                   help="also build the reference's 128x128 ids (about 2 minutes, >10 GB of memory)")
    p.add_argument("--json", type=Path, default=ROOT / "build" / "compare_reference.json", help="JSON output")
    p.add_argument("--markdown", type=Path, default=ROOT / "build" / "compare_reference.md", help="Markdown output")
    p.add_argument("--rpe-json", type=Path, default=ROOT / "build" / "bench_ref.json",
                   help="where rpe_bench writes its Google Benchmark JSON (.1.json, .2.json)")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.threads):
        p.error("--threads: every value must be >= 1")
    if args.repetitions < 1:
        p.error("--repetitions must be >= 1")
    return args


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


def git_blob_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_reference(path: Path):
    """Imports the reference's irpe module from the user's checkout, forced onto its pure-PyTorch path."""
    path = path.resolve()
    candidates = [path, path / "irpe.py", path / "DeiT-with-iRPE" / "irpe.py"]
    irpe_py = next((c for c in candidates if c.is_file() and c.name == "irpe.py"), None)
    if irpe_py is None:
        sys.exit(f"compare_reference: no irpe.py under {path} (pass the reference's iRPE folder, "
                 "e.g. a checkout of https://github.com/microsoft/Cream's iRPE/)")
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


def randomize_tables(m) -> None:
    import torch
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)


def reference_terms(irpe, args: argparse.Namespace, cpu: bool) -> dict:
    """The ref/ cases: single terms and bucket-id builds."""
    import torch
    torch.manual_seed(0)
    l = SKIP + SIDE * SIDE
    results = {}

    def module(mode: str, rpe_on: str, shared: bool):
        config = irpe.get_rpe_config(ratio=RATIO, method="product", mode=mode, shared_head=shared, skip=SKIP, rpe_on=rpe_on)
        mods = irpe.build_rpe(config, head_dim=D, num_heads=H)
        m = mods["qkv".index(rpe_on)]
        randomize_tables(m)
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

    # Forward as in training (autograd on: what a training step pays), and under torch.no_grad() (inference).
    for case, m, train_in, infer_in in (("ref/ctx_product_k_fwd", rpe_k, xg, x), ("ref/ctx_product_v_fwd", rpe_v, ag, a),
                                        ("ref/bias_product_k_fwd", rpe_b, x, x)):
        results[case] = time_call(forward(m, train_in), args.repetitions, args.min_time, cpu)
        with torch.no_grad():
            results[case]["no_grad"] = time_call(forward(m, infer_in), args.repetitions, args.min_time, cpu)

    def ctx_k_fwd_bwd():
        xg.grad = None
        rpe_k.lookup_table_weight.grad = None
        rpe_k(xg, height=SIDE, width=SIDE).backward(grad_out)
    results["ref/ctx_product_k_fwd_bwd"] = time_call(ctx_k_fwd_bwd, args.repetitions, args.min_time, cpu)

    c = config_k.rpe_k  # the reference's own α, β, γ from the ratio

    def ids(side: int):
        def build():
            irpe.BUCKET_IDS_BUF.clear()  # cold: the reference keeps one large grid per config
            irpe.get_bucket_ids_2d(method=irpe.METHOD.PRODUCT, height=side, width=side, skip=SKIP,
                                   alpha=c.alpha, beta=c.beta, gamma=c.gamma, dtype=torch.long)
        return build
    results["ref/bucket_ids_56x56"] = time_call(ids(56), 3, 0.0, cpu)
    if args.with_128:
        results["ref/bucket_ids_128x128"] = time_call(ids(128), 1, 0.0, cpu)
    irpe.BUCKET_IDS_BUF.clear()
    return results


def reference_attention(irpe, args: argparse.Namespace, cpu: bool) -> dict:
    """The attention step of the reference's DeiT (RPEAttention.forward between the qkv and the
    output projections) around its build_rpe modules: attention/deit_s/* and attention_fwd_bwd/deit_s/*."""
    import torch
    torch.manual_seed(1)
    l = SKIP + SIDE * SIDE
    scale = D ** -0.5
    config = irpe.get_rpe_config(ratio=RATIO, method="product", mode="ctx", shared_head=True, skip=SKIP, rpe_on="qkv")
    rpe_q, rpe_k, rpe_v = irpe.build_rpe(config, head_dim=D, num_heads=H)
    for m in (rpe_q, rpe_k, rpe_v):
        randomize_tables(m)
    modules = {"none": (None, None, None), "k": (None, rpe_k, None), "qkv": (rpe_q, rpe_k, rpe_v)}
    q, k, v = (torch.randn(B, H, l, D) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    grad_out = torch.randn(B, H, l, D)

    def step(q, k, v, mq, mk, mv):
        qs = q * scale  # the reference scales q in place (q *= scale); q is a leaf here
        attn = qs @ k.transpose(-2, -1)
        if mk is not None:
            attn += mk(qs)
        if mq is not None:
            attn += mq(k * scale).transpose(2, 3)
        attn = attn.softmax(dim=-1)
        out = attn @ v
        if mv is not None:
            out += mv(attn)
        return out

    results = {}
    for variant, mods in modules.items():
        fwd = f"attention/deit_s/{variant}"
        results[fwd] = time_call(lambda: step(qg, kg, vg, *mods), args.repetitions, args.min_time, cpu)
        with torch.no_grad():
            results[fwd]["no_grad"] = time_call(lambda: step(q, k, v, *mods), args.repetitions, args.min_time, cpu)
        params = [p for m in mods if m is not None for p in m.parameters()]

        def fwd_bwd(mods=mods, params=params):
            for t in (qg, kg, vg, *params):
                t.grad = None
            step(qg, kg, vg, *mods).backward(grad_out)
        results[f"attention_fwd_bwd/deit_s/{variant}"] = time_call(fwd_bwd, args.repetitions, args.min_time, cpu)
    # rpe's unfused composition is compared with the same reference forward
    for variant in RPE_VARIANTS:
        results[f"attention_composed/deit_s/{variant}"] = results[f"attention/deit_s/{variant}"]
    return results


def reference_digits(irpe, data: Path, rounds: int = 2, passes: int = 3, chunk: int = 64) -> dict:
    """The digits job through the reference: per model, the best of rounds × passes over the test
    images in chunks of `chunk` (wall time, torch.no_grad()), and the max |logits - logits_X.npy|."""
    import numpy as np
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ref_digits_model  # noqa: E402  (tools/ref_digits_model.py: DeiT around irpe.build_rpe)
    x = torch.from_numpy(np.load(data / "test_images.npy"))
    results = {}
    for name in ("a", "b"):
        model, meta = ref_digits_model.load_model(irpe, data / f"deit_irpe_digits_{name}.safetensors")
        best = float("inf")
        with torch.no_grad():
            model(x[:chunk])  # warm-up (bucket ids built and cached by the reference)
            for _ in range(rounds * passes):
                t0 = time.perf_counter()
                out = torch.cat([model(x[i:i + chunk]) for i in range(0, len(x), chunk)])
                best = min(best, time.perf_counter() - t0)
        ref = np.load(data / f"logits_{name}.npy")
        diff = float(np.abs(out.numpy() - ref).max())
        if not diff <= 1e-4:  # vit_digits' tolerance; the shipped logits came from the reference
            print(f"compare_reference: warning: the reference's model {name} is {diff:.2e} off logits_{name}.npy "
                  "(tolerance 1e-4): tools/ref_digits_model.py or the irpe.py checkout differs from what made the "
                  "shipped models", file=sys.stderr)
        results[f"digits/{name}"] = {
            "images": len(x), "best_s": best, "images_per_s": len(x) / best, "passes": rounds * passes, "chunk": chunk,
            "max_abs_diff_vs_logits_npy": diff,
            "argmax_agree": int((out.numpy().argmax(1) == ref.argmax(1)).sum()),
            "trained_with_irpe_py_blob": meta.get("irpe_py_git_blob_sha1"),
        }
    return results


def find_executable(name: str, hint: str) -> Path:
    found = sorted(p for p in ROOT.glob(f"build*/**/{name}") if p.is_file() and os.access(p, os.X_OK))
    if not found:
        sys.exit(f"compare_reference: no {name} under {ROOT}/build*/; {hint}")
    return found[0]


def run_rpe_bench(bench: Path, args: argparse.Namespace, threads: int, out: Path) -> tuple[dict, dict]:
    """Runs rpe_bench's ref/, floor/ and DeiT-S attention cases; returns (name → per-repetition
    seconds, the JSON's context)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write.replacing(out) as tmp:  # a failed or interrupted run leaves no partial JSON at `out`
        cmd = [str(bench), f"--benchmark_filter={BENCH_FILTER}", f"--benchmark_repetitions={args.repetitions}",
               f"--benchmark_min_time={args.min_time}", f"--benchmark_out={tmp}", "--benchmark_out_format=json"]
        print("compare_reference: running", " ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"compare_reference: {bench} exited with status {proc.returncode}:\n{proc.stderr[-2000:]}")
        json.loads(tmp.read_text())  # complete JSON, or an exception (and no file at `out`)
    data = json.loads(out.read_text())
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    reps = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration" or b.get("error_occurred"):
            continue
        name = BENCH_SUFFIX.sub("", b["run_name"])  # e.g. UseRealTime() cases carry /real_time
        reps.setdefault(name, []).append((b["cpu_time"] if threads == 1 else b["real_time"]) * scale[b["time_unit"]])
    return reps, data.get("context", {})


def run_vit_digits(exe: Path, data: Path, threads: int) -> dict:
    """Runs rpe's digits demo; returns per model its best pass (images/s) and its checks."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    print(f"compare_reference: running {exe} {data}", file=sys.stderr)
    proc = subprocess.run([str(exe), str(data)], env=env, capture_output=True, text=True)
    if proc.returncode == 2 or not any(DIGITS_LINE.match(line) for line in proc.stdout.splitlines()):
        sys.exit(f"compare_reference: {exe} failed (status {proc.returncode}) or printed no 'images/s' line:\n"
                 f"{(proc.stdout + proc.stderr)[-2000:]}")
    out = {}
    for line in proc.stdout.splitlines():
        if m := DIGITS_LINE.match(line):
            n, ms = int(m.group(3)), float(m.group(4))
            out[f"digits/{m.group(1)}"] = {"images": n, "best_s": ms * 1e-3, "images_per_s": n / (ms * 1e-3),
                                           "passes": int(m.group(5)), "chunk": int(m.group(6))}
    for line in proc.stdout.splitlines():
        if (m := DIGITS_DIFF.match(line)) and f"digits/{m.group(1)}" in out:
            out[f"digits/{m.group(1)}"].update(argmax_agree=int(m.group(2)), max_abs_diff_vs_logits_npy=float(m.group(4)))
    for entry in out.values():
        entry["checks_passed"] = proc.returncode == 0
    if proc.returncode != 0:
        print(f"compare_reference: warning: {exe} reported a failed check (status {proc.returncode})", file=sys.stderr)
    return out


def pooled(*runs: dict) -> dict:
    """Per case: median over the repetitions of every run."""
    out = {}
    for name in set().union(*runs):
        times = [t for r in runs for t in r.get(name, [])]
        out[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repetitions": len(times)}
    return out


def best_digits(*runs: dict) -> dict:
    out = {}
    for run in runs:
        for name, e in run.items():
            if name not in out or e["best_s"] < out[name]["best_s"]:
                out[name] = dict(e, runs=sum(name in r for r in runs))
    return out


def floor_of(case: str, ours: dict) -> str | None:
    """rpe_bench's floor benchmark for an attention case, if it exists: floor/<kind>/deit_s/<rpe>, else floor/<kind>/deit_s."""
    if not case.startswith("attention") or case.count("/") != 2:
        return None
    kind, shape, variant = case.split("/")
    kinds = [kind] + (["attention"] if kind == "attention_composed" else [])  # composed: a forward
    for name in (f"floor/{k}/{shape}{tail}" for k in kinds for tail in (f"/{variant}", "")):
        if name in ours:
            return name
    return None


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def suffixed(path: Path, threads: int) -> Path:
    return path.with_name(f"{path.stem}.t{threads}{path.suffix}")


def run_each_thread_count(args: argparse.Namespace) -> int:
    """Several thread counts: one child process per count (torch and OpenBLAS start with it)."""
    texts, status = [], 0
    for n in args.threads:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--reference", str(args.reference), "--threads", str(n),
               "--repetitions", str(args.repetitions), "--min-time", str(args.min_time),
               "--digits-data", str(args.digits_data), "--json", str(suffixed(args.json, n)),
               "--markdown", str(suffixed(args.markdown, n)), "--rpe-json", str(suffixed(args.rpe_json, n))]
        cmd += ["--bench", str(args.bench)] if args.bench else []
        cmd += ["--digits-exe", str(args.digits_exe)] if args.digits_exe else []
        cmd += ["--no-digits"] if args.no_digits else []
        cmd += ["--with-128"] if args.with_128 else []
        print(f"compare_reference: --threads {n} ...", file=sys.stderr)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if proc.returncode != 0:
            status = proc.returncode
            texts.append(f"## {n} thread(s)\n\nfailed (exit status {proc.returncode})\n")
            continue
        texts.append(f"## {n} thread(s)\n\n" + suffixed(args.markdown, n).read_text())
    text = "\n".join(texts)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    atomic_write.write_text(args.markdown, text)
    print(text)
    print(f"compare_reference: wrote {args.markdown} and "
          + ", ".join(str(suffixed(args.json, n)) for n in args.threads), file=sys.stderr)
    return status


def fmt(v, spec: str, unit: str = "") -> str:
    return "—" if v is None else format(v, spec) + unit


def main() -> int:
    args = parse_args()
    if len(args.threads) > 1:
        return run_each_thread_count(args)
    threads = args.threads[0]
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch starts its thread pools
    check_environment()
    import torch
    torch.set_num_threads(threads)
    cpu = threads == 1
    irpe, irpe_py, ops_built = load_reference(args.reference)
    bench = args.bench or find_executable("rpe_bench", "build it: cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "
                                          "-DRPE_BUILD_BENCHMARKS=ON && cmake --build build --target rpe_bench")
    digits_exe = None
    if not args.no_digits:
        digits_exe = args.digits_exe or find_executable(
            "vit_digits", "build it: cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DRPE_BUILD_EXAMPLES=ON && "
            "cmake --build build --target vit_digits (or pass --no-digits)")
        missing = [f for f in ("test_images.npy", "logits_a.npy", "logits_b.npy", "deit_irpe_digits_a.safetensors",
                               "deit_irpe_digits_b.safetensors") if not (args.digits_data / f).is_file()]
        if missing:
            sys.exit(f"compare_reference: {args.digits_data} lacks {', '.join(missing)} (--digits-data)")
    for exe in (bench, digits_exe):
        if exe is not None and not (exe.is_file() and os.access(exe, os.X_OK)):
            sys.exit(f"compare_reference: {exe} is not an executable file")

    # rpe runs before and after the reference and its repetitions are pooled, so a change of the
    # machine's load during the run weighs on both sides.
    started = time.perf_counter()
    args.rpe_json.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    first, bench_context = run_rpe_bench(bench, args, threads, args.rpe_json.with_suffix(".1.json"))
    digits_first = run_vit_digits(digits_exe, args.digits_data, threads) if digits_exe else {}
    print("compare_reference: running the reference (pure PyTorch): terms ...", file=sys.stderr)
    theirs = reference_terms(irpe, args, cpu)
    print("compare_reference: ... attention step ...", file=sys.stderr)
    theirs.update(reference_attention(irpe, args, cpu))
    theirs_digits = {}
    if digits_exe:
        print("compare_reference: ... digits job ...", file=sys.stderr)
        theirs_digits = reference_digits(irpe, args.digits_data)
    second, _ = run_rpe_bench(bench, args, threads, args.rpe_json.with_suffix(".2.json"))
    digits_second = run_vit_digits(digits_exe, args.digits_data, threads) if digits_exe else {}
    load_after = os.getloadavg()
    ours = pooled(first, second)
    ours_digits = best_digits(digits_first, digits_second)

    rows = []
    for case in CASES:
        row = {"case": case, "target": TARGETS.get(case)}
        if case.startswith("digits/"):
            r, o = theirs_digits.get(case), ours_digits.get(case)
            row.update(unit="images/s", reference_ms=r["best_s"] * 1e3 if r else None, rpe_ms=o["best_s"] * 1e3 if o else None,
                       reference_images_per_s=r["images_per_s"] if r else None, rpe_images_per_s=o["images_per_s"] if o else None)
            row["speedup"] = o["images_per_s"] / r["images_per_s"] if r and o else None
            row["speedup_best"] = row["speedup"]  # both sides: best pass
            row["reference_no_grad_ms"] = row["speedup_no_grad"] = None
        else:
            r, o = theirs.get(case), ours.get(case)
            row.update(unit="ms", reference_ms=r["median_s"] * 1e3 if r else None, rpe_ms=o["median_s"] * 1e3 if o else None)
            row["speedup"] = row["reference_ms"] / row["rpe_ms"] if r and o else None
            # best of the repetitions on both sides: a loaded machine only ever adds time
            row["speedup_best"] = r["min_s"] / o["min_s"] if r and o else None
            ng = r.get("no_grad") if r else None
            row["reference_no_grad_ms"] = ng["median_s"] * 1e3 if ng else None
            row["speedup_no_grad"] = row["reference_no_grad_ms"] / row["rpe_ms"] if ng and o else None
        row["target_met"] = None if row["speedup"] is None or row["target"] is None else row["speedup"] >= row["target"]
        fl = floor_of(case, ours)
        row["floor"] = fl
        row["floor_ms"] = ours[fl]["median_s"] * 1e3 if fl else None
        row["rpe_over_floor"] = row["rpe_ms"] / row["floor_ms"] if fl and row["rpe_ms"] else None
        rows.append(row)
    floors = {name: e["median_s"] * 1e3 for name, e in sorted(ours.items()) if name.startswith("floor/")}

    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(), "logical_cpus": os.cpu_count(), "threads": threads,
        "clock": "CPU time" if cpu else "wall time", "repetitions": args.repetitions,
        "load_average_before": load_before, "load_average_after": load_after,
        "duration_s": round(time.perf_counter() - started, 1),
        "torch": torch.__version__, "blas": blas_in_use(), "reference": str(irpe_py),
        "reference_irpe_py_blob": git_blob_sha1(irpe_py),
        "reference_path": "pure PyTorch" + (" (rpe_ops is built but was not used)" if ops_built else " (rpe_ops not built)"),
        "rpe_bench": str(bench), "rpe_bench_filter": BENCH_FILTER, "rpe_bench_context": bench_context,
        "vit_digits": str(digits_exe) if digits_exe else None, "digits_data": str(args.digits_data) if digits_exe else None,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    atomic_write.write_text(args.json, json.dumps({"meta": meta, "rows": rows, "reference": theirs, "rpe": ours,
                                     "reference_digits": theirs_digits, "rpe_digits": ours_digits,
                                     "rpe_floor_ms": floors}, indent=2) + "\n")

    lines = [
        f"{meta['date_utc']}, {meta['cpu']} ({meta['logical_cpus']} logical CPUs), {threads} thread(s), "
        f"medians of {meta['clock']} over {args.repetitions} repetitions ({2 * args.repetitions} for rpe, two runs pooled); "
        f"torch {meta['torch']} with {meta['blas']}; reference: {meta['reference_path']}; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {meta['duration_s']:.0f} s.",
        "",
        "| case | reference | reference, no_grad | rpe | speed-up | vs no_grad | best of reps | target | met | rpe / floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        met = "—" if row["target_met"] is None else ("yes" if row["target_met"] else "**no**")
        if row["target_met"] is not None and row["speedup_no_grad"] is not None:
            met += " / " + ("yes" if row["speedup_no_grad"] >= row["target"] else "**no**") + " (no_grad)"
        if row["unit"] == "images/s":
            ref_cell, rpe_cell = fmt(row["reference_images_per_s"], ".0f", " images/s"), fmt(row["rpe_images_per_s"], ".0f", " images/s")
        else:
            ref_cell, rpe_cell = fmt(row["reference_ms"], ".2f", " ms"), fmt(row["rpe_ms"], ".3f", " ms")
        lines.append(f"| `{row['case']}` | {ref_cell} | {fmt(row['reference_no_grad_ms'], '.2f', ' ms')} | {rpe_cell} | "
                     f"{fmt(row['speedup'], '.1f', '×')} | {fmt(row['speedup_no_grad'], '.1f', '×')} | "
                     f"{fmt(row['speedup_best'], '.1f', '×')} | {fmt(row['target'], '.0f', '×')} | {met} | "
                     f"{fmt(row['rpe_over_floor'], '.2f', '×')} |")
    lines += ["", "reference: forward with autograd on (a training step; modules whose tables require grad, inputs "
              "that require grad); no_grad: the same under torch.no_grad() (inference). rpe has one forward for both. "
              "Times are medians; 'best of reps' is the ratio of the fastest repetitions. Bucket ids: cold on both sides "
              "(the reference's BUCKET_IDS_BUF cleared, rpe::build_bucket_ids), int64 ids for the reference, 1 byte per "
              "pair for rpe. Attention: the step between the qkv and output projections (rpe::attention_forward / "
              "_backward; the reference's build_rpe modules in the order of its RPEAttention.forward); "
              "attention_composed: rpe's unfused composition against the same reference forward."]
    if theirs_digits:
        parts = []
        for name in ("a", "b"):
            r, o = theirs_digits.get(f"digits/{name}"), ours_digits.get(f"digits/{name}")
            if r and o:
                parts.append(f"model {name}: reference {r['best_s'] * 1e3:.1f} ms, rpe {o['best_s'] * 1e3:.1f} ms for "
                             f"{r['images']} images; max |logits - logits_{name}.npy| reference {r['max_abs_diff_vs_logits_npy']:.1e}, "
                             f"rpe {o.get('max_abs_diff_vs_logits_npy', float('nan')):.1e}")
        lines += ["", "Digits: wall time of the best pass over the test images, chunks of 64 (rpe: examples/vit_digits, "
                  "best of 3 in each of two runs; reference: tools/ref_digits_model.py around irpe.build_rpe, "
                  "torch.no_grad(), best of 2 × 3 passes); " + "; ".join(parts) + "."]
    if floors:
        lines += ["", "rpe floors (rpe_bench `floor/…`, medians): " +
                  ", ".join(f"`{name}` {ms:.3f} ms" for name, ms in floors.items()) + "."]
    text = "\n".join(lines) + "\n"
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    atomic_write.write_text(args.markdown, text)
    print(text)
    print(f"compare_reference: wrote {args.json} and {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
