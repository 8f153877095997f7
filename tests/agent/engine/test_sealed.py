"""The job's seal on what members act on in the store, and the secret part of its keys: values
sealed with one credential open only with it, at their own key; nothing else is acted on.

The switch tests run a one-member switch in this process over a real `TCPStore`, with values a
process without the job's credential could write put there first.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="the transfer engine needs torch (the agent extra)")

from torch.distributed import TCPStore  # noqa: E402

from liveshard_agent.engine import keys  # noqa: E402
from liveshard_agent.engine.errors import Cause, DecisionUnknown, ForgedValue  # noqa: E402
from liveshard_agent.engine.sealed import JobStore, Seal  # noqa: E402
from liveshard_agent.engine.state import ShardedState  # noqa: E402
from liveshard_agent.engine.switch import Reconfiguration, SwitchHooks  # noqa: E402
from liveshard_agent.engine.vote import Failure, settle  # noqa: E402
from liveshard_agent.local.launcher import LocalJob, local_config  # noqa: E402
from liveshard_core.job import Deadlines, TrainingSettings  # noqa: E402
from liveshard_core.layout.layout import Degrees, Layout  # noqa: E402
from liveshard_core.vps.presets import preset  # noqa: E402

TOKEN = "the job's token"
SEAL = Seal.of(TOKEN, "job")
KEY = keys.decision(3, SEAL.tag(3))
CPU = torch.device("cpu")
TINY = preset("tiny")
SOLO = Layout.create(TINY, ["m0"])


def tcp_store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)


def refused(value: bytes | str, key: str = KEY) -> str:
    with pytest.raises(ForgedValue, match=re.escape(repr(key))) as err:
        SEAL.open(key, value)
    assert err.value.key == key and err.value.cause is Cause.VOTE_INCOMPLETE
    return str(err.value)


def test_a_sealed_value_opens_only_with_its_credential_its_job_and_its_key() -> None:
    sealed = SEAL.seal(KEY, '{"commit": true}')
    assert SEAL.open(KEY, sealed) == SEAL.open(KEY, sealed.encode()) == '{"commit": true}'
    assert "does not carry the job's seal" in refused(sealed.replace("true", "false"))
    assert "does not carry" in refused(Seal.of("another token", "job").seal(KEY, "{}"))
    assert "does not carry" in refused(Seal.of(TOKEN, "another job").seal(KEY, "{}"))
    assert "does not carry" in refused(SEAL.seal(keys.decision(4, SEAL.tag(4)), "{}"))
    mac = sealed.split(":")[1]
    assert "does not carry" in refused(sealed.replace(mac, mac[::-1]))
    assert "is not sealed" in refused('{"commit": true}')  # written raw
    assert "is not sealed" in refused(sealed[:20])
    assert "is not text" in refused(b"\xff\xfe")


def test_tags_and_so_keys_differ_between_credentials_jobs_and_epochs() -> None:
    tags = {
        Seal.of(token, job).tag(epoch)
        for token in ("a", "b", "")
        for job in ("job", "other")
        for epoch in (1, 2)
    }
    assert len(tags) == 12 and all(re.fullmatch("[0-9a-f]{16}", t) for t in tags)
    assert Seal.of("a", "job").tag(1) == Seal.of("a", "job").tag(1)  # every member's the same
    a, b = Seal.of("a", "job"), Seal.of("b", "job")
    assert keys.decision(1, a.tag(1)) != keys.decision(1, b.tag(1))
    with pytest.raises(ValueError, match="tag=''"):
        keys.decision(1, "")


def test_neither_the_seal_nor_the_local_secret_shows_in_a_repr() -> None:
    store = JobStore(tcp_store(), SEAL)
    assert SEAL.key.hex() not in repr(SEAL) and SEAL.key.hex() not in repr(store)
    job = LocalJob(
        config=local_config("tiny", TrainingSettings(steps=2)), nprocs=1, layout=Degrees(),
        switches=(),
    )  # fmt: skip
    assert len(job.secret) == 64 and job.secret not in repr(job)
    other = LocalJob(config=job.config, nprocs=1, layout=Degrees(), switches=())
    assert other.secret != job.secret and other.seal().tag(1) != job.seal().tag(1)


def test_the_first_sealed_decision_stands_and_one_without_the_seal_is_never_acted_on() -> None:
    store = JobStore(tcp_store(), SEAL)
    assert settle(store, 3, None) is None  # a commit, recorded
    assert settle(store, 3, Failure(Cause.VOTE_NO, "late")) is None  # the commit stands
    # A decision without the seal recorded first, saying commit.
    key = keys.decision(4, SEAL.tag(4))
    store.store.set(key, json.dumps({"commit": True}))
    # It is never acted on: read as no decision at all, naming the key, whatever was proposed
    # (a forger may have overwritten a decision that some members read already).
    for proposal in (None, Failure(Cause.VOTE_NO, "mine")):
        with pytest.raises(DecisionUnknown, match="is not sealed") as unknown:
            settle(store, 4, proposal)
        assert key in str(unknown.value)


def solo(store: TCPStore, epoch: int, hooks: SwitchHooks | None = None) -> Reconfiguration:
    return Reconfiguration(
        spec=TINY, old=SOLO, new=SOLO, member="m0", store=store, epoch=epoch, device=CPU,
        budget=1 << 20, deadlines=Deadlines(5, 10, 20), job="job", hooks=hooks,
        seal=Seal.of(TOKEN, "job"),
    )  # fmt: skip


def switch(store: TCPStore, epoch: int, hooks: SwitchHooks | None = None) -> tuple[bool, str]:
    reconfig = solo(store, epoch, hooks)
    reconfig.prepare()
    state = ShardedState.seeded(TINY, SOLO, 0, 3, CPU)
    result = reconfig.switch(state)
    assert result.state is not None and result.state.matches_seed(3) == []
    return result.committed, result.reason


def test_a_switch_acts_on_no_decision_without_the_seal() -> None:
    store = tcp_store()
    forged = {"cause": Cause.VOTE_NO.value, "reason": "forged"}
    # Where a process without the credential can write: the keys' untagged names, first.
    for epoch in (1, 2, 3):
        store.set(f"liveshard/{epoch}/decision", json.dumps(forged))
        store.set(f"liveshard/{epoch}/announce", json.dumps({"abort": "forged"}))
        store.add(f"liveshard/{epoch}/claimed/m0", 1)
    assert switch(store, 1) == (True, "epoch 1: committed")

    # At the true key, first, sealed by another credential: an abort, refused, is not the
    # decision (its reason is not taken): a member that voted yes is undecided, both states
    # whole, until told; a commit, refused, does not overrule a no.
    key = keys.decision(2, SEAL.tag(2))
    store.set(key, Seal.of("another token", "job").seal(key, json.dumps(forged)))
    reconfig = solo(store, 2)
    reconfig.prepare()
    state = ShardedState.seeded(TINY, SOLO, 0, 3, CPU)
    result = reconfig.switch(state)
    assert result.undecided and key in result.reason and "forged" not in result.reason
    told = reconfig.resolve(False, "no member read a commit")
    assert not told.committed and told.state is state and state.matches_seed(3) == []

    key = keys.decision(3, SEAL.tag(3))
    store.set(key, Seal.of("another token", "job").seal(key, json.dumps({"commit": True})))

    def refuse() -> None:
        raise RuntimeError("m0 votes no")

    committed, reason = switch(store, 3, SwitchHooks(before_vote=refuse))
    assert not committed and "m0 votes no" in reason
