"""The training service: a config in, a trained, logged, checkpointed run out.

* ``schema.py``      the structured config: a dataclass per group, a docstring and a range check per key, ``validate``
* ``config.py``      the config composed (conf/ through Hydra, ``compose``, ``make_config``), the overrides
* ``cli.py``         the command line (``train.py``, ``pcdist-train``, ``python -m pcdist``)
* ``run.py``         ``train(cfg)``: one run on 1 to N ranks: checks, device, process group, then
* ``trainer.py``     ``ServiceTrainer``: the run on this rank (data, mesh, model, loop, logs, checkpoints),
  built from ``checks.py`` (mesh, launch checks), ``device.py`` (device, CPU threads), ``optimizer.py``,
  ``models.py`` (the model registry ``MODELS``, the model factory, model.json), ``datachecks.py`` (the data
  against the model), ``batches.py`` (batch order and shards), ``resume.py`` (how a run starts in its directory) and
  ``preemption.py`` (stop signals, the stop vote)
* ``rundir.py``      run directories and the resume policy
* ``checkpoint.py``  atomic checkpoints keyed by global layer
* ``data.py``, ``loader.py``  datasets (bundled digits, standard files, your arrays) and streamed loading
* ``metrics.py``     metrics.jsonl, wandb, progress, plots
* ``userlayers.py``  ``train(cfg, layers=...)``: the user's own modules through the service
* ``backprop.py``    ``pc.algorithm=bp``: the backprop twin of a run
* ``modelfile.py``   model.json: the layers and input preparation a run records
* ``validate.py``    validation during training (each mode's evaluator) and the pictures of the modes
* ``evaluators.py``  each PC mode's test, one ``Evaluator`` per mode in ``EVALUATORS``: validation during
  training and ``python -m pcdist evaluate`` both run it
* after training: ``load.py`` (``pcdist.load``), ``evaluate.py`` (evaluate, predict; the run's mode's
  evaluator in full), ``export.py`` (torch.export), ``compare.py`` (runs and sweeps side by side),
  ``commands.py`` (``python -m pcdist evaluate | predict | export | compare``)
"""
