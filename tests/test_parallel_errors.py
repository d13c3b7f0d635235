"""Bad meshes and dead peers give clear errors on real processes, never a hang."""

import os
import re
import time

import pytest
import torch

import pcdist
from pcdist.distributed.parallel import Parallel, ParallelDims, PeerError, init_distributed
from spawn import WorkerError, run


def build_mesh(rank, world, data, layer, dims):
    init_distributed(timeout_s=30)
    Parallel.from_mesh(ParallelDims(data, layer), pcdist.mlp_specs(dims))


def test_more_layer_ranks_than_layers():
    with pytest.raises(WorkerError, match=r"parallel.layer=2 ranks but the model has only 1 layers"):
        run(build_mesh, 2, 1, 2, (5, 3), timeout=60)


def test_mesh_that_does_not_factor_the_world_size():
    with pytest.raises(WorkerError, match=r"parallel.data=3 x parallel.layer=1 = 3 ranks, but the world size is 2"):
        run(build_mesh, 2, 3, 1, (5, 8, 3), timeout=60)


def test_validation_happens_before_any_process_group():
    with pytest.raises(ValueError, match=r"parallel.data=2 x parallel.layer=2 = 4 ranks, but the world size is 2"):
        ParallelDims(2, 2).validate(2)
    with pytest.raises(ValueError, match=r"parallel.layer must be an integer >= 1, got 0"):
        ParallelDims(1, 0).validate(1)


def small_trainer(mesh: ParallelDims, timeout_s: float):
    """A 3-layer PC trainer on this rank's place in ``mesh``, and one batch."""
    init_distributed(timeout_s=timeout_s)
    specs = pcdist.mlp_specs((6, 8, 8, 4))
    par = Parallel.from_mesh(mesh, specs, timeout_s=timeout_s)
    net = pcdist.PCNetwork(specs, layers=par.layers, seed=0)
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=5, parallel=par)
    return tr, torch.randn(4, 6), torch.eye(4)


def die_or_hang(rank, world, mode, timeout_s, gave_up):
    tr, x, y = small_trainer(ParallelDims(1, 2), timeout_s)
    tr.step(x, y)
    if rank == 1:
        if mode == "exit":
            os._exit(0)  # dies silently mid-run: no error of its own
        deadline = time.monotonic() + 3 * timeout_s
        while not os.path.exists(gave_up) and time.monotonic() < deadline:  # hangs, until rank 0 has given up
            time.sleep(0.05)
        os._exit(0)
    t0 = time.monotonic()
    try:
        tr.step(x, y)
    finally:
        print(f"rank 0 gave up after {time.monotonic() - t0:.1f}s", flush=True)
        open(gave_up, "w").close()


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_dead_or_hung_peer_raises_naming_the_peer(mode, tmp_path):
    """The surviving rank raises an error that names rank 1, within the configured timeout."""
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 0: .* with rank 1 failed or timed out after 4s"):
        run(die_or_hang, 2, mode, 4.0, str(tmp_path / "gave-up"), timeout=60)
    assert time.monotonic() - t0 < 45


def step_on_after_a_loss(rank, world, timeout_s):
    tr, x, y = small_trainer(ParallelDims(1, 2), timeout_s)
    tr.step(x, y)
    if rank == 1:
        os._exit(0)
    said = []
    for _ in range(2):
        try:
            tr.step(x, y)
        except PeerError as e:
            said.append(str(e))
    raise RuntimeError(" | ".join(said))


def test_a_step_after_the_loss_is_refused_naming_the_peer_too():
    """Once gloo has seen a peer's connection close it refuses to post anything to it (a RuntimeError from
    batch_isend_irecv, before any wait); that too is the one PeerError naming the peer, not the backend's
    traceback (seen in the lost-peer launch below when the loss came between two exchanges)."""
    with pytest.raises(WorkerError, match=r"rank 0: [^|]*with rank 1 failed[^|]* \| rank 0: [^|]*with rank 1 failed"):
        run(step_on_after_a_loss, 2, 4.0, timeout=60)


def die_before_the_verdict(rank, world, timeout_s):
    from pcdist.service.autostep import _agree

    tr, x, y = small_trainer(ParallelDims(1, 2), timeout_s)
    tr.step(x, y)
    if rank == 1:
        os._exit(0)
    _agree(tr.parallel, True)


