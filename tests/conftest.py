"""Shared test setup: make ``tests/`` (for ``import reference``, the independent autograd
reference in tests/reference.py) and the repository root (for ``import pcdist`` from the
source tree) importable under any pytest import mode."""
import os
import sys

# Strict conditional numerical reproducibility: MKL results independent of memory alignment.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# Waiting OpenMP threads sleep instead of spinning, as pcdist sets for every process that imports it before
# torch (pcdist/__init__.py). The test processes import torch first (below), and so do the Python blocks of
# the docs that they run (`import torch, pcdist`): without this, each pytest worker's OpenMP threads
# spin on a core another worker needs (a conv PCN's steps cost ten times the CPU on a busy 2-core box).
# The numbers are the same; only the time spent waiting changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS_DIR)
for _p in (_ROOT, _TESTS_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Ctrl-C as a terminal delivers it, whoever started the suite: a shell without job control starts a background
# command (`make test &`, a CI runner's) with SIGINT ignored, and every process inherits that, so a child that
# the tests interrupt would never see its Ctrl-C (Python installs no KeyboardInterrupt where SIGINT is ignored).
# A handler of this process's own is reset to the default in each process it starts.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Imported only after the environment above: torch reads MKL_CBWR and OMP_WAIT_POLICY once, when it loads.
import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # the workers share the cores: intra-op threads to fill them, no more
    # (make test: 3 workers on CI's 2 cores, so 1 each; their threads handing off on busy cores cost the in-process
    # tests about 5% of their time and half their system CPU: docs/testing.md)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tiny-tensor tests with one intra-op thread (restored afterwards).

    On a small, busy CPU box, multi-threaded kernels on [B, 8]-sized tensors can cost
    milliseconds each in thread hand-off; one thread is faster and the results identical.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


FIRST = ["test_slurm.py", "test_launch.py", "test_benchmarks.py", "test_after_training.py",
         "test_docs_after_training.py", "test_chain.py", "test_elastic.py", "test_rundir.py", "test_config_data.py",
         "test_readme.py", "test_service.py", "test_modes_service.py", "test_cli.py", "test_parallel_errors.py",
         "test_sweeps.py", "test_data_arrays.py", "test_preemption.py", "test_conv_module.py",
         "test_modes_reference.py", "test_modes_learning.py", "test_docs_modes.py", "test_metrics.py"]
"""The files that take longest, longest first (make test: pytest-xdist's --dist loadfile with
--no-loadscope-reorder hands out whole files in collection order; the rest, each under 20 s, follow). The SLURM
tests mostly wait on the cluster, so they start at once; a long file handed out last, or one that waits (on a
lost peer's timeout, say) where no other file's work can fill the cores, leaves the other workers idle."""


_gone = [name for name in FIRST if not os.path.isfile(os.path.join(_TESTS_DIR, name))]
assert not _gone, f"tests/conftest.py FIRST names files that are not in tests/: {_gone}"


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
