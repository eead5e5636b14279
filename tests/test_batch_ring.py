"""loader.reuse_batch_memory: workers stack batches into reused shared-memory slots; what the
consumer gets is identical to torch's path, and a batch it keeps is never overwritten."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import build_test_loader, make_image_folder

import fastload.loaders.batch_ring as ring_mod
import fastload.torch_internals as internals


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("ring") / "d", per_split=(8, 1))


def build(folder, *overrides, batch_size=2, workers=2):
    """loader=baseline from the real config; normalize_on=cpu hands the consumer the host
    batch itself (device prep on the CPU neither copies nor converts it)."""
    return build_test_loader(
        "loader=baseline",
        f"loader.num_workers={workers}",
        "loader.normalize_on=cpu",
        "loader.persistent_workers=false",
        *overrides,
        folder=folder,
        batch_size=batch_size,
        channels_last=True,  # the host batch's own layout: device prep keeps it as it is
    )


def run_epoch(loader, epoch, clone=False):
    """The epoch's (image, target) pairs: the batches themselves, or copies taken as they
    come (so each batch is dropped before the next one arrives)."""
    loader.set_epoch(epoch)
    if clone:
        return [(b["image"].clone(), b["target"]) for b in loader]
    return [(b["image"], b["target"]) for b in loader]


@pytest.fixture(scope="module")
def reference(folder):
    """torch's own path (a new shared segment per batch), epochs 0-2, cloned."""
    loader = build(folder, "loader.reuse_batch_memory=false")
    assert loader.slots is None
    return [run_epoch(loader, e, clone=True) for e in range(3)]


def assert_same(got, want):
    assert len(got) == len(want)
    for (x, y), (rx, ry) in zip(got, want, strict=True):
        assert torch.equal(y, ry) and torch.equal(x, rx)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_ring_batches_equal_torchs_path(folder, reference, context):
    loader = build(folder, "trainer.epochs=2")  # the stream plans exactly these two epochs
    loader.dataloader.multiprocessing_context = context
    for e in range(2):
        assert_same(run_epoch(loader, e, clone=True), reference[e])
    stats = loader.ring_stats()
    assert stats["ring_hits"] == 2 * len(reference[0]) and stats["ring_misses"] == 0
    assert loader.batch_ring is None  # non-persistent workers: the slots go with them


def test_kept_batches_are_never_overwritten(folder, reference):
    # one set of slots throughout; one stream per epoch, so hits can be counted per epoch
    loader = build(folder, "loader.persistent_workers=true", "loader.cross_epoch=false")
    held = run_epoch(loader, 0)  # 12 batches kept: more than the 8 slots
    ring = loader.batch_ring
    assert len(held) > ring.num_workers * ring.slots
    assert any(
        x.untyped_storage().data_ptr() == s.data_ptr() for x, _ in held for s in ring.storages
    )
    assert ring.stats()["ring_misses"] > 0  # full slots fell back to fresh segments
    run_epoch(loader, 1)  # workers run on while every slot is held
    assert_same(held, reference[0])
    del held
    before = ring.stats()["ring_hits"]
    assert_same(run_epoch(loader, 2, clone=True), reference[2])
    assert ring.stats()["ring_hits"] - before == len(reference[2])  # slots came back
    loader.close()


def test_batches_kept_past_the_epoch_outlive_its_slots(folder, reference):
    """Non-persistent workers, one stream per epoch: the slots are dropped after each epoch,
    the batches are not."""
    loader = build(folder, "loader.cross_epoch=false")
    held = run_epoch(loader, 0)
    assert loader.batch_ring is None
    run_epoch(loader, 1)
    assert_same(held, reference[0])


def test_a_numpy_view_of_one_image_keeps_its_slot(folder, reference):
    loader = build(folder)
    it = iter(run_epoch(loader, 0))
    x, _ = next(it)
    kept = x[1].numpy()  # the only reference left to that slot
    want = reference[0][0][0][1].numpy().copy()
    del x, it
    run_epoch(loader, 1)
    run_epoch(loader, 2)
    assert np.array_equal(kept, want)


def test_abandoned_epoch_with_persistent_workers_leaves_no_slot_behind(folder, reference):
    # epoch 1 is the run's last: its stream ends there and nothing is in flight afterwards
    loader = build(folder, "loader.persistent_workers=true", "trainer.epochs=2")
    loader.set_epoch(0)
    for _ in loader:
        break
    assert_same(run_epoch(loader, 1, clone=True), reference[1])
    state = loader.batch_ring.state
    assert int((state == ring_mod.WORKER).sum()) == 0
    loader.close()


def test_without_storage_use_counts_the_consumer_gets_a_private_copy(monkeypatch):
    ring = ring_mod.BatchRing(num_workers=1, slots=2, slot_bytes=64)
    ring._tensor(0, 1, (4, 4), (4, 1), torch.uint8).fill_(7)
    ring.state[0, 1] = ring_mod.WORKER
    ref = ring_mod.RingSlot(0, 1, (4, 4), (4, 1), torch.uint8)
    monkeypatch.setattr(internals, "_use_count", None)
    out = ring.resolve(ref)
    assert out.untyped_storage().data_ptr() != ring.storages[1].data_ptr()
    assert torch.equal(out, torch.full((4, 4), 7, dtype=torch.uint8))
    assert int(ring.state[0, 1]) == ring_mod.FREE


