"""The commands after training: ``python -m pcdist evaluate | predict | export | compare ...``.

    python -m pcdist evaluate RUN_DIR [key=value ...] [--checkpoint last|best|STEP] [--trust-code]
    python -m pcdist predict RUN_DIR inputs.npz --out predictions.npz [--key x_val] [--checkpoint ...] [--trust-code]
    python -m pcdist export RUN_DIR out.pt2 [--checkpoint ...] [--trust-code]
    python -m pcdist compare RUN_DIR... | SWEEP_DIR [--plot compare.png] [--csv out.csv] [--json out.json]

A problem with the input (not a run directory, no checkpoint, arrays of the wrong shape, a
checkpoint of another architecture) is one line on stderr and exit status 2.

A run directory may come from someone else: these commands read it as data only. The function a
run of one's own layers recorded (model.json's factory) is imported and called only with
``--trust-code``; the current folder, which ``python -m`` puts first on the module path, is taken
off it before anything is imported (pcdist/__init__.py; ``--trust-code`` puts it last), so that no module
of the folder one stands in is imported implicitly.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["COMMANDS", "main"]

COMMANDS = ("evaluate", "predict", "export", "compare")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pcdist", description="pcdist after training: evaluate, predict, "
                                 "export, compare (train: python -m pcdist [overrides])")
    sub = ap.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("evaluate", help="accuracy, energy, per-class accuracy -> RUN_DIR/eval.json, confusion.png")
    ev.add_argument("run_dir")
    ev.add_argument("overrides", nargs="*", default=[], help="key=value for evaluation, e.g. pc.T=50 data.root=/data")
    pr = sub.add_parser("predict", help="logits and labels of raw inputs (an .npz with x) -> --out .npz")
    pr.add_argument("run_dir")
    pr.add_argument("inputs")
    pr.add_argument("--out", required=True)
    pr.add_argument("--key", default=None, help="the array of the .npz to predict (default: x, else its only array, "
                    "else x_test or x_val)")
    ex = sub.add_parser("export", help="a torch.export program (.pt2) that runs without pcdist")
    ex.add_argument("run_dir")
    ex.add_argument("out")
    for p in (ev, pr):
        p.add_argument("--device", default="cpu", help="where the network runs: cpu (default), cuda, cuda:N, or "
                       "auto (a GPU where there is one)")
    for p in (ev, pr, ex):
        p.add_argument("--checkpoint", default="last", help="last (default), best, or a step number")
        p.add_argument("--trust-code", action="store_true", help="import and call the function the run's "
                       "model.json names as building its layers (runs of your own modules); never without this")
    co = sub.add_parser("compare", help="differing settings and final metrics of runs; their validation curves")
    co.add_argument("runs", nargs="+", help="run directories, or a sweep directory")
    co.add_argument("--plot", default=None, help="where to draw the curves (default: compare.png in the sweep "
                    "directory, else here)")
    co.add_argument("--csv", default=None, help="also write the table as CSV (and, where the runs differ in "
                    "trainer.seed, the mean and std over seeds beside it, <name>_seeds.csv)")
    co.add_argument("--json", default=None, help="also write the whole comparison as JSON")
    return ap


def _run(args) -> None:
    if args.command == "evaluate":
        from .evaluate import evaluate

        r = evaluate(args.run_dir, args.overrides, args.checkpoint, trust_code=args.trust_code, device=args.device)
        head = f"{r['run_dir']} {r['checkpoint']}: {r['split']}"
        if r["mode"] == "supervised":
            print(f"{head} accuracy {r['accuracy']:.4f} on {r['samples']} samples, energy {r['energy']:.4g} after "
                  f"T={r['T']} inference steps (feed-forward {r['loss']:.4g}); wrote eval.json and confusion.png")
        elif r["mode"] == "generative":
            print(f"{head} accuracy by inference {r['accuracy']:.4f} on {r['samples']} samples (T={r['T']}), "
                  f"reconstruction error {r['reconstruction_mse']:.4g}; wrote eval.json and confusion.png")
        else:
            print(f"{head} reconstruction error {r['reconstruction_mse']:.4g} per element on {r['samples']} samples "
                  f"(T={r['T']}); wrote eval.json")
        if "per_class_accuracy" in r:
            worst = sorted((a, k) for k, a in enumerate(r["per_class_accuracy"]) if a is not None)[:3]
            print("lowest per-class accuracy: " + ", ".join(f"class {k} {a:.3f}" for a, k in worst))
    elif args.command == "predict":
        from .evaluate import predict

        r = predict(args.run_dir, args.inputs, args.out, args.checkpoint, trust_code=args.trust_code, key=args.key,
                    device=args.device)
        source = f"{args.inputs}" + (f"'s {r.pop('input')}" if r.get("input") else "")
        r.pop("input", None)
        out = r.pop("out")
        print(f"{len(r['labels'])} predictions of {source} -> {out} ({', '.join(r)})")
    elif args.command == "export":
        from .export import export

        r = export(args.run_dir, args.out, args.checkpoint, trust_code=args.trust_code)
        if r["format"] == "torch.export":
            print(f"wrote {r['path']}: a torch.export program (raw inputs {r['inputs']} -> logits); load it with "
                  f"torch.export.load({r['path']!r}).module()")
        else:
            print(f"note: {r['note']}")
    else:
        from .compare import compare, format_groups, format_table, write_csv, write_json

        r = compare(args.runs, args.plot)
        print(format_table(r))
        if r["groups"]:
            print(f"\nover seeds (mean ± sample standard deviation):\n{format_groups(r)}")
        print(f"validation curves: {r['plot']}")
        written = (write_csv(r, args.csv) if args.csv else []) + ([write_json(r, args.json)] if args.json else [])
        if written:
            print(f"wrote {', '.join(map(str, written))}")


def main(argv: list[str]) -> int:
    """Run one command; user errors as one line and status 2."""
    from ..errors import DISK_ERRNOS, USER_ERRORS, printable  # (no torch: compare needs none)

    args = _parser().parse_args(argv)
    try:
        _run(args)
    except USER_ERRORS as e:  # (a name from a run folder in it reaches the terminal escaped)
        print(f"error: {printable(' '.join(str(e).split()))}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only or full disk where a command writes its files
        if e.errno not in DISK_ERRNOS:
            raise
        where = printable(e.filename) if e.filename else "writing its files"
        print(f"error: {where}: {e.strerror} (a full or read-only disk, or no permission?)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
