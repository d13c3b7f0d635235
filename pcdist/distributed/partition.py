"""Contiguous layer slices for the layer axis, balanced by FLOPs (not by count)."""

from __future__ import annotations

from typing import Sequence

from ..engine.layers import LayerKind
from ..errors import ConfigError

__all__ = ["check_layer_ranks", "layer_flops", "layer_costs", "partition_layers"]


def check_layer_ranks(ranks: int, layers: int) -> None:
    """Every layer rank needs a layer: the one check (and message) of parallel.layer against the model."""
    if ranks < 1:  # the type of a configured value is ParallelDims.validate's check
        raise ConfigError(f"parallel.layer must be >= 1, got {ranks}")
    if ranks > layers:
        raise ConfigError(f"parallel.layer={ranks} ranks but the model has only {layers} layers; "
                          f"use parallel.layer <= {layers}")


def layer_flops(spec: LayerKind, index: int = 2) -> int:
    """FLOPs per sample of one inference step of global layer ``index`` (each kind's own count:
    layer 1 does no GEMM during PC inference, its input being clamped)."""
    return spec.flops(index)


def layer_costs(specs: Sequence[LayerKind], free_bottom: bool = False) -> list[int]:
    """The cost of every layer of a network (its FLOPs per sample and inference step), for the partition.
    ``free_bottom``: h_0 is inferred (unsupervised PC), so layer 1 predicts from it and projects back to it at
    every step, as an interior layer does (its kind's count at index 2)."""
    return [s.flops(2 if free_bottom and l == 1 else l) for l, s in enumerate(specs, start=1)]


def partition_layers(costs: Sequence[int], P: int) -> list[tuple[int, int]]:
    """Split layers 1..L into P contiguous non-empty slices [a, b) minimising the largest slice cost.

    Exact: binary search on the bottleneck with a greedy feasibility test, then a
    back-to-front greedy fill that leaves at least one layer for every rank in front.
    """
    L = len(costs)
    check_layer_ranks(P, L)
    costs = [int(c) for c in costs]

    def parts_needed(cap: int) -> int:
        parts, acc = 1, 0
        for c in costs:
            if acc + c > cap:
                parts, acc = parts + 1, 0
            acc += c
        return parts

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if parts_needed(mid) <= P:
            hi = mid
        else:
            lo = mid + 1
    slices: list[tuple[int, int]] = []
    b = L + 1  # exclusive end, 1-based
    for r in range(P - 1, -1, -1):
        a, acc = (1, 0) if r == 0 else (b - 1, costs[b - 2])
        while a - 1 > r and acc + costs[a - 2] <= lo:  # keep >= r layers for ranks 0..r-1
            a -= 1
            acc += costs[a - 1]
        slices.append((a, b))
        b = a
    slices.reverse()
    assert slices[0][0] == 1 and all(s[1] == t[0] for s, t in zip(slices, slices[1:]))
    return slices
