"""Counter-based randomness: values that are a function of (seed, keys, index), never of a rank.

Every random value of training (parameter init, dropout masks, the data order) is computed from a
hash of its coordinates: the seed, what it is for (a tensor's name, a step, a sample, a layer) and
its global index. A layout change therefore cannot change a random value: the same sample in the
same layer of the same step gets the same dropout mask whichever rank computes it, and any rank
can compute any box of an initial parameter. The hash is a 32-bit integer mixer evaluated in int64
tensors (every product stays below 2**63, so nothing overflows).
"""

from __future__ import annotations

import zlib
from typing import TypeVar

import torch

T = TypeVar("T", int, torch.Tensor)

_MASK = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # a well-mixing odd constant below 2**31


def _mix(x: T) -> T:
    """One round of a 32-bit avalanche mixer, on Python ints or int64 tensors below 2**32."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    return (x >> 16) ^ x


def key(*parts: int | str) -> int:
    """A 32-bit key for a tuple of integers and strings (strings by CRC-32)."""
    h = 0x9E3779B9
    for part in parts:
        value = zlib.crc32(part.encode()) if isinstance(part, str) else int(part) & _MASK
        h = _mix(h ^ value)
    return h


def hashed(base: int, *indices: torch.Tensor) -> torch.Tensor:
    """32-bit hashes of `base` combined with each element of the broadcast `indices` (int64
    tensors of non-negative values below 2**32), one index after the other."""
    h = torch.full((), base, dtype=torch.int64, device=indices[0].device if indices else "cpu")
    for index in indices:
        h = _mix(h ^ (index & _MASK))
    return h


def uniform(base: int, *indices: torch.Tensor) -> torch.Tensor:
    """Floats in [0, 1) from `hashed`, float32."""
    return hashed(base, *indices).to(torch.float32) * (1.0 / 2**32)
