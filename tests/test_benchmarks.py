"""The benchmark scripts run end to end (tiny sizes) and write what docs/results.md says they write.

No timing is asserted here: speed claims live in docs/results.md (and docs/service.md), measured by these scripts.
What is checked is that the reported ratios are the ones defined in each script's
docstring, recomputed from the raw samples the script saved.
"""

import contextlib
import io
import json
import os
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(script: str, *args: str) -> str:
    """``python benchmarks/<script> <args>`` from the checkout, run as that command runs it (as ``__main__``,
    its folder first on the path) but in this process: a process of its own would add 3 CPU-s of imports to
    each. What a script changes of the process (torch's threads and random state, the environment, the path)
    is put back. Returns what it printed."""
    path = ROOT / "benchmarks" / script
    saved = torch.get_num_threads(), torch.get_rng_state(), dict(os.environ), sys.argv[:], sys.path[:], os.getcwd()
    printed = io.StringIO()
    sys.argv, sys.path[:0] = [str(path), *args], [str(path.parent)]
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"{script} exited with {e.code}:\n{printed.getvalue()[-3000:]}"
    finally:
        threads, rng, env, sys.argv, sys.path[:], cwd = saved
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    return printed.getvalue()


@pytest.mark.parametrize("activation,stem", [("tanh", "fusion"), ("gelu", "fusion_gelu")])
def test_fusion_benchmark_writes_medians_ratios_and_plot(tmp_path, activation, stem):
    stdout = run("fusion.py", "--tiny", "--activation", activation, "--out", str(tmp_path))
    res = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (tmp_path / f"{stem}_depth.png").read_bytes()[:8] == PNG_MAGIC
    assert res["config"]["activation"] == activation and res["config"]["tiny"]
    assert set(res["shapes"]) == {"A", "B", "C", "M"}
    for name, shape in res["shapes"].items():
        rounds = shape["rounds"]
        assert {"loop", "pcdist", "limit"} <= set(rounds)
        assert len({len(v) for v in rounds.values()}) == 1, "every variant is timed in every round"
        for variant, samples in rounds.items():
            assert shape["seconds"][variant] == statistics.median(samples)
        for num, den in (("loop", "pcdist"), ("pcdist", "limit"), ("torch_ops", "pcdist"), ("module", "pcdist"),
                         ("module_eager", "module")):
            if num in rounds:
                per_round = statistics.median(a / b for a, b in zip(rounds[num], rounds[den]))
                assert shape[f"{num}/{den}"] == per_round
        assert f"shape {name} (" in stdout
    assert "(mupc)" in res["shapes"]["M"]["dims"]
    assert {"module", "module_eager"} <= set(res["shapes"]["A"]["rounds"]), "the module kind is timed on shape A"
    assert sorted(map(int, res["depth"])) == [2, 4]


def test_conv_benchmark_writes_medians_ratios_and_plot(tmp_path):
    stdout = run("conv.py", "--tiny", "--out", str(tmp_path))
    res = json.loads((tmp_path / "conv.json").read_text())
    assert (tmp_path / "conv.png").read_bytes()[:8] == PNG_MAGIC
    assert res["config"]["tiny"] and set(res["networks"]) == {"vgg5", "stack", "digits"}
    for name, net in res["networks"].items():
        rounds = net["rounds"]
        assert set(rounds) == {"loop", "pcdist", "pcdist_cl", "limit", "limit_cl"}
        assert len({len(v) for v in rounds.values()}) == 1, "every variant is timed in every round"
        for variant, samples in rounds.items():
            assert net["seconds"][variant] == statistics.median(samples)
        for num, den in (("loop", "pcdist"), ("pcdist", "limit"), ("pcdist", "pcdist_cl"), ("limit", "limit_cl")):
            assert net[f"{num}/{den}"] == statistics.median(a / b for a, b in zip(rounds[num], rounds[den]))
        assert net["layers"][0].startswith("conv2d") and f"{name} (" in stdout
    st = res["stacked"]
    assert st["grouped/per_layer"] == statistics.median(
        a / b for a, b in zip(st["rounds"]["grouped"], st["rounds"]["per_layer"]))


