"""The single-device PC engine: networks of fused layer groups and the phases of PC on them.

* ``network.py``  PCNetwork: layer kinds grouped into stacked runs of equal layers
* ``convert.py``  PCNetwork to and from plain torch modules (from_layers / from_sequential, to_layers / to_sequential)
* ``layers/``     the layer kinds (dense, residual, conv, module) and their fused phases
* ``stage.py``    Stage: one batch's value nodes (``nodes.py``) and the fused phases over every group
* ``trainer.py``  PCTrainer: feed-forward init, T inference steps, weight update (pc / ipc);
  ``arguments.py`` the rule of each of its settings (the service's ``pc.*`` keys are checked by the same)
* ``energies.py``, ``activations.py``, ``native.py`` (+ ``_native.c``): output energies,
  activations with fused derivatives, the fused CPU error kernel
* ``fuse.py``     N same-architecture modules run as one; ``deeppcr.py`` chains in O(log L);
  ``models.py`` the conv model zoo (PCX's VGG, listed CNNs)
* ``diagnostics.py``  ``diagnose``: PC against backprop on one batch (energy per inference step,
  cos and norm ratio of the weight updates per layer, value change)

Nothing here imports torch.distributed or pcdist.distributed (tests/test_layout.py checks it): the trainer
runs its schedules against an exchange (``exchange.py``: ``Local``, one process), which
pcdist.distributed.Parallel implements across ranks.
"""

from .startup import defer_dynamo

defer_dynamo()  # torch.optim imports torch._dynamo (1.3 CPU-s) only once something compiles
