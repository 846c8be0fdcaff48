"""FSDP2: two processes (torch.distributed.fsdp.fully_shard on a CPU device mesh, gloo, started
here) train the digits model through rpe_torch.attention, every block and the root sharded, with
the same global batches as a one-process run, and end with the same parameters (float64, to
float tolerance), as test_ddp.py does for DistributedDataParallel."""
import pytest
import torch

from ddp_worker import fsdp_worker, two_processes_against_one

fsdp = pytest.importorskip("torch.distributed.fsdp")


def test_fully_shard_two_processes_equal_one(tmp_path):
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)")
    two_processes_against_one(fsdp_worker, tmp_path / "fsdp.pt")