def test_scaling_benchmark_launches_torchrun_and_reports_efficiency(tmp_path):
    run("scaling.py", "--layers-per-rank", "1", "--width", "32", "--steps", "1", "--rounds", "1",
        "--out", str(tmp_path))
    res = json.loads((tmp_path / "scaling_K1_W32.json").read_text())
    assert (tmp_path / "scaling_K1_W32.png").read_bytes()[:8] == PNG_MAGIC
    one, two = res["ranks"]["1"], res["ranks"]["2"]
    assert (one["layers"], two["layers"]) == (2, 3), "an input layer + P*K layers"
    assert two["efficiency"] == one["step_s"] / two["step_s"]
    assert two["load_adjusted_efficiency"] == two["independent_step_s"] / two["step_s"]
    assert 0.0 <= two["max_comm_fraction"] <= 1.0 and one["max_comm_fraction"] == 0.0
    assert res["config"]["layers_per_rank"] == 1 and "worker_out" not in res["config"]


def test_deeppcr_benchmark_reports_its_best_cells(tmp_path):
    run("deeppcr.py", "--quick", "--out", str(tmp_path))
    res = json.loads((tmp_path / "deeppcr.json").read_text())
    assert (tmp_path / "deeppcr.png").read_bytes()[:8] == PNG_MAGIC
    measured = [c for c in res["cells"] if "skipped" not in c]
    assert measured
    for phase in ("forward", "backward"):
        best = max((c[phase]["speedup"], c["L"], c["width"], c["batch"]) for c in measured)
        assert res["best"][phase] == list(best)


def test_scaling_model_efficiency_is_one_gpu_time_over_step_time(tmp_path):
    run("scaling_model.py", "--out", str(tmp_path))
    res = json.loads((tmp_path / "scaling_model.json").read_text())
    assert {r["gpus"] for r in res["rows"]} == {8, 16, 32, 64, 128, 256, 512}
    for r in res["rows"]:
        assert r["gpus"] == r["P"] * r["D"]
        assert r["weak_scaling_efficiency"] == res["one_gpu_ms"] / r["step_ms"]
    assert res["assumptions"]["layers_per_rank"] == 8


def test_depth_benchmark_reports_accuracy_time_and_the_gap(tmp_path):
    stdout = run("depth.py", "--tiny", "--out", str(tmp_path))
    res = json.loads((tmp_path / "depth.json").read_text())
    assert (tmp_path / "depth.png").read_bytes()[:8] == PNG_MAGIC
    assert res["config"]["tiny"] and sorted(map(int, res["depths"])) == [3, 4]
    for depth, row in res["depths"].items():
        assert {"mupc_pc", "mlp_pc", "mupc_bp"} <= set(row)
        for method in ("mupc_pc", "mlp_pc", "mupc_bp"):
            assert 0.0 <= row[method]["accuracy"] <= 1.0 and row[method]["step_s"] > 0
            assert f"depth {int(depth):4d}  {method}" in stdout
        assert row["bp_minus_pc_points"] == 100 * (row["mupc_bp"]["accuracy"] - row["mupc_pc"]["accuracy"])


def test_service_benchmark_interleaves_the_service_loop_and_the_engine_step(tmp_path):
    """The real torchrun, 2 ranks; the reported ratio is the median of per-round service / engine ratios."""
    stdout = run("service.py", "--layers-per-rank", "1", "--width", "32", "--rounds", "2", "--steps", "3",
                 "--warmup", "2", "--log-every", "2", "--out", str(tmp_path))
    res = json.loads((tmp_path / "service_K1_W32.json").read_text())
    assert (tmp_path / "service_K1_W32.png").read_bytes()[:8] == PNG_MAGIC
    rounds = res["rounds"]
    assert set(rounds) == {"service", "engine"} and len(rounds["service"]) == len(rounds["engine"]) == 2
    per_round = [s / e for s, e in zip(rounds["service"], rounds["engine"])]
    assert res["ratio_per_round"] == per_round
    assert res["service/engine"] == statistics.median(per_round)
    assert res["step_s"] == {k: statistics.median(v) for k, v in rounds.items()}
    assert f"service / engine: {res['service/engine']:.3f}" in stdout


