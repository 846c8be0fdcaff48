"""Workers of test_ddp.py and test_fsdp.py (and of examples/torch_train_digits.py's checks): train
the digits model A through rpe_torch's fused attention under DistributedDataParallel or FSDP2's
fully_shard (gloo, CPU), each rank on its contiguous share of the same global batches, and save
rank 0's final parameters."""
import os
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import rpe_torch
from digits_model import build, images


def batches(steps, batch, seed=0):
    """The global batches (index tensors) of a run: the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 450, (batch,), generator=g) for _ in range(steps)]


def step_all(model, params, steps, batch, rank=0, world=1):
    """AdamW steps (float64) on this rank's share of every global batch; returns the losses."""
    x, y = images()
    x = x.double()
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)
    losses = []
    for idx in batches(steps, batch):
        local = idx.chunk(world)[rank]
        loss = torch.nn.functional.cross_entropy(model(x[local]), y[local], label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def free_port():
    """A TCP port free on this machine now (the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process_group(rank, world, port):
    """Join the gloo process group of `world` CPU processes (one thread each) on localhost:port."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def two_processes_against_one(worker_fn, out, steps=3, batch=32):
    """Run worker_fn in two spawned processes (it saves rank 0's final state dict to `out`), then
    the same steps in this process; assert every parameter equal (float64, rtol 1e-8) and that the
    run moved most of them. Returns (the workers' state dict, this process's model, its start state)."""
    import numpy as np
    import torch.multiprocessing as mp

    mp.spawn(worker_fn, args=(2, free_port(), steps, batch, str(out)), nprocs=2, join=True)
    state = torch.load(out)
    model, _ = build(rpe_torch, "a", fused=True)
    start = {k: v.clone().double() for k, v in model.state_dict().items()}
    model.double().train()
    losses = step_all(model, model.parameters(), steps, batch)
    assert losses[0] != losses[-1]
    assert state.keys() == model.state_dict().keys()
    changed = 0
    for name, p in model.state_dict().items():
        np.testing.assert_allclose(state[name].numpy(), p.numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
        changed += int(not torch.equal(p, start[name]))
    assert changed > len(start) // 2  # the run moved the parameters (rpe tables included)
    return state, model, start


def worker(rank, world, port, steps, batch, out):
    start_process_group(rank, world, port)
    try:
        model, _ = build(rpe_torch, "a", fused=True)
        model.double().train()
        ddp = DistributedDataParallel(model)
        step_all(ddp, ddp.parameters(), steps, batch, rank, world)
        if rank == 0:
            torch.save(model.state_dict(), out)
        dist.barrier()  # both ranks done with every collective before either tears the group down
    finally:
        dist.destroy_process_group()


def fsdp_worker(rank, world, port, steps, batch, out):
    """As worker, under FSDP2 (torch.distributed.fsdp.fully_shard on a CPU device mesh, gloo):
    every block and the root sharded, AdamW on the sharded parameters; rank 0 saves the full
    (gathered) parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    start_process_group(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model, _ = build(rpe_torch, "a", fused=True)
        model.double().train()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        from torch.distributed.tensor import DTensor, Shard
        assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
        step_all(model, model.parameters(), steps, batch, rank, world)
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(state, out)
        dist.barrier()  # as in worker: no rank tears the group down while the other still communicates
    finally:
        dist.destroy_process_group()
