"""DDP: two processes (torch.distributed, gloo, CPU, started here) train the digits model through
rpe_torch.attention with the same global batches as a one-process run and end with the same
parameters (float64, to float tolerance)."""
import socket

import numpy as np
import torch
import torch.multiprocessing as mp

import rpe_torch
from ddp_worker import step_all, worker
from digits_model import build


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
    steps, batch = 3, 32
    out = tmp_path / "ddp.pt"
    mp.spawn(worker, args=(2, free_port(), steps, batch, str(out)), nprocs=2, join=True)
    ddp_state = torch.load(out)

    model, _ = build(rpe_torch, "a", fused=True)
    start = {k: v.clone().double() for k, v in model.state_dict().items()}
    model.double().train()
    losses = step_all(model, model.parameters(), steps, batch)
    assert losses[0] != losses[-1]
    changed = 0
    for name, p in model.state_dict().items():
        np.testing.assert_allclose(ddp_state[name].numpy(), p.numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
        changed += int(not torch.equal(p, start[name]))
    assert changed > len(start) // 2  # the run moved the parameters (rpe tables included)
    assert not torch.equal(model.blocks[0].attn.rpe_k.lookup_table_weight, start["blocks.0.attn.rpe_k.lookup_table_weight"])
