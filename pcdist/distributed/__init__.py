"""The distributed layer: where a rank sits in the (data, layer) mesh and what it trades.

* ``parallel.py``    Parallel: the mesh, the data axis, collectives, init_distributed
* ``exchange.py``    LayerExchange: the pipelined init and the one boundary exchange per step
* ``partition.py``   contiguous layer slices balanced by FLOPs
* ``buckets.py``     data-axis gradient all-reduce, one bucket per fused group, overlapped
* ``rendezvous.py``  joining the process group torchrun describes, restarts included
"""
