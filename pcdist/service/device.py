"""The device and CPU threads of a run: the GPU of this rank (``gpu_of_rank``), or the CPU and its torch
threads per rank (``cpu_threads``); ``pick_device`` chooses, ``use_device`` sets torch up for it."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from .config import Config


def pick_device(c: Config) -> torch.device:
    """trainer.device: the CPU, or this rank's GPU (``auto``: a GPU where there is one)."""
    want = c.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config trainer.device='cuda' but no CUDA device is available; use trainer.device=cpu or "
                          "auto")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return gpu_of_rank(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                       torch.cuda.device_count())


def gpu_of_rank(local_rank: int, local_world: int, gpus: int) -> torch.device:
    """cuda:LOCAL_RANK, or a ConfigError naming both counts when this node runs more processes than it has GPUs."""
    if local_rank >= gpus or local_world > gpus:
        raise ConfigError(f"this node runs {max(local_world, local_rank + 1)} processes but has {gpus} GPU"
                          f"{'s' * (gpus != 1)}: each process needs a GPU of its own; start at most {gpus} per node "
                          f"(torchrun --nproc_per_node={gpus}, or NPROC={gpus} launch/local.sh / make train), or "
                          "train on the CPU with trainer.device=cpu")
    return torch.device(f"cuda:{local_rank}")


def cpu_threads(configured: int, env) -> tuple[int, str]:
    """torch threads per rank on CPU and why: ``trainer.threads`` if > 0, else OMP_NUM_THREADS if
    set (torchrun sets it to 1 itself when it starts several processes and finds it unset), else
    the cores this process may use / the ranks on this machine."""
    if configured:
        return configured, "trainer.threads"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        first = omp.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={omp!r} is not a number of threads >= 1; unset it or set "
                              "trainer.threads")
        return int(first), "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // local), f"{cores} cores / {local} rank{'s' * (local > 1)} on this machine"


def use_device(c: Config, device: torch.device) -> str:
    """Set torch up for ``device``: on the CPU its threads per rank (``cpu_threads``), on a GPU cuDNN's
    algorithm search. Returns what the mesh line adds about the threads ("" on a GPU)."""
    if device.type != "cpu":  # every stage has fixed shapes: let cuDNN time its convolution algorithms once
        torch.backends.cudnn.benchmark = True
        return ""
    n, why = cpu_threads(c.trainer.threads, os.environ)
    torch.set_num_threads(n)
    return f"; {n} torch thread{'s' * (n > 1)} per rank ({why})"
