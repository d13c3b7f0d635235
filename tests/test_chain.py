"""The fused feed-forward chain (pcdist/engine/chain.py) computes what the torch chain computes.

On a GPU a group of K equal square layers runs its feed-forward init as one Triton kernel instead of
~2K small ones. The kernels run here on a CPU under Triton's interpreter, in a process started with
TRITON_INTERPRET=1 (tests/chain_checks.py; this file skips where Triton is not installed). They must
write exactly what the torch chain writes (the pre-activations a gelu-like f needs, u, phi(h) and the
input copies of μPC layers, the value nodes) for every activation and for a row range (the pipelined
init's micro-batches), in float32 (the interpreter's bfloat16 loads are wrong; on a GPU every group's
kernel, bfloat16 included, is checked against torch on first use); a trainer that uses them must train
as one that does not; and a kernel that disagrees with torch is not used.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pcdist.engine import chain  # noqa: E402

CHECKS = Path(__file__).with_name("chain_checks.py")


@pytest.mark.parametrize("what", ["kernels", "trainer"])
def test_the_kernels_under_the_interpreter(what):
    """kernels: every activation in float32, dense and μPC, a row range; trainer: an MLP and a μPC
    network train with the kernel as without it (and their hidden groups did use it)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(CHECKS), what], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    assert " checks passed" in out.stdout


def test_a_kernel_that_disagrees_is_not_used():
    """agree() is the guard a group passes before it uses the kernel: outputs off by more than round-off fail
    it with one warning (the group then keeps the torch chain)."""
    want = torch.ones(3, 4)
    assert chain.agree([want + 1e-7], [want], "a test")
    with pytest.warns(UserWarning, match="disagrees with torch on a test"):
        assert not chain.agree([want + 1e-2], [want], "a test")


def test_no_kernel_on_a_cpu_without_the_interpreter(monkeypatch):
    """On a CPU (no interpreter) the torch chain runs: the kernel is for CUDA devices."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from pcdist.engine.activations import Activation

    assert not chain.usable(torch.zeros(2, 2), Activation("tanh"), 4, 8, 8)