def test_a_peer_lost_while_x_lr_auto_agrees_is_named():
    """pc.x_lr=auto's ranks agree on each candidate step by a broadcast from the logging rank; a peer lost there
    gave gloo's traceback (Connection closed by peer), not the one line naming the rank that every other
    collective gives: it is a PeerError naming rank 1, within the timeout."""
    with pytest.raises(WorkerError, match=r"rank 0: PeerError: rank 0: pc.x_lr=auto's verdict \(a broadcast\) over "
                                          r"ranks \[0, 1\] failed or timed out"):
        run(die_before_the_verdict, 2, 4.0, timeout=60)


def join_alone(rank, world, timeout_s):
    import datetime

    import torch.distributed as dist

    from pcdist.distributed.rendezvous import attempt_store

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    attempt_store(store, 0, 2, datetime.timedelta(seconds=timeout_s))  # rank 1 never comes


def test_a_peer_that_never_joins_is_a_peer_error():
    """A rank that never joins the process group: rank 0 gives up within the timeout with a PeerError (the
    command line's one line, status 1), not a RuntimeError that the command line reports as a traceback."""
    with pytest.raises(WorkerError, match=r"rank 0: PeerError: rank 0: only 0 of the other 1 ranks joined the "
                                          r"process group within 1s; are they running\?"):
        run(join_alone, 1, 1.0, timeout=60)


def die_in_data_parallel(rank, world, dead, timeout_s):
    tr, x, y = small_trainer(ParallelDims(2, 1), timeout_s)
    tr.step(x, y)
    if rank == dead:
        os._exit(0)
    tr.step(x, y)


def test_dead_peer_in_a_collective_is_named():
    """Data-parallel ranks meet in the gradient all-reduce. Rank 1 dies after one step: rank 0's
    error names the group and, from the progress recorded in the store, rank 1 as the one behind."""
    with pytest.raises(WorkerError, match=r"rank 0: the data-axis gradient all-reduce over ranks \[0, 1\] failed or "
                                          r"timed out \(rank 0 had begun 2 training steps in this launch, but "
                                          r"rank 1 only 1: it died"):
        run(die_in_data_parallel, 2, 1, 4.0, timeout=60)


def test_only_training_steps_count_as_begun():
    """The progress a failed collective's line compares is training steps begun: inference, a validation chunk or
    a diagnosis (which ranks may run in other numbers: a data rank with a validation chunk more) do not count. It
    counted every feed-forward, so a live rank with one chunk fewer was said to have died."""
    specs = pcdist.mlp_specs((6, 8, 8, 4))
    par = Parallel.single(len(specs))
    net = pcdist.PCNetwork(specs, seed=0)
    tr = pcdist.PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1), T=5, parallel=par, compile="graph")
    x, y = torch.randn(4, 6), torch.eye(4)
    for _ in range(4):  # (compile=graph: the later steps are the core run again, replayed on a GPU)
        tr.step(x, y, log=False)
    for _ in range(3):
        tr.infer(x, None)
    pcdist.diagnose(tr, x, y)
    assert par.steps_begun == 4


def test_dead_store_host_in_a_collective_still_names_the_group():
    """Rank 0 hosts the rendezvous store here (env://); when it dies the progress is gone with it,
    and rank 1 still reports the failed collective and its group, within the timeout."""
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1: the data-axis gradient all-reduce over ranks \[0, 1\] failed"):
        run(die_in_data_parallel, 2, 0, 4.0, timeout=60)
    assert time.monotonic() - t0 < 45


def one_slice_diverges(rank, world, timeout_s):
    """A 2 x 2 mesh (data groups [0, 2] and [1, 3], layer pairs 0-1 and 2-3): rank 3 stops with a reason, as a
    diverged slice does, and its layer neighbour rank 2 dies with it without one (a PeerError leaves none). Rank 0
    hosts the store, which keeps the reason."""
    from pcdist.distributed.exchange import report_failure

    tr, x, y = small_trainer(ParallelDims(2, 2), timeout_s)
    tr.step(x, y)
    if rank == 3:
        report_failure("step 1: the energy diverged to nan")
    pair = torch.distributed.new_group([2, 3])  # (every rank makes every group)
    if rank in (2, 3):
        torch.distributed.barrier(group=pair)  # rank 3's reason is in the store
        os._exit(0)
    tr.step(x, y)


def test_the_data_peer_of_a_lost_neighbour_names_the_slice_that_stopped_first():
    """Rank 1's all-reduce peer is rank 3 itself: it names rank 3 and why. Rank 0's peer, rank 2, left no reason:
    it names rank 3's, which the store holds, not just a peer that died."""
    with pytest.raises(WorkerError) as got:
        run(one_slice_diverges, 4, 4.0, timeout=90)
    said, why = str(got.value), "step 1: the energy diverged to nan)"
    assert ("rank 0: PeerError: rank 0: the data-axis gradient all-reduce over ranks [0, 2] failed or timed out "
            f"(rank 3 stopped, and the peers here with it: {why}") in said, said
    assert ("rank 1: PeerError: rank 1: the data-axis gradient all-reduce over ranks [1, 3] failed or timed out "
            f"(rank 3 stopped: {why}") in said, said


