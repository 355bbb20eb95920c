"""The block pool's prefix-cache map: registrations kept by chain root until looked up answer exactly as if applied."""

from __future__ import annotations

import random

import numpy as np

from kernelsight.simcore.block_pool import BlockPool

_MASK = (1 << 64) - 1


def _chain(prefix: tuple[int, ...]) -> list[int]:
    """Nonzero chained keys of a token-block sequence (equal keys mean equal prefixes)."""
    return [(hash(prefix[:i + 1]) & _MASK) | 1 for i in range(len(prefix))]


def _drive(pool: BlockPool, lazy: bool, seed: int, rounds: int) -> tuple[list, list[int], int]:
    """Requests over a few shared prefixes: walk the chain from its root, take the hits, allocate the rest and register
    it in one or two chunks (sometimes twice over, as a second request computing the same prefix at once does), free
    some. Returns every lookup's answer, the map's size (pending keys included) after each round, and the sweeps."""
    rng = random.Random(seed)
    families = [tuple(rng.randrange(5) for _ in range(12)) for _ in range(6)]
    live: list[tuple[list[int], float]] = []
    answers: list = []
    sizes: list[int] = []
    sweeps = 0
    for _ in range(rounds):
        fam = families[rng.randrange(len(families))]
        cut = rng.randrange(1, len(fam))
        blocks_seq = fam[:cut] + tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 9)))
        keys = _chain(blocks_seq)
        hits = []
        for h in keys:                     # a prefix-cache query walks from the root
            b = pool.lookup(h)
            answers.append(b)
            if b is None:
                break
            hits.append(b)
        need = len(keys) - len(hits)
        while need + sum(1 for b in hits if pool.ref_cnt[b] == 0) > pool.num_free_blocks and live:
            blocks, _ = live.pop(rng.randrange(len(live)))
            pool.release(blocks[::-1])
        if need + sum(1 for b in hits if pool.ref_cnt[b] == 0) > pool.num_free_blocks:
            continue
        if hits:
            pool.touch(hits)
        new = pool.allocate(need)
        owner = int(rng.random() * 2**53)      # an id: the draw as before, as an int (a compiled pool's owner type)
        start = len(hits)
        split = start + rng.randrange(need + 1)
        before = len(pool.cached)
        as_arrays = lazy and len(sizes) % 2 == 1   # a prompt's blocks and hashes handed over as arrays
        for lo, hi in ((start, split), (split, len(keys))):
            if hi > lo and as_arrays:
                pool.register(None, None, keys[0], owner, lo, np.array(keys[lo:hi], dtype=np.uint64),
                              np.array(new[lo - start:hi - start], dtype=np.int64))
            elif hi > lo:
                pool.register(new[lo - start:hi - start], keys[lo:hi], keys[0] if lazy else None, owner, lo)
        if rng.random() < 0.1 and need:    # the same keys registered again by another request
            pool.register(new[:1], keys[start:start + 1], keys[0] if lazy else None, -2, start)
        if len(pool.cached) < before:
            sweeps += 1
        live.append((hits + new, owner))
        if rng.random() < 0.5:
            blocks, _ = live.pop(rng.randrange(len(live)))
            pool.release(blocks[::-1])
        sizes.append(len(pool.cached) + pool._num_pending)
    return answers, sizes, sweeps


def test_lazy_registration_answers_as_eager_registration_through_sweeps():
    eager = _drive(BlockPool(24), lazy=False, seed=7, rounds=3000)
    lazy = _drive(BlockPool(24), lazy=True, seed=7, rounds=3000)
    assert eager[2] >= 2, "the stale-entry sweep must run for the test to mean something"
    assert lazy[0] == eager[0]              # every lookup's answer, hits and misses
    assert lazy[1] == eager[1]              # so the sweep runs at the same moments


def test_a_root_nobody_looked_up_stays_out_of_the_map_until_it_is():
    pool = BlockPool(8)
    keys = _chain((1, 2, 3))
    blocks = pool.allocate(3)
    pool.register(blocks, keys, keys[0], 1, 0)
    assert pool.cached == {}
    assert pool.lookup(keys[0]) == blocks[0]
    assert [pool.lookup(h) for h in keys[1:]] == blocks[1:]
    assert len(pool.cached) == 3 and pool._num_pending == 0
