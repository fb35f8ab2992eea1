"""The block index's table: every indexed block as one row of a few flat arrays, found by open
addressing on a 64-bit key folded from its hash, and the loops over a prompt's chain or an
event's blocks compiled (numba), so that a router holds ~17 bytes a slot (load 0.53-0.8) and
looks up a 1,200-block chain in one call.

A key is the block hash's 64-bit fold (every word of it mixed in: the XXH3-128 hashes are
random, but a test's or a bench's hashes need not be). Two hashes of one key are one block to
the table: at 10^8 blocks the chance that any two of them fold alike is ~3 in 10,000, and the
cost of it a wrong prefix length for one prompt. A holder that names blocks (cachemeta: it
deletes their files) keeps each hash whole beside its key.
"""

from __future__ import annotations

import numpy as np
import xxhash
from numba import njit

EMPTY = np.uint64(0)  # a slot never used: a probe stops here
GONE = np.uint64(1)  # a slot whose block was removed: a probe goes past it
MAX_LOAD = 0.8  # slots used or gone, of all: past it the table grows
GROWTH = 1.5  # the table's size after growing, of what its live rows need at MAX_LOAD
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9], dtype=np.uint64)


def keys_of(hashes: list[str]) -> np.ndarray:
    """The 64-bit keys of hex hashes of one width (32 or 64 digits); names of any other form
    (a simulated trace's) by their XXH3-64."""
    if not hashes:
        return np.zeros(0, np.uint64)
    width = len(hashes[0])
    joined = "".join(hashes)
    try:
        if width not in (32, 64) or len(joined) != width * len(hashes):
            raise ValueError("not hex hashes of one width")
        raw = bytes.fromhex(joined)
    except ValueError:
        keys = np.fromiter(map(xxhash.xxh3_64_intdigest, hashes), np.uint64, len(hashes))
        keys[keys <= GONE] += np.uint64(2)
        return keys
    return keys_of_packed(raw, width // 2)


def keys_of_packed(raw: bytes, width: int) -> np.ndarray:
    """The 64-bit keys of hashes packed ``width`` bytes each, folded from every 8 bytes."""
    words = np.frombuffer(raw, dtype=">u8").astype(np.uint64).reshape(-1, width // 8)
    keys = words[:, 0].copy()
    for w in range(1, width // 8):
        keys ^= words[:, w] * _MIX[w - 1]
    keys[keys <= GONE] += np.uint64(2)  # (0 and 1 mark slots)
    return keys


@njit(cache=True, inline="always")
def _home(key: np.uint64, size: int) -> int:
    """A key's first slot: its bits mixed (splitmix64's finalizer), then taken mod the size."""
    z = key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.int64(z % np.uint64(size))


@njit(cache=True)
def locate(keys: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Each key's slot, -1 where it is not in the table."""
    size = keys.size
    out = np.full(q.size, -1, np.int64)
    for j in range(q.size):
        key = q[j]
        i = _home(key, size)
        while True:
            k = keys[i]
            if k == key:
                out[j] = i
                break
            if k == 0:
                break
            i += 1
            if i == size:
                i = 0
    return out


@njit(cache=True)
def claim(keys: np.ndarray, q: np.ndarray, slots: np.ndarray, new: np.ndarray) -> int:
    """Each key's slot, put in the table where it is not (the first gone or empty slot on its
    probe): ``slots`` and ``new`` filled; returns how many empty slots were taken."""
    size = keys.size
    took = 0
    for j in range(q.size):
        key = q[j]
        i = _home(key, size)
        free = -1
        while True:
            k = keys[i]
            if k == key:
                slots[j] = i
                new[j] = False
                break
            if k == 0:
                if free < 0:
                    free = i
                    took += 1
                keys[free] = key
                slots[j] = free
                new[j] = True
                break
            if k == 1 and free < 0:
                free = i
            i += 1
            if i == size:
                i = 0
    return took


@njit(cache=True)
def place(keys: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Distinct keys into a table that holds none of them (it grows): their slots."""
    size = keys.size
    out = np.empty(q.size, np.int64)
    for j in range(q.size):
        i = _home(q[j], size)
        while keys[i] != 0:
            i += 1
            if i == size:
                i = 0
        keys[i] = q[j]
        out[j] = i
    return out


@njit(cache=True)
def chain(
    keys: np.ndarray,
    where: np.ndarray,
    expires: np.ndarray,
    members: np.ndarray,
    q: np.ndarray,
    now: float,
) -> tuple[int, np.ndarray]:
    """A prompt's chain against the table: how many of its blocks from the first are indexed
    and alive at ``now`` in some location, and per location how many it holds from the first
    (-1: none). A location's run ends at the first block it does not hold."""
    size = keys.size
    n_locs = members.shape[1]
    ends = np.full(n_locs, -1, np.int64)
    running = -2  # (a location still holding every block so far)
    prev = -1
    n = 0
    for j in range(q.size):
        key = q[j]
        i = _home(key, size)
        while keys[i] != key and keys[i] != 0:
            i += 1
            if i == size:
                i = 0
        if keys[i] != key or expires[i] < now:
            break
        s = where[i]
        if s != prev:
            if prev < 0:
                for loc in range(n_locs):
                    if members[s, loc]:
                        ends[loc] = running
            else:
                left = False
                for loc in range(n_locs):
                    if ends[loc] == running:
                        if members[s, loc]:
                            left = True
                        else:
                            ends[loc] = j
                if not left:
                    break
            prev = s
        n = j + 1
    for loc in range(n_locs):
        if ends[loc] == running:
            ends[loc] = n
    return n, ends


@njit(cache=True)
def settle(
    where: np.ndarray,
    expires: np.ndarray,
    retention: np.ndarray,
    slots: np.ndarray,
    new: np.ndarray,
    start: int,
    code: int,
    flags: int,
    ttl: np.ndarray,
    at: float,
    pinned: int,
    moves: np.ndarray,
) -> int:
    """Rows just claimed for a "stored" event, from ``start``: new ones made blank with the
    event's class; the longer-lived class kept (a row's last use read back from its end);
    each row lives until ``at`` plus its class's TTL, or its pin, if later (never less than
    it did); its location set moved by ``moves`` (set id → with the event's location).
    Returns where it stopped: a set whose move is not known yet (-1 in ``moves``; the
    caller adds it and goes on from there), or the end."""
    for j in range(start, slots.size):
        i = slots[j]
        if new[j]:
            where[i] = 0
            expires[i] = 0
            retention[i] = code | flags
        held = retention[i] & 1
        if ttl[code] > ttl[held]:
            last = np.float64(expires[i]) - ttl[held]
            expires[i] = np.uint32(min(max(last + ttl[code], 0.0), 4294967295.0))
            retention[i] = code | flags
        end = max(np.ceil(at + ttl[retention[i] & 1]), np.float64(pinned))
        end = min(end, 4294967295.0)
        if end > expires[i]:
            expires[i] = np.uint32(end)
        to = moves[where[i]]
        if to < 0:
            return j
        where[i] = to
    return slots.size


def warm() -> None:
    """Compile (or load from numba's cache) every loop above, on a table of a few rows: a
    process calls this before it serves, off its event loop (a first compile takes ~1 s)."""
    keys = np.zeros(16, np.uint64)
    q = keys_of_packed(bytes(range(32)), 16)
    slots, new = np.empty(q.size, np.int64), np.empty(q.size, np.bool_)
    claim(keys, q, slots, new)
    locate(keys, q)
    place(np.zeros(16, np.uint64), q)
    small = np.zeros(16, np.uint32)
    settle(small, small.copy(), np.zeros(16, np.uint8), slots, new, 0, 0, 0,
           np.ones(2), 0.0, 0, np.zeros(4, np.int32))  # fmt: skip
    chain(keys, small, small, np.zeros((2, 2), np.bool_), q, 0.0)
