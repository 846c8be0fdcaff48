"""DDP: two processes (torch.distributed, gloo, CPU, started here) train the digits model through
rpe_torch.attention with the same global batches as a one-process run and end with the same
parameters (float64, to float tolerance)."""
import torch

from ddp_worker import two_processes_against_one, worker


def test_two_processes_equal_one(tmp_path):
    _, model, start = two_processes_against_one(worker, tmp_path / "ddp.pt")
    assert not torch.equal(model.blocks[0].attn.rpe_k.lookup_table_weight, start["blocks.0.attn.rpe_k.lookup_table_weight"])
