#!/usr/bin/env python3
"""Train the digits DeiT with iRPE (model A's configuration: contextual Product on q, k, v, shared
tables, class token) from scratch through rpe_torch, in one process or with DDP, and compare its
steps/s with the same model on plain PyTorch modules (bindings/torch/tests/pure_irpe.py) and, with
--reference, on the reference's own irpe.py.

Data: the 450 shipped digits (examples/data/digits/test_images.npy), first 350 for training, last
100 held out (the repository ships no other images). Prints one line per implementation:

    torch_train_digits: impl fused procs 1 threads 1 batch 64 steps 60 steps/s 3.36 loss 2.2689 accuracy 0.0500

(the implementations are trained one step each in turn, from the same initial weights and batches,
so their losses agree and their steps/s see the same machine load; accuracy needs a few hundred
steps to rise above chance).

Run (after building the operators, see docs/torch.md):

    PYTHONPATH=bindings/torch /usr/bin/python3 examples/torch_train_digits.py [--impl fused,modules,pure]
        [--steps 60] [--batch 64] [--threads 2] [--ddp 2] [--reference /path/to/Cream/iRPE/DeiT-with-iRPE]
"""
import argparse
import importlib.util
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bindings" / "torch"), str(ROOT / "bindings" / "torch" / "tests"), str(ROOT / "tools")]

import rpe_torch  # noqa: E402
import pure_irpe  # noqa: E402
import ref_digits_model as ref  # noqa: E402
from digits_model import FusedAttention, ModuleAttention  # noqa: E402

DIGITS = ROOT / "examples" / "data" / "digits"


def package(impl, reference):
    if impl in ("fused", "modules"):
        return rpe_torch
    if impl == "pure":
        return pure_irpe
    if impl == "reference":
        spec = importlib.util.spec_from_file_location("irpe", Path(reference) / "irpe.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    raise SystemExit(f"torch_train_digits: --impl {impl!r}; expected fused, modules, pure or reference")


def make_model(impl, reference, seed):
    """Model A's architecture with DeiT init (trunc normal 0.02, zero tables), same for every impl."""
    _, meta = ref.read_safetensors(DIGITS / "deit_irpe_digits_a.safetensors")
    torch.manual_seed(seed)
    model = ref.DigitsDeiT(package(impl, reference), meta)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lookup_table" in name or name.endswith("bias") or "norm" in name:
                p.zero_() if "norm" not in name or name.endswith("bias") else p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g).clamp_(-2, 2) * 0.02)
    for blk in model.blocks:
        blk.attn.__class__ = FusedAttention if impl == "fused" else ModuleAttention
    return model


def data():
    x = torch.from_numpy(np.load(DIGITS / "test_images.npy"))
    y = torch.from_numpy(np.load(DIGITS / "test_labels.npy"))
    return (x[:350], y[:350]), (x[350:], y[350:])


class Trainer:
    """One implementation's model, optimizer and batch stream; step() runs one timed step."""

    def __init__(self, impl, args, rank=0, world=1):
        self.model = make_model(impl, args.reference, args.seed)
        self.net = self.model if world == 1 else torch.nn.parallel.DistributedDataParallel(self.model)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=3e-3, weight_decay=0.05)
        self.g = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every impl
        self.args, self.rank, self.world = args, rank, world
        (self.x, self.y), (self.xt, self.yt) = data()
        self.seconds, self.loss = 0.0, float("nan")
        self.model.train()

    def step(self, timed=True):
        idx = torch.randint(0, self.x.shape[0], (self.args.batch,), generator=self.g).chunk(self.world)[self.rank]
        # random shift by up to one pixel (the digits training's augmentation)
        dy, dx = (int(v) for v in torch.randint(-1, 2, (2,), generator=self.g))
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(self.net(torch.roll(self.x[idx], (dy, dx), (2, 3))), self.y[idx],
                                                 label_smoothing=0.1)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        if timed:
            self.seconds += time.perf_counter() - start
        self.loss = loss.item()

    def result(self):
        """(steps/s over the timed steps, last loss, held-out accuracy)."""
        self.model.eval()
        with torch.no_grad():
            accuracy = (self.model(self.xt).argmax(1) == self.yt).double().mean().item()
        return self.args.steps / self.seconds, self.loss, accuracy


def run(impls, args, rank=0, world=1):
    """Trains every impl, one step of each in turn (so a noisy machine's slow spells hit all
    alike); the first step (allocations, id caches) is not timed. Returns {impl: result}."""
    torch.set_num_threads(args.threads)
    trainers = {impl: Trainer(impl, args, rank, world) for impl in impls}
    for step in range(args.steps + 1):
        for t in trainers.values():
            t.step(timed=step > 0)
    return {impl: t.result() for impl, t in trainers.items()}


def ddp_worker(rank, world, port, impls, args, out):
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = run(impls, args, rank, world)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="fused,modules,pure", help="comma list of fused, modules, pure, reference")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--threads", type=int, default=1, help="threads per process")
    p.add_argument("--ddp", type=int, default=1, help="processes (DistributedDataParallel, gloo) when > 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", default=None, help="folder of the reference's irpe.py (for --impl reference)")
    args = p.parse_args()
    if args.steps < 1 or args.batch < args.ddp or args.threads < 1 or args.ddp < 1:
        raise SystemExit("torch_train_digits: expected --steps >= 1, --threads >= 1, 1 <= --ddp <= --batch")
    impls = args.impl.split(",")
    for impl in impls:
        if impl not in ("fused", "modules", "pure", "reference"):
            raise SystemExit(f"torch_train_digits: --impl {impl!r}; expected fused, modules, pure or reference")
        if impl == "reference" and not args.reference:
            raise SystemExit("torch_train_digits: --impl reference needs --reference DIR (the folder of irpe.py)")
    if args.ddp > 1:
        import tempfile
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.pt")
            mp.spawn(ddp_worker, args=(args.ddp, port, impls, args, out), nprocs=args.ddp, join=True)
            results = torch.load(out)
    else:
        results = run(impls, args)
    for impl, (rate, loss, accuracy) in results.items():
        print(f"torch_train_digits: impl {impl} procs {args.ddp} threads {args.threads} batch {args.batch} "
              f"steps {args.steps} steps/s {rate:.2f} loss {loss:.4f} accuracy {accuracy:.4f}", flush=True)
    for other in ("pure", "reference", "modules"):
        if "fused" in results and other in results:
            print(f"torch_train_digits: fused / {other} steps/s = {results['fused'][0] / results[other][0]:.2f}x")


if __name__ == "__main__":
    main()
