"""pcdist/engine/startup.py: a process that trains does not import torch's compiler, and its optimizers behave as
torch's own. Each test runs in a fresh interpreter (the suite's process has imported torch._dynamo long ago)."""

import subprocess
import sys
import textwrap


def run(script: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_a_run_trains_checkpoints_and_resumes_without_importing_the_compiler(tmp_path):
    """torch.optim's wrappers would import torch._dynamo on the first optimizer (1.3 CPU-s): a run that trains,
    checkpoints (state_dict) and resumes (load_state_dict) never does."""
    out = run(f"""
        import sys
        import pcdist
        cfg = {{"trainer": {{"max_steps": 4, "ckpt_every": 2, "eval_every": 4, "progress": "off"}}, "logger": "none",
               "run_dir": {str(tmp_path / "run")!r}}}
        pcdist.train(cfg)
        cfg["trainer"]["max_steps"] = 6
        pcdist.train(cfg)
        print("torch._dynamo" in sys.modules)
    """)
    assert "at step 4" in out and out.split()[-1] == "False", out


def test_the_optimizers_step_as_torchs_own_and_hand_over_to_the_compiler_once_it_is_imported():
    """Before torch._dynamo is imported, the optimizers step without it (grad mode off inside step, as torch's
    wrapper sets it: an in-place update of a leaf that requires grad would raise otherwise) and give torch's
    results; once something imports it, torch's own wrappers run (two graph breaks per step, the compiler's
    skipping wrapper cached on add_param_group) and the numbers are the same, bit for bit."""
    out = run("""
        import sys
        import torch
        import pcdist.engine  # (as any use of pcdist's API imports it: pcdist.PCTrainer, pcdist.train)
        from torch.optim import SGD, Adam, AdamW

        def train():
            out = []
            for make in (lambda p: AdamW(p, lr=0.1, fused=True), lambda p: AdamW(p, lr=0.1),
                         lambda p: Adam(p, lr=0.1, weight_decay=0.01), lambda p: SGD(p, lr=0.1, momentum=0.9,
                                                                                       nesterov=True)):
                torch.manual_seed(0)
                w = torch.randn(5, 3, requires_grad=True)
                opt = make([w])
                for _ in range(3):
                    opt.zero_grad()
                    (w.sin() ** 2).sum().backward()
                    opt.step()
                state = opt.state_dict()
                again = make([w])
                again.load_state_dict(state)
                again.step()
                out.append(w.detach().clone())
            return out

        before = train()
        assert "torch._dynamo" not in sys.modules, "an optimizer imported torch._dynamo"
        import torch._dynamo
        breaks = []
        real = torch._dynamo.graph_break
        torch._dynamo.graph_break = lambda *a, **k: (breaks.append(1), real(*a, **k))[1]
        after = train()
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "not torch's numbers"
        assert len(breaks) == 2 * 4 * 4, len(breaks)
        cached = torch.optim.Optimizer.add_param_group.__wrapped__.__dynamo_disable
        # the compiler's skipping wrapper (torch 2.4's, made without wrapping=False, keeps the method's __module__)
        assert cached.__module__.startswith("torch._dynamo") or getattr(cached, "_torchdynamo_disable", False), cached
        print("ok")
    """)
    assert out.strip() == "ok", out