def hang_in_a_log_point(rank, world, where, timeout_s, gave_up):
    from datetime import timedelta

    from pcdist.distributed.rendezvous import join_process_group

    # the host's waits timeout_s (parallel.timeout_s); the group's own timeout far longer, as NCCL's watchdog's is
    join_process_group("gloo", timedelta(seconds=timeout_s), timedelta(seconds=300))
    dims = ParallelDims(2, 1) if where == "the data-axis sum" else ParallelDims(1, 2)
    par = Parallel.from_mesh(dims, pcdist.mlp_specs((6, 8, 8, 4)), timeout_s=timeout_s)
    if rank == 1:  # never joins the collective, until rank 0 has given up
        deadline = time.monotonic() + 15 * timeout_s
        while not os.path.exists(gave_up) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    try:
        if where == "the metrics reduce":
            par.sum_to_logging([1.0])
        elif where == "the energy reduce":
            par.gather_layer_energies(torch.ones(2), 4)
        else:
            par.sum_over_data([torch.ones(3)])
    finally:
        open(gave_up, "w").close()


@pytest.mark.parametrize("where", ["the metrics reduce", "the energy reduce", "the data-axis sum"])
def test_a_peer_that_stalls_a_log_point_collective_is_named_within_the_timeout(where, tmp_path):
    """The log points' collectives (metrics and energy reduces, the data-axis sums) are posted and waited for
    within parallel.timeout_s, inside collective(), not the process group's own timeout (longer here, as NCCL's
    watchdog's is): a stalled peer is one PeerError naming the collective and the ranks (under NCCL the blocking
    call returned once queued, and the stall surfaced at the next host read)."""
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 0: {where} over ranks \[0, 1\] failed or timed out"):
        run(hang_in_a_log_point, 2, where, 4.0, str(tmp_path / "gave-up"), timeout=90)
    assert time.monotonic() - t0 < 60


def stall_at_a_host_wait(rank, world, where, gave_up):
    from datetime import timedelta

    from pcdist.distributed.parallel import barrier
    from pcdist.distributed.rendezvous import join_process_group

    # the host's waits 4 s (parallel.timeout_s); the group's own timeout far longer, as NCCL's watchdog's is
    join_process_group("gloo", timedelta(seconds=4), timedelta(seconds=300))
    par = Parallel.from_mesh(ParallelDims(1, 2), pcdist.mlp_specs((6, 8, 8, 4)), timeout_s=4)
    if rank == 1:  # never arrives, until rank 0 has given up
        deadline = time.monotonic() + 60
        while not os.path.exists(gave_up) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    try:
        if where == "the checkpoint barrier":
            barrier(where)
        elif where == "the stop-signal all-reduce":  # the service's per-step vote on a stop signal
            from pcdist.service.preemption import StopVote

            vote = StopVote(True, torch.device("cpu"), par.timeout)
            vote(0)
            vote.finish()
        elif where == "the skipped-update all-reduce":  # skip_above's vote over every rank, at each update
            par.all_sum(torch.ones(2))
        else:  # test-time predictions, from every slice that holds some, onto the logging rank (rank 1)
            par.gather_batch(torch.ones(3, 2))
    finally:
        open(gave_up, "w").close()


@pytest.mark.parametrize("where", ["the checkpoint barrier", "the batch gather", "the stop-signal all-reduce",
                                   "the skipped-update all-reduce"])
def test_a_peer_that_never_reaches_a_barrier_or_gather_is_named_within_the_hosts_timeout(where, tmp_path):
    """The service's barriers (the checkpoint's, the run directory's, a layer group's first), object gathers
    (test-time predictions, value nodes), stop vote and skip vote (also the adaptive solver's error norm) wait
    within parallel.timeout_s, not the process group's own
    timeout (under NCCL 2 x timeout_s + 60 s, after which the watchdog ends the process in NCCL's words; the vote's
    gloo group on GPUs: torch's 30 minutes): a peer that never arrives is one PeerError naming the collective and
    the ranks."""
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 0: {where} over ranks \[0, 1\] failed or timed out"):
        run(stall_at_a_host_wait, 2, where, str(tmp_path / "gave-up"), timeout=90)
    assert time.monotonic() - t0 < 60


