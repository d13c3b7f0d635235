"""The training service: a config in, a trained, logged, checkpointed run out.

* ``config.py``      the structured config (Hydra schema, validation, ``compose``)
* ``cli.py``         the command line (``train.py``, ``pcdist-train``, ``python -m pcdist``)
* ``run.py``         ``train(cfg)``: one run on 1 to N ranks
* ``rundir.py``      run directories and the resume policy
* ``checkpoint.py``  atomic checkpoints keyed by global layer
* ``data.py``, ``loader.py``  datasets (bundled digits, standard files, your arrays) and streamed loading
* ``metrics.py``     metrics.jsonl, wandb, progress, plots
"""