def test_threads_benchmark_writes_every_round_and_their_medians(tmp_path):
    """Every variant (--tiny: as is; the full run adds one core held by a busy process, which would slow the
    suite's other worker), each a median of the rounds it saved."""
    run("threads.py", "--tiny", "--out", str(tmp_path))
    res = json.loads((tmp_path / "threads.json").read_text())
    assert set(res["rounds"]) == {f"quickstart | as is | {v}" for v in ("default", "1 thread", "passive")}
    for key, samples in res["rounds"].items():
        assert res["seconds"][key] == statistics.median(samples) and all(s > 0 for s in samples)


def test_activations_benchmark_times_every_activation_with_and_without_the_kernel(tmp_path):
    """Each activation on shapes A and M, with the kernel and as torch ops; the gain is the median of the
    per-round ratios of the saved samples."""
    run("activations.py", "--tiny", "--out", str(tmp_path))
    res = json.loads((tmp_path / "activations.json").read_text())
    assert set(res["shapes"]) == {"A", "M"}
    for shape in res["shapes"].values():
        assert {"tanh", "gelu", "relu", "silu", "softplus", "elu", "mish"} <= set(shape)
        for act in shape.values():
            kernel, ops = act["rounds"]["kernel"], act["rounds"]["torch_ops"]
            assert act["gain"] == statistics.median(o / k for o, k in zip(ops, kernel))


