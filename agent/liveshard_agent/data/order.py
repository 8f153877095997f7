"""Which tokens a global sample index trains on: sample addressing and the per-epoch order.

With `S = seq_len` and a stream of `N` tokens there are `n = (N - 1) // S` samples. Sample `j`
is the `S + 1` tokens `tokens[j*S : j*S + S + 1]` (positions `j*S` to `j*S + S` inclusive): the
first `S` are the inputs and the last `S` the targets, so consecutive samples share one token
and every token but the last `(N - 1) % S` is a target exactly once per epoch.

A job addresses samples by a global index `i >= 0` (the data cursor: step `s` trains on
`s * global_batch ..`). Index `i` is in epoch `e = i // n` at position `p = i % n`, and trains on
sample `j`:

- `sequential`: `j = p`;
- `shuffled`: `j = perm(seed, e, p)`, a bijection of `range(n)` for each `(seed, e)`, computed
  per index in O(1) memory (no table), so any index of any epoch is found directly.

`perm`, exactly (all arithmetic on unsigned 64-bit integers, wrapping modulo 2^64; `^` xor,
`>>`/`<<` shifts, `&` and):

    G = 0x9E3779B97F4A7C15
    mix(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
             z = (z ^ (z >> 27)) * 0x94D049BB133111EB
             return z ^ (z >> 31)                    # splitmix64's finalizer
    K      = mix(mix((seed mod 2^64) + G) + e)       # the epoch's key
    k[r]   = mix(K + (r + 1) * G)   for r = 0 .. 5   # six round keys
    b      = max(2, bit_length(n - 1))               # 2^b: the smallest power of two >= n (>= 4)
    F(x):  w = b // 2
           for r = 0 .. 5:                           # an unbalanced Feistel network on b bits
               R = x & (2^w - 1);  L = x >> w
               x = (R << (b - w)) | ((L ^ mix(R ^ k[r])) & (2^(b - w) - 1))
               w = b - w
           return x
    perm(seed, e, p):  y = F(p); while y >= n: y = F(y); return y    # cycle walking

Each round is invertible (its output's high `w` bits are `R`, its low bits give back `L`), so `F`
permutes `range(2^b)`, and cycle walking restricts it to a permutation of `range(n)` (fewer than
four steps per index on average, since `2^b < 4n`). This module is pure numpy; it reads tokens
only through `windows`.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Protocol

import numpy as np

from liveshard_core.errors import InvalidInput


class Tokens(Protocol):
    """A token stream: a prepared directory (`tokens.TokenStream`), or the bytes of a text."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def directory(self) -> Path | str: ...  # named in errors

    def __len__(self) -> int: ...


ROUNDS = 6
_G = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class Order(StrEnum):
    """How samples are ordered within an epoch."""

    SEQUENTIAL = "sequential"
    SHUFFLED = "shuffled"


def sample_count(stream: Tokens, seq_len: int) -> int:
    """`n = (N - 1) // seq_len`, the number of samples of the stream; at least one."""
    if seq_len < 1:
        raise InvalidInput(f"seq_len={seq_len}: must be at least 1")
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise InvalidInput(
            f"{stream.directory}: corpus shorter than one sample: {len(stream)} tokens, and a "
            f"sample of seq_len={seq_len} needs {seq_len + 1}"
        )
    return n


def sample_ids(order: Order | str, seed: int, n: int, first: int, count: int) -> np.ndarray:
    """The stream sample ids (int64 `[count]`) of global sample indices `first .. first+count-1`
    (see the module docstring for the formula)."""
    mode = _order(order)
    if n < 1:
        raise InvalidInput(f"n={n}: corpus shorter than one sample")
    if first < 0 or count < 0:
        raise InvalidInput(f"first={first}, count={count}: both must be >= 0")
    indices = np.arange(first, first + count, dtype=np.int64)
    positions = indices % n
    if mode is Order.SEQUENTIAL:
        return positions
    return _permute(positions.astype(np.uint64), _round_keys(seed, indices // n), n)


def windows(stream: Tokens, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """The samples `ids` of the stream: int64 `[len(ids), seq_len + 1]`, row `r` the tokens
    `ids[r]*seq_len .. ids[r]*seq_len + seq_len`."""
    n = sample_count(stream, seq_len)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise InvalidInput(f"{stream.directory}: sample {bad} is not in [0, {n})")
    out = np.empty((ids.size, seq_len + 1), dtype=np.int64)
    # One contiguous slice per row: reads only the pages of the samples, no index array.
    for row, start in enumerate((ids * seq_len).tolist()):
        out[row] = stream.tokens[start : start + seq_len + 1]
    return out


def _order(order: Order | str) -> Order:
    try:
        return Order(order)
    except ValueError:
        valid = [o.value for o in Order]
        raise InvalidInput(f"order={order!r}: must be one of {valid}") from None


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = z ^ (z >> np.uint64(31))
    return mixed


def _round_keys(seed: int, epochs: np.ndarray) -> np.ndarray:
    """`k[r]` for each index's epoch: uint64 `[ROUNDS, len(epochs)]`."""
    base = _mix(np.array([(seed + _G) & _MASK64], dtype=np.uint64))
    epoch_keys = _mix(base + epochs.astype(np.uint64))
    steps = (np.arange(1, ROUNDS + 1, dtype=np.uint64) * np.uint64(_G))[:, None]
    return _mix(epoch_keys[None, :] + steps)


def _feistel(x: np.ndarray, keys: np.ndarray, bits: int) -> np.ndarray:
    w = bits // 2
    for r in range(ROUNDS):
        rest = bits - w
        right = x & np.uint64((1 << w) - 1)
        left = x >> np.uint64(w)
        mixed = (left ^ _mix(right ^ keys[r])) & np.uint64((1 << rest) - 1)
        x = (right << np.uint64(rest)) | mixed
        w = rest
    return x


def _permute(positions: np.ndarray, keys: np.ndarray, n: int) -> np.ndarray:
    bits = max(2, (n - 1).bit_length())
    out = _feistel(positions, keys, bits)
    pending = np.flatnonzero(out >= np.uint64(n))
    while pending.size:
        walked = _feistel(out[pending], keys[:, pending], bits)
        out[pending] = walked
        pending = pending[walked >= np.uint64(n)]
    return out.astype(np.int64)
