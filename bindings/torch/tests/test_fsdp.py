"""FSDP2: two processes (torch.distributed.fsdp.fully_shard on a CPU device mesh, gloo, started
here) train the digits model through rpe_torch.attention, every block and the root sharded, with
the same global batches as a one-process run, and end with the same parameters (float64, to
float tolerance), as test_ddp.py does for DistributedDataParallel."""
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import rpe_torch
from ddp_worker import fsdp_worker, step_all
from digits_model import build
from test_ddp import free_port

fsdp = pytest.importorskip("torch.distributed.fsdp")


def test_fully_shard_two_processes_equal_one(tmp_path):
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)")
    steps, batch = 3, 32
    out = tmp_path / "fsdp.pt"
    mp.spawn(fsdp_worker, args=(2, free_port(), steps, batch, str(out)), nprocs=2, join=True)
    fsdp_state = torch.load(out)

    model, _ = build(rpe_torch, "a", fused=True)
    start = {k: v.clone().double() for k, v in model.state_dict().items()}
    model.double().train()
    losses = step_all(model, model.parameters(), steps, batch)
    assert losses[0] != losses[-1]
    assert fsdp_state.keys() == model.state_dict().keys()
    changed = 0
    for name, p in model.state_dict().items():
        np.testing.assert_allclose(fsdp_state[name].numpy(), p.numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
        changed += int(not torch.equal(p, start[name]))
    assert changed > len(start) // 2  # the run moved the parameters (rpe tables included)