def test_modes_benchmark_writes_ratios_learning_figures_and_pictures(tmp_path):
    """benchmarks/modes.py --tiny: every mode timed in every round, ratios recomputed from the samples, the
    learning figures' ratios to PCA consistent, the two pictures written."""
    stdout = run("modes.py", "--tiny", "--out", str(tmp_path))
    res = json.loads((tmp_path / "modes_tiny.json").read_text())
    for name in ("A", "M"):
        shape = res["speed"][name]
        samples = shape["samples"]
        assert set(samples) == {"supervised", "generative", "unsupervised", "precision"}
        assert len({len(v) for v in samples.values()}) == 1, "every variant is timed in every round"
        for k, v in samples.items():
            assert shape["step_s"][k] == statistics.median(v)
            if k != "supervised":
                assert shape["ratios"][f"{k}/supervised"] == statistics.median(
                    a / b for a, b in zip(v, samples["supervised"]))
        assert f"shape {name}:" in stdout
    learn = res["learning"]
    for k in ("unsupervised_linear", "unsupervised_hidden_value_nodes", "unsupervised_mlp_in_one_layer"):
        assert learn[k]["ratio_to_pca"] == learn[k]["mse"] / learn["pca_k10"]
    assert 0 <= learn["generative_hidden"]["accuracy"] <= 1 and 0.85 < learn["lda"] <= 1
    for png in ("modes_tiny_samples.png", "modes_tiny_reconstructions.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def test_backprop_benchmark_runs_both_twins_and_times_them_interleaved(tmp_path):
    """benchmarks/backprop.py: a PC and a backprop service run per preset, and the step-time ratio is the
    ratio of the medians of the interleaved samples it saved."""
    out = tmp_path / "backprop.json"
    stdout = run("backprop.py", "--tiny", "--presets", "default", "pcx_mnist", "--out", str(out))
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    assert [r["preset"] for r in res["rows"]] == ["default", "pcx_mnist"] and res["tiny"]
    assert "shared" in res["machine"]
    for row in res["rows"]:
        assert 0.0 <= row["pc_accuracy"] <= 1.0 and 0.0 <= row["bp_accuracy"] <= 1.0
        assert len(row["pc_samples_s"]) == len(row["bp_samples_s"]) == row["timing_rounds"]
        ratio = statistics.median(row["pc_samples_s"]) / statistics.median(row["bp_samples_s"])
        assert row["pc_over_bp"] == pytest.approx(ratio, rel=1e-12)
        assert row["preset"] in stdout
    assert res["rows"][1]["data"].startswith("digits resized to 1x28x28") or res["rows"][1]["data"] == "mnist"


def test_fidelity_benchmark_reports_old_recipe_and_backprop_per_seed(tmp_path):
    """benchmarks/fidelity.py --tiny: per seed, PC with the old defaults, PC with the recipe and backprop (the
    better of its two optimizer settings); the means and the gap are recomputed from the per-seed figures."""
    out = tmp_path / "fidelity.json"
    run("fidelity.py", "--tiny", "--networks", "digits_mlp", "--seeds", "3", "--out", str(out))
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    (row,) = res["rows"]
    assert row["network"] == "digits_mlp" and row["seeds"] == [3] and res["tiny"]
    for k in ("old", "recipe", "bp"):
        assert len(row[k]) == 1 and all(0.0 <= a <= 1.0 for a in row[k])
        assert row[f"{k}_mean"] == pytest.approx(statistics.fmean(row[k]))
    assert row["bp"] == [max(a, b) for a, b in zip(row["bp_old_optim"], row["bp_recipe_optim"])]
    assert row["gap_points"] == pytest.approx(100 * (row["bp_mean"] - row["recipe_mean"]))


def test_solvers_benchmark_traces_times_and_trains_every_method(tmp_path):
    """benchmarks/solvers.py --tiny: per network, every method's energy after each inference step from the same
    init (the feed-forward methods all start at one energy, the inits near equilibrium below it), a step time at
    T = 1, 5 and T_max whose per-step slope and fixed part are the ones the script defines, the adaptive
    solver's points, the plots, and one accuracy cell per (method, T)."""
    out = tmp_path / "solvers.json"
    run("solvers.py", "--tiny", "--networks", "digits_mlp", "mupc64", "--Ts", "2", "--rounds", "1",
        "--out", str(out))
    res = json.loads(out.read_text())
    for name in ("solvers_energy.png", "solvers_time.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    for net in ("digits_mlp", "mupc64"):
        methods = res["trace"][net]["methods"]
        assert set(methods) >= {"euler", "heun", "rk4", "nesterov", "adam", "newton", "backward"}
        first = {m: v["energy"][0] for m, v in methods.items()}
        for m in ("heun", "rk4", "nesterov", "adam"):
            assert first[m] == pytest.approx(first["euler"], rel=1e-6), "same feed-forward init"
            assert len(methods[m]["energy"]) == 4  # T_max = 3 in --tiny
        for m in ("newton", "backward"):
            assert first[m] < first["euler"], "an init near equilibrium starts lower"
        for v in methods.values():
            assert v["per_step_s"] == pytest.approx((v["step_s_T3"] - v["step_s_T1"]) / 2, rel=1e-9)
        assert [a["tol"] for a in res["trace"][net]["adaptive"]] == [0.1, 0.01, 0.001]
        cells = res["accuracy"][net]
        assert {k.split("@")[1] for k in cells} == {"2"}, "the T asked for (--tiny adds no T = 5 column)"
        assert {k.split("@")[0] for k in cells} == {"euler", "heun", "newton", "backward"}
        assert all(0.0 <= c["accuracy"] <= 1.0 for c in cells.values())


def test_kernels_counts_the_triton_launches_of_a_gpu_step(tmp_path):
    """benchmarks/kernels.py on shape C (two hidden dense groups of K = 1, T = 20): with pcdist's Triton kernels the
    step's error passes are one launch per hidden group and pass (2 x 21: T steps and the final evaluation; no
    group of K >= 2 for the chain), each batched product one launch of the Triton GEMM where the torch ops run
    one baddbmm or bmm, and fewer kernels in all than with the torch ops they replace."""
    pytest.importorskip("triton")
    try:
        stdout = run("kernels.py", "--shapes", "C", "--out", str(tmp_path))
        rows = json.loads((tmp_path / "kernels.json").read_text())["C"]
        assert rows["torch"]["triton"] == 0 and rows["triton"]["launches"]["errors"] == 42, rows
        assert rows["triton"]["launches"]["gemm"] == rows["torch"]["products"] > 0 == rows["triton"]["products"], \
            rows
        assert rows["triton"]["total"] < rows["torch"]["total"], rows
        assert f"kernels per step {rows['torch']['total']} with torch ops, {rows['triton']['total']}" in stdout
    except Exception:
        # the kernels are counted under Triton's interpreter: where it cannot run a loop (Triton 3.0, torch 2.4's;
        # Triton 3.6 with numpy 2.4), the kernels disagree with torch on their first-use check and the torch ops run
        # instead. A process of its own tells that apart from a failure (only then: it costs 3 CPU-s of imports).
        probe = subprocess.run([sys.executable, "-c", "import chain_checks; print(chain_checks.interpreter_runs())"],
                               cwd=ROOT / "tests", env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                               text=True, timeout=300)
        assert probe.returncode == 0, probe.stderr[-3000:]
        if probe.stdout.strip():
            pytest.skip(probe.stdout.strip())
        raise