def test_short_dev_shm_falls_back_to_torchs_path_with_a_warning(folder, monkeypatch, caplog):
    monkeypatch.setattr(ring_mod, "shm_bytes", lambda: (64 * 2**20, 64 * 2**10))
    loader = build(folder, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        assert len(run_epoch(loader, 0)) == 6
    assert loader.batch_ring is None and loader.ring_stats()["ring_hits"] == 0
    assert "reuse_batch_memory" in caplog.text and "--shm-size" in caplog.text


def test_torchs_pin_thread_resolves_ring_slots_through_their_hook():
    """With pin_memory the DataLoader's own pin thread copies each slot out (RingSlot's
    pin_memory hook), off the training thread, as it pinned every batch before."""
    import gc

    from torch.utils.data._utils.pin_memory import pin_memory

    ring = ring_mod.BatchRing(num_workers=1, slots=2, slot_bytes=64)
    ref = ring_mod.RingSlot(0, 1, (4, 4), (4, 1), torch.uint8, ring.token)
    ring.resolve = lambda r, pin_memory: ("copied", r, pin_memory)  # pinning needs a GPU
    batch = pin_memory({"image": ref, "target": [1, 2]})
    assert batch["image"] == ("copied", ref, True)
    del ring, batch
    gc.collect()
    assert ref.pin_memory() is ref  # its ring is gone: nothing to resolve against


def test_worker_targets_travel_inline_not_as_shared_tensors():
    """A worker's batch with a ring carries its targets as an InlineArray: pickled as bytes,
    with no shared-memory segment (torch passes a tensor's fd over a new connection per
    tensor, ~350 us of CPU per batch), and the host stage turns it back into int64 targets."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the reductions workers use)

    from fastload.data.batch import TARGET, collate
    from fastload.loaders.transport import InlineArray

    ring = ring_mod.BatchRing(num_workers=1, slots=1, slot_bytes=64)
    samples = [(torch.zeros(3, 2, 2, dtype=torch.uint8), t) for t in (3, 1, 4)]
    batch = collate(samples, ring=ring)
    assert isinstance(batch[TARGET], InlineArray)
    assert b"rebuild_storage" not in bytes(ForkingPickler.dumps(batch[TARGET]))
    assert b"rebuild_storage" in bytes(ForkingPickler.dumps(torch.tensor([3, 1, 4])))
    got = ring.resolve_batch(batch)[TARGET]
    assert got.dtype == torch.int64 and got.tolist() == [3, 1, 4]
    assert collate(samples)[TARGET].tolist() == [3, 1, 4]  # no ring (main process): a tensor


@pytest.mark.cuda
def test_pinned_path_copies_each_slot_out_at_once(folder, reference):
    """With pin_memory the slot is copied into pinned memory (the pin thread's copy) and is
    free again before the consumer sees the batch."""
    # one stream per epoch: with cross_epoch the next epoch's first batches would count too
    loader = build(folder, "loader.pin_memory=true", "loader.cross_epoch=false")
    loader.set_epoch(0)
    got = []
    for b in loader.host_batches():
        ring = loader.batch_ring
        assert ring.slots == loader.prefetch_factor + 1
        x = b["image"]
        assert x.is_pinned() and b["target"].is_pinned()  # the targets' InlineArray hook too
        assert all(x.untyped_storage().data_ptr() != s.data_ptr() for s in ring.storages)
        assert int((ring.state == ring_mod.CONSUMER).sum()) == 0
        got.append((x.clone(), b["target"]))
    assert_same(got, reference[0])
    assert loader.ring_stats() == {"ring_hits": len(reference[0]), "ring_misses": 0}


def test_a_stream_without_slots_still_sends_its_targets_inline():
    """No room for slots in /dev/shm: the workers stack each batch into a segment of its
    own, and the targets still travel inside the batch's pickle. A tensor would be moved to
    shared memory by the worker's queue feeder thread, where a full /dev/shm fails without
    reaching the main process: the batch is lost and the run waits forever."""
    from fastload.data.batch import IMAGE, TARGET, collate
    from fastload.loaders.transport import InlineArray, SlotCollate, resolve_inline

    slots = ring_mod.LoaderSlots(num_workers=1, slots=1, slot_bytes=64)  # never opened
    assert slots.ring is None
    samples = [(torch.zeros(3, 2, 2, dtype=torch.uint8), t) for t in (3, 1, 4)]
    batch = SlotCollate(collate, slots)(samples)
    assert isinstance(batch[TARGET], InlineArray) and torch.is_tensor(batch[IMAGE])
    got = resolve_inline(batch)
    assert got[TARGET].dtype == torch.int64 and got[TARGET].tolist() == [3, 1, 4]
