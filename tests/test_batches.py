"""The batches a run trains and validates on, cut for its ranks (pcdist/service/batches.py), and the statistics
data.normalize standardises with (data.py): against what one process over the whole data gives, and a closed form."""

from types import SimpleNamespace

import torch

from pcdist.service.batches import step_batches, val_chunks
from pcdist.service.config import make_config
from pcdist.service.data import Dataset, normalization_stats

AUGMENTED = make_config({"data": {"augment": True}, "trainer": {"batch_size": 8}})


def images() -> Dataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(32, 1, 6, 6, generator=g), torch.arange(32) % 3
    return Dataset(x, y, x[:4], y[:4], 3)


def ranks(size: int, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(data_size=size, data_rank=rank, is_first=True, is_last=True)


def test_each_data_rank_gets_its_rows_of_the_augmented_global_batch():
    """data.augment on a data axis: each rank's share of a step's batch is its rows of the batch one process
    augments (every split draws the crops and flips of the whole global batch alike; a rank drawing another rank's
    rows passed every test)."""
    ds = images()

    def batch(size, rank, step=5):
        return next(step_batches(AUGMENTED, ds, ranks(size, rank), step, step + 1, "cpu", torch.float32))

    whole = batch(1, 0)
    for size in (2, 3):
        parts = [batch(size, r) for r in range(size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0]), f"{size} data ranks: other crops or flips"
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


def test_a_resumed_run_gets_the_batches_and_augmentations_of_an_uninterrupted_one():
    """Resumed at step s (4 steps an epoch: 5 is in the second), the batches of steps s+1.. are the uninterrupted
    run's, crops and flips included (an augmentation restarting at step 0 passed every test)."""
    ds = images()
    straight = list(step_batches(AUGMENTED, ds, ranks(1), 0, 7, "cpu", torch.float32))
    for start in (1, 4, 5):
        resumed = list(step_batches(AUGMENTED, ds, ranks(1), start, 7, "cpu", torch.float32))
        assert len(resumed) == 7 - start
        for k, (a, b) in enumerate(zip(resumed, straight[start:])):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"resumed at {start}: step {start + k + 1}"


def test_the_data_ranks_validation_shares_cover_the_validation_set_once_in_order():
    """Every data rank scores its own share (both scoring rank 0's was caught only by a bf16 test's tolerance)."""
    x = torch.arange(2050, dtype=torch.float64).view(-1, 1)
    y = torch.arange(2050) % 3
    ds = Dataset(x[:10], y[:10], x, y, 3)
    for size in (1, 2, 3):
        got = [c for r in range(size) for c in val_chunks(ds, ranks(size, r), "cpu", torch.float64)]
        assert torch.equal(torch.cat([a for a, _ in got]), x) and torch.equal(torch.cat([b for _, b in got]), y)


def test_normalize_standardises_images_per_channel():
    """One mean and one sample deviation per channel over (N, H, W), shaped [C, 1, 1] (per-pixel statistics
    passed: the only test used tabular inputs, where both agree)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(50, 3, 5, 5, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1, 1)
    y = torch.zeros(50, dtype=torch.long)
    mean, std = normalization_stats(Dataset(x, y, x[:5], y[:5], 2))
    assert mean.shape == std.shape == (3, 1, 1), (mean.shape, std.shape)
    per_channel = x.transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(mean.flatten(), per_channel.mean(1), rtol=1e-12, atol=0)
    torch.testing.assert_close(std.flatten(), per_channel.std(1), rtol=1e-12, atol=0)
