"""Per-sample random streams: `sample_rng(seed, epoch, index)` and its batched twin.

Every sample draws its augmentation from its own generator, a function of (seed, epoch,
index) only (why: fastload/data/transforms.py), numpy's `default_rng((seed, epoch, index))`.
Building one costs ~7-15 us (SeedSequence hashing in Python-level Cython, a PCG64, a
Generator): ~10 % of a raw-pixel sample's whole CPU time. `BatchRngs` gives the very same
streams for a batch of keys at ~3 us each: the SeedSequence hash of all keys at once in
numpy (uint32 arithmetic, vectorised over the batch), PCG64's seeding in Python integers,
and one reused Generator whose state is set per sample.

The reproduction follows numpy's SeedSequence (pool of 4 uint32 words, entropy = the three
integers as one uint32 word each) and PCG64's `pcg64_set_seed`; tests/test_rng.py checks
the states and the draws against numpy over edge values. Keys outside what it reproduces
(a negative value, or one of 2**32 or more: several entropy words) get `sample_rng`.
"""

from __future__ import annotations

import threading

import numpy as np

# numpy/random/bit_generator.pyx (SeedSequence).
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT, _MASK32, _POOL = 16, 0xFFFFFFFF, 4
# numpy/random/src/pcg64/pcg64.h: PCG_DEFAULT_MULTIPLIER_128.
_PCG_MULT, _MASK128 = 0x2360ED051FC65DA44385DF649FCCF645, (1 << 128) - 1


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The RNG of one sample in one epoch; see fastload/data/transforms.py for why."""
    return np.random.default_rng((seed, epoch, index))


def _hash_consts(init: int, mult: int, n: int) -> list[int]:
    """The hash constant after each of n steps (it does not depend on the data)."""
    out, c = [], init
    for _ in range(n):
        out.append(c)
        c = (c * mult) & _MASK32
    return out


# hashmix XORs with the constant, then multiplies by the constant times MULT_A: the first
# is _A[k], the second _A[k + 1]. mix_entropy makes 4 + 12 hashmix calls. Columns, to
# broadcast over a batch's keys.
_A = np.array(_hash_consts(_INIT_A, _MULT_A, 17), np.uint32)[:, None]
_B = np.array(_hash_consts(_INIT_B, _MULT_B, 9), np.uint32)[:, None]


def seed_words(seed: int, epochs, indices) -> np.ndarray:
    """`SeedSequence((seed, epoch, index)).generate_state(4, np.uint64)` for every pair at
    once: (n, 4) uint64. Every value must be in [0, 2**32). Each step works on whole rows
    of the (4, n) pool: numpy's per-call overhead, not the arithmetic, is the cost here."""
    n = len(indices)
    u32, shift = np.uint32, np.uint32(_XSHIFT)
    pool = np.empty((_POOL, n), u32)
    pool[0], pool[1], pool[2], pool[3] = seed, epochs, indices, 0  # entropy padded with a 0
    a, b = _A, _B
    with np.errstate(over="ignore"):
        # hashmix k: (value ^ A[k]) * A[k + 1], then xor-shift. Calls 0-3 hash the entropy.
        pool = (pool ^ a[0:4]) * a[1:5]
        pool ^= pool >> shift
        k = 4
        for src in range(_POOL):  # every other word mixed with hashmix(pool[src])
            dst = [d for d in range(_POOL) if d != src]
            h = (pool[src] ^ a[k : k + 3]) * a[k + 1 : k + 4]
            h ^= h >> shift
            k += 3
            r = u32(_MIX_MULT_L) * pool[dst] - u32(_MIX_MULT_R) * h  # the 3 mixes are
            pool[dst] = r ^ (r >> shift)  # independent: each reads its own word and pool[src]
        words = (pool[[0, 1, 2, 3, 0, 1, 2, 3]] ^ b[0:8]) * b[1:9]  # generate_state(8)
        words ^= words >> shift
    words = words.astype(np.uint64)
    return (words[0::2] | (words[1::2] << np.uint64(32))).T  # little-endian uint32 pairs


def pcg64_state(words) -> tuple[int, int]:
    """PCG64's (state, inc) after `pcg64_set_seed(seed=words[0:2], inc=words[2:4])`."""
    initstate = (int(words[0]) << 64) | int(words[1])
    inc = (((int(words[2]) << 64) | int(words[3])) << 1 | 1) & _MASK128
    state = (inc + initstate) & _MASK128  # step from 0 (0 * mult + inc), add initstate
    return (state * _PCG_MULT + inc) & _MASK128, inc  # and step once more


class BatchRngs:
    """The generators of a batch's keys ((epoch, index) pairs or indices of epoch 0), the
    streams `sample_rng` gives, one at a time. They are ONE Generator re-seeded per key:
    use each before taking the next (a sample draws its box and flip, then is done)."""

    def __init__(self):
        self.bitgen = np.random.PCG64()
        self.generator = np.random.Generator(self.bitgen)

    def __call__(self, seed: int, keys: list):
        pairs = [k if isinstance(k, tuple) else (0, k) for k in keys]
        epochs = np.array([int(e) for e, _ in pairs], np.int64)
        indices = np.array([int(i) for _, i in pairs], np.int64)
        inside = (
            0 <= seed < 2**32
            and len(pairs) > 0
            and epochs.min() >= 0
            and indices.min() >= 0
            and max(epochs.max(), indices.max()) < 2**32
        )
        if not inside:
            for e, i in pairs:
                yield sample_rng(seed, int(e), int(i))
            return
        for words in seed_words(seed, epochs, indices).tolist():
            state, inc = pcg64_state(words)
            self.bitgen.state = {
                "bit_generator": "PCG64",
                "state": {"state": state, "inc": inc},
                "has_uint32": 0,
                "uinteger": 0,
            }
            yield self.generator


_LOCAL = threading.local()


def batch_rngs(seed: int, keys: list):
    """`BatchRngs()(seed, keys)` with this thread's BatchRngs (a Generator is not safe to
    share between threads, and a loader may load batches in several)."""
    rngs = getattr(_LOCAL, "rngs", None)
    if rngs is None:
        rngs = _LOCAL.rngs = BatchRngs()
    return rngs(seed, keys)
