"""The job's seal: what keeps a process without the job's credential from steering the job
through its c10d store.

A job's store (a `TCPStore` a member hosts, `world.StoreAddress`) serves any client that reaches
its port; c10d has no access control. Its members therefore:
- seal every value they act on: a switch's decision (`vote.settle`), a change's announcement
  (`runtime.announcement`), the break reports a recovery decides from (`runtime.recovery`) and
  the plan digests (`agreement`). A sealed value is its payload with an HMAC-SHA256 over the
  store key and the payload, under a key derived from the job's credential and the job's name
  (`Seal.of`), so that a value moved to another key, or another job's, does not verify either.
  A reader verifies it and refuses one that does not (`ForgedValue`, naming the key): it is
  never acted on, and the change it belongs to is given up;
- meet under keys with a secret part, `Seal.tag(epoch)`, in every key of an epoch (`keys`):
  TCPStore cannot list its keys, so a process without the credential cannot name the key of a
  decision or an announcement to record its own first (the first one recorded stands).

What stays unsealed, because c10d cannot sign it: the counters (`store.add`: an epoch's claims
and the digest counts, `agreement`) and the process groups' rendezvous (torch's own values).
They too live under the epoch's tag, out of a forger's reach. The kill counters of
`liveshard-local --kill` (`local.faults`) are the one untagged key: a forger could only keep a
scripted test fault from happening.

What the seal does not cover: c10d's traffic is plain text, so a process that reads the job's
network traffic learns the tags, and can then overwrite or delete values there. It still cannot
seal: what it writes is refused (a denial of service), but a decision it overwrites after some
members read it leaves them apart, as the store's host dying between two reads does. Keeping
such processes off the job's network is the chart's NetworkPolicy's part (it admits only job
workers to the store's and the collectives' ports).

This module seals, opens and derives; it must not name keys (`keys` does) or decide anything.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from datetime import timedelta

from torch.distributed import Store

from .errors import ForgedValue

_MARK = "sealed:"  # a sealed value: sealed:<64 hex digits of HMAC>:<payload>
_MAC_LENGTH = 64


@dataclass(frozen=True)
class Seal:
    """The key a job's members seal and tag with; never shown (it is as good as the credential
    inside the job's store)."""

    key: bytes = field(repr=False)

    @classmethod
    def of(cls, credential: str, job: str) -> Seal:
        """The seal of job `job`: on Kubernetes from the job's token (`LIVESHARD_TOKEN`), under
        `liveshard-local` from the secret drawn for the job. The job's name goes into the key, so
        that jobs sharing a token do not share a seal. An empty credential gives a seal anyone
        who knows the job's name can forge: for members with no credential to share (tests,
        benchmarks of one machine)."""
        message = f"liveshard-store/{job}".encode()
        return cls(hmac.new(credential.encode(), message, hashlib.sha256).digest())

    def tag(self, epoch: int) -> str:
        """The secret part of every key of `epoch` (16 hex digits)."""
        return hmac.new(self.key, f"tag/{epoch}".encode(), hashlib.sha256).hexdigest()[:16]

    def seal(self, key: str, payload: str) -> str:
        """`payload` sealed for the store key `key`."""
        return f"{_MARK}{self._mac(key, payload.encode())}:{payload}"

    def open(self, key: str, value: bytes | str) -> str:
        """The payload of `value` read at `key`; `ForgedValue` if the job's seal is not on it."""
        try:
            text = value.decode() if isinstance(value, bytes) else value
        except UnicodeDecodeError:
            raise ForgedValue(key, "is not text, so not sealed") from None
        mac, sep, payload = text.removeprefix(_MARK).partition(":")
        if not text.startswith(_MARK) or not sep or len(mac) != _MAC_LENGTH:
            raise ForgedValue(key, "is not sealed")
        if not hmac.compare_digest(mac, self._mac(key, payload.encode())):
            raise ForgedValue(key, "does not carry the job's seal")
        return payload

    def _mac(self, key: str, payload: bytes) -> str:
        # The key is part of what is signed: a sealed value copied to another key is refused.
        message = b"value\0" + key.encode() + b"\0" + payload
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()


class JobStore:
    """A client of the job's store with the job's seal: sealed values in, verified values out.
    Counters and waits pass through unsealed (see the module's docstring)."""

    def __init__(self, store: Store, seal: Seal) -> None:
        self.store, self.seal = store, seal

    def __repr__(self) -> str:
        return f"JobStore({self.store!r})"

    def tag(self, epoch: int) -> str:
        return self.seal.tag(epoch)

    def put(self, key: str, payload: str) -> None:
        """Set `key` to `payload`, sealed."""
        self.store.set(key, self.seal.seal(key, payload))

    def first(self, key: str, payload: str) -> str:
        """Record `payload`, sealed, at `key` unless a value was recorded there first; the
        payload that stands (`ForgedValue` if the one recorded first is not sealed)."""
        recorded = self.store.compare_set(key, "", self.seal.seal(key, payload))
        return self.seal.open(key, recorded)

    def get(self, key: str) -> str:
        """The payload at `key`, waiting for it up to the store's timeout; `ForgedValue` if it
        is not sealed."""
        return self.seal.open(key, self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def add(self, key: str, amount: int) -> int:
        """Add to the counter at `key` (unsealed: c10d adds in place)."""
        return self.store.add(key, amount)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.store.wait(keys, timeout)
