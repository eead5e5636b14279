"""Per-sample RNG streams: the batched generators (fastload/data/rng.py) are numpy's
default_rng((seed, epoch, index)), state for state and draw for draw."""

from __future__ import annotations

import numpy as np
import pytest

from fastload.data import rng as rng_mod

EDGES = (0, 1, 2, 255, 65_536, 12_345_678, 2**31, 2**32 - 1)


def draws(g: np.random.Generator) -> tuple:
    """What the transforms draw: uniforms, bounded integers, a flip."""
    return (g.uniform(0.08, 1.0), g.uniform(-0.3, 0.3), int(g.integers(0, 97)), g.random())


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 - 1])
def test_seed_words_are_seedsequences_state(seed):
    rs = np.random.default_rng(seed)
    keys = [(e, i) for e in EDGES for i in EDGES]
    keys += [tuple(int(v) for v in rs.integers(0, 2**32, 2)) for _ in range(200)]
    got = rng_mod.seed_words(seed, [e for e, _ in keys], [i for _, i in keys])
    want = [np.random.SeedSequence((seed, e, i)).generate_state(4, np.uint64) for e, i in keys]
    assert got.dtype == np.uint64 and got.shape == (len(keys), 4)
    np.testing.assert_array_equal(got, np.stack(want))


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_batch_generators_are_default_rng_streams(seed):
    keys = [(3, i) for i in EDGES] + [5, 0, 2**32 - 1]  # bare indices: epoch 0
    got = []
    for g in rng_mod.BatchRngs()(seed, keys):
        got.append((g.bit_generator.state, draws(g)))  # used before the next key, as documented
    for (state, drawn), key in zip(got, keys, strict=True):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        ref = rng_mod.sample_rng(seed, epoch, index)
        assert state == ref.bit_generator.state, key
        assert drawn == draws(ref), key


def test_keys_outside_one_word_take_numpys_path():
    """A seed or index of 2**32 or more is several entropy words: default_rng itself."""
    for seed, keys in ((2**40, [(0, 1), (2, 3)]), (5, [(1, 2**32), (1, 4)])):
        got = [draws(g) for g in rng_mod.BatchRngs()(seed, keys)]
        assert got == [draws(rng_mod.sample_rng(seed, *k)) for k in keys]
    assert list(rng_mod.BatchRngs()(1, [])) == []


def test_the_loaders_batch_path_builds_no_per_sample_generator(monkeypatch, tiny_folder):
    """ImageDataset.load_batch draws from the batched generators (the per-item path keeps
    sample_rng); the samples are the items' (tests/test_storage.py, test_roi_decode.py)."""
    import torch

    from fastload.data import dataset as dataset_mod
    from fastload.data.transforms import RandomResizedCropFlip
    from fastload.decode.pil import PILBackend
    from fastload.storage.disk import DiskStorage

    reader = DiskStorage().open(tiny_folder, "train")
    ds = dataset_mod.ImageDataset(reader, PILBackend(), RandomResizedCropFlip(16), seed=9)
    keys = [(1, i) for i in range(4)]
    items = [ds[k] for k in keys]

    def refuse(*args):
        raise AssertionError("the batch path built a per-sample default_rng")

    monkeypatch.setattr(dataset_mod, "sample_rng", refuse)
    batch = ds.__getitems__(keys)
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(batch, items, strict=True))
