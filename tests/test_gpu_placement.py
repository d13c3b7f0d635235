"""Where each process of a run is placed: one GPU each, and a clear line when a node has too few (issue 31).

On a one-GPU workstation `torchrun --nproc_per_node=2 train.py parallel.layer=2` (what `make train` did) used to
end in a traceback from torch.cuda.set_device ("invalid device ordinal"). The device count is faked here (this
is a CPU machine): the check that runs before any process group exists must name both counts and the ways out.
"""

import pytest
import torch

from pcdist.errors import ConfigError
from pcdist.service import checks, device
from pcdist.service.config import make_config


@pytest.mark.parametrize("local_rank, local_world, gpus", [(0, 1, 1), (1, 2, 2), (3, 4, 8)])
def test_each_process_gets_the_gpu_of_its_local_rank(local_rank, local_world, gpus):
    assert device.gpu_of_rank(local_rank, local_world, gpus) == torch.device(f"cuda:{local_rank}")


@pytest.mark.parametrize("local_rank", [0, 1])
def test_more_processes_than_gpus_is_one_line_naming_both_counts(local_rank):
    """Every process of the node refuses alike (rank 0 too, which has a GPU): none starts a group."""
    with pytest.raises(ConfigError) as e:
        device.gpu_of_rank(local_rank, 2, 1)
    msg = str(e.value)
    assert "\n" not in msg
    assert "runs 2 processes but has 1 GPU:" in msg
    assert "--nproc_per_node=1" in msg and "trainer.device=cpu" in msg


def test_the_launch_check_refuses_before_any_process_group(monkeypatch):
    """Through the service's own check (what train.py and launch/local.sh run first), with torch's device count
    faked at one GPU and torchrun's environment of the second of two local processes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = make_config({"parallel": {"layer": 2}, "logger": "none"})
    with pytest.raises(ConfigError, match="runs 2 processes but has 1 GPU"):
        checks.check(c, 2)


def test_gloo_on_gpus_refuses_a_layer_split(monkeypatch):
    """parallel.backend=gloo is honoured (collectives work on GPUs), but torch's gloo cannot send GPU tensors
    between layer slices: that combination is refused with the ways out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = make_config({"parallel": {"layer": 2, "backend": "gloo"}, "logger": "none"})
    with pytest.raises(ConfigError, match="parallel.backend=gloo cannot send CUDA tensors"):
        checks.check(c, 2)
