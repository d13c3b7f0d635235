"""Layer partition: contiguous, non-empty, and optimal in the largest slice's FLOPs."""

import itertools
import random

import pytest

from pcdist.engine.layers import LayerSpec
from pcdist.distributed.partition import layer_flops, partition_layers


def brute_force_bottleneck(costs, P):
    """Smallest possible max slice cost over all ways to cut L layers into P slices."""
    L = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, L), P - 1):
        bounds = (0, *cuts, L)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_partition_is_contiguous_and_optimal(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 9)
    P = rng.randint(1, L)
    costs = [rng.choice([1, 3, 10, 50, 100]) for _ in range(L)]
    slices = partition_layers(costs, P)
    assert len(slices) == P and slices[0][0] == 1 and slices[-1][1] == L + 1
    assert all(a < b for a, b in slices) and all(s[1] == t[0] for s, t in zip(slices, slices[1:]))
    worst = max(sum(costs[a - 1 : b - 1]) for a, b in slices)
    assert worst == brute_force_bottleneck(costs, P)


def test_balanced_by_flops_not_by_count():
    """A wide layer weighs as much as many narrow ones; layer 1 (clamped input) is nearly free."""
    specs = ([LayerSpec(64, 64, None), LayerSpec(64, 4096, None), LayerSpec(4096, 64, None)]
             + [LayerSpec(64, 64, None)] * 6)
    costs = [layer_flops(s, l) for l, s in enumerate(specs, start=1)]
    assert costs[0] < costs[3] < costs[1]
    assert partition_layers(costs, 2) == [(1, 3), (3, 10)]


def test_an_inferred_input_node_makes_layer_1_cost_as_an_interior_layer():
    """Unsupervised PC infers h_0: layer 1 then predicts from it and projects back to it at every step, as every
    other layer does, so the partition counts its GEMMs (it took them as free, and gave the first slice too many)."""
    from pcdist.distributed.partition import layer_costs

    specs = [LayerSpec(512, 512, "tanh")] * 4 + [LayerSpec(512, 10, None)]
    clamped, free = layer_costs(specs), layer_costs(specs, free_bottom=True)
    assert free[0] == clamped[1] > clamped[0] and free[1:] == clamped[1:]
    assert partition_layers(clamped, 2) == [(1, 4), (4, 6)] and partition_layers(free, 2) == [(1, 3), (3, 6)]


def test_more_ranks_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"parallel.layer=4 ranks but the model has only 3 layers"):
        partition_layers([1, 1, 1], 4)