def exited(pid: int) -> bool:
    """The process has ended: gone, or a zombie its stopped parent has not reaped."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


@pytest.mark.parametrize("killed", [1, 0])
def test_a_lost_peer_leaves_each_survivor_one_line_not_a_traceback(tmp_path, killed):
    """A worker SIGKILLed under the real torchrun: its neighbour's log (the survivor's stderr, kept apart by
    torchrun's --redirects) is one line naming the lost peer, without the Python traceback and the C++ frames of the
    backend (the cause is the dead rank; the survivor's stack says nothing about it). Rank 0 hosts the rendezvous
    store here: where it is the one killed, the survivor's reads of the dead store for its line logged 35 lines of
    C++ frames; it asks the store's host first.

    The survivor learns of the loss wherever it is: in a boundary exchange (the line names rank 1) or in a
    collective of the layer group (the line names the group, ranks [0, 1]). The agent is stopped (SIGSTOP) from
    just before the kill until the survivor has exited, so that it cannot stop the survivor before the survivor
    has said its line, however slow the machine; then it carries on and ends the launch."""
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from test_elastic import children
    from test_service import ROOT

    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.5", f"--log-dir={logs}", "--redirects=3", str(ROOT / "train.py"), "parallel.layer=2",
           "parallel.timeout_s=8",  # where the survivor waits on the dead peer's key, it waits this long
           "trainer.max_steps=100000", "trainer.ckpt_every=20", "logger=none", "trainer.progress=off",
           f"hydra.run.dir={run_dir}"]
    # Rank 0 hosts the rendezvous store, not the agent: with the agent stopped, a store write of the survivor's (its
    # progress, each step) would otherwise wait out parallel.timeout_s before the survivor could say its line.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step-00000020").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint at step 20 within 600 s"
            time.sleep(0.05)
        rank_of = {pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in children(proc.pid)}
        (lost,) = [pid for pid, env in rank_of.items() if f"RANK={killed}".encode() in env]
        (survivor,) = [pid for pid, env in rank_of.items() if f"RANK={1 - killed}".encode() in env]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            os.kill(lost, signal.SIGKILL)
            deadline = time.monotonic() + 600
            while not exited(survivor):
                assert time.monotonic() < deadline, "the survivor still runs 600 s after its peer was killed"
                time.sleep(0.05)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    (err,) = logs.glob(f"*/attempt_0/{1 - killed}/stderr.log")
    text = err.read_text()
    assert "Traceback" not in text and "frame #" not in text and "Exception raised from" not in text, text[-3000:]
    assert text.count("\n") == 1, text[-3000:]
    survivor = 1 - killed  # (fail() names a local rank > 0 first)
    assert re.match(rf"error( \(rank {survivor}\))?: rank {survivor}: .*(with rank {killed} failed|over ranks \[0, 1\] "
                    rf"failed)", text), text[-3000:]


def test_a_rank_started_with_other_settings_is_named_with_the_keys_by_its_peer(tmp_path):
    """Under the real torchrun, rank 1 alone gets pc.T=10 (another node's script, say). It would fail in an exchange
    of the wrong size (a gloo abort); instead it refuses to start, and leaves why in the rendezvous store, so that
    rank 0, whose first collective fails, names rank 1, the key and both values in its one line. (A data file
    missing on one rank's side goes the same way.)"""
    import subprocess
    import sys

    from test_service import ROOT

    wrapper = tmp_path / "rank_wrapper.py"
    wrapper.write_text(f"import os, runpy, sys\ntrain = {str(ROOT / 'train.py')!r}\n"
                       "sys.argv = [train, *sys.argv[1:], *(['pc.T=10'] if os.environ['RANK'] == '1' else [])]\n"
                       "runpy.run_path(train, run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(wrapper), "parallel.layer=2", "pc.T=20", "trainer.max_steps=4", "logger=none",
                          "trainer.progress=off", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode != 0
    said = out.stdout + out.stderr
    assert ("rank 1 was started with other settings than rank 0: pc.T=10 (rank 0: 20); every rank of a launch must "
            "get the same overrides") in said, said[-3000:]
    assert "rank 1 stopped: rank 1 was started" in said or "error (rank 1): rank 1 was started" in said, said[-3000:]
    assert "EnforceNotMet" not in said and not (tmp_path / "run" / "checkpoints").exists()


def test_a_diverged_slice_is_named_with_its_cause_by_its_neighbour(tmp_path):
    """Layer-parallel under the real torchrun, a value step that makes the energy diverge: the rank that logs (the
    last slice) stops with the one line of a diverged run, and its neighbour, whose next exchange fails, names
    that rank and the same cause in its own line (it said only "is rank 1 alive?")."""
    import subprocess
    import sys

    from test_service import ROOT

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "train.py"), "parallel.layer=2", "pc.x_lr=1000", "trainer.max_steps=30",
                          "trainer.log_every=5", "logger=none", "trainer.progress=off",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode != 0
    said = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error")]
    cause = "step 5: the energy diverged to "
    assert any(line.startswith("error: rank 0: ") and f"(rank 1 stopped: {cause}" in line for line in said) or \
        any(line.startswith(f"error (rank 1): {cause}") for line in said), said
    assert all("is rank 1 alive?" not in line for line in said), said


def test_an_exchange_coalesced_into_one_work_names_every_peer_and_why(tmp_path):
    """NCCL returns one work for a whole batch of sends and receives (gloo one per op): a middle rank's failed
    boundary exchange then names both neighbours, and the cause either left in the store, not just the first op's
    peer. One work per op keeps naming each op's own peer."""
    import torch.distributed as dist

    from pcdist.distributed.exchange import _FAILED_KEY, _why, works_of_batch

    peers = [(2, "errors send"), (2, "errors receive"), (0, "errors send"), (0, "errors receive")]
    assert works_of_batch(["w"], peers, "errors", 5) == [("w", (2, 0), "errors", 5)]
    assert works_of_batch(list("abcd"), peers, "errors", 5)[2] == ("c", (0,), "errors send", 5)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert _why((2, 0)) == "are rank 2 and rank 0 alive?"
        dist.distributed_c10d._get_default_store().set(_FAILED_KEY.format(0), "DataError: data/mnist missing")
        assert _why((2, 0)) == "rank 0 stopped: DataError: data/mnist missing"
    finally:
        dist.destroy_process_group()


def test_world_size_left_set_for_a_plain_process_is_one_line_before_any_work(tmp_path, monkeypatch):
    """WORLD_SIZE exported in a shell (or inherited from a job) and a plain `python train.py`: the rendezvous torchrun
    sets up is missing, which one line names (torch's env:// traceback before), and no run directory is made."""
    from pcdist.errors import ConfigError

    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not: this "
                                          r"process was not started by torchrun; launch it with torchrun "
                                          r"--nproc_per_node=2 train.py \[overrides\], or unset WORLD_SIZE$"):
        pcdist.train({"run_dir": str(run_dir), "logger": "none", "trainer.max_steps": 1})
    assert not run_dir.exists()


def mesh_of_layers(rank, world):
    from torch import nn

    init_distributed(timeout_s=30)
    net = pcdist.PCNetwork.from_layers([nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Tanh()])
    Parallel.from_mesh(ParallelDims(1, 2), net.specs)


def mesh_free_bottom(rank, world, learned_prior):
    from torch import nn

    init_distributed(timeout_s=30)
    net = pcdist.PCNetwork.from_layers([nn.Tanh(), nn.Sequential(nn.Linear(5, 4), nn.Tanh())], input_shape=(5,))
    par = Parallel.from_mesh(ParallelDims(1, 2), net.specs, free_bottom=True, learned_prior=learned_prior)
    assert par.layers == ((1, 2) if rank == 0 else (2, 3))


def test_a_free_bottom_rank_of_parameter_free_layers_is_refused_unless_it_trains_a_learned_prior():
    """A free h_0 (unsupervised) with nn.Tanh() alone on the first layer rank: that rank trains something only where
    h_0's prior mean is learned; with a fixed prior it is refused on every rank like any other slice (it had been
    let through, to torch's empty-optimizer traceback on rank 0)."""
    run(mesh_free_bottom, 2, True, timeout=60)
    with pytest.raises(WorkerError) as e:
        run(mesh_free_bottom, 2, False, timeout=60)
    said = r"parallel.layer=2: a layer rank would hold layers 1..1 \(module Tanh \[5\] -> \[5\]\), which have no"
    assert len(re.findall(rf"rank \d: ConfigError: {said}", str(e.value))) == 2, str(e.value)[-3000:]


def test_a_layer_rank_of_parameter_free_layers_only_is_refused_alike_on_every_rank():
    """nn.Tanh() as a PC layer, alone on a rank: that rank's optimizer had nothing to train (torch's 'empty
    parameter list' traceback, its peers a lost-peer line); every rank now names the slice."""
    with pytest.raises(WorkerError) as e:
        run(mesh_of_layers, 2, timeout=60)
    said = r"parallel.layer=2: a layer rank would hold layers 2..2 \(module Tanh \[5\] -> \[5\]\), which have no " \
           r"parameters to train"
    assert len(re.findall(rf"rank \d: ConfigError: {said}", str(e.value))) == 2, str(e.value)[-3000:]
