"""Single-process tests of the runtime's pieces: data order, randomness, settings, scalars, the
loop's store connects."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch (the agent extra)")

from liveshard_agent.data.corpus import builtin_corpus  # noqa: E402
from liveshard_agent.engine.world import StoreAddress, host_store  # noqa: E402
from liveshard_agent.runtime import rng  # noqa: E402
from liveshard_agent.runtime.change import Change  # noqa: E402
from liveshard_agent.runtime.data import Dataset, job_dataset, load_corpus  # noqa: E402
from liveshard_agent.runtime.loop import _CONNECT_GRACE, Prepare, Stop, _Stores  # noqa: E402
from liveshard_agent.runtime.model import dropout_keep  # noqa: E402
from liveshard_agent.runtime.optimizer import Optimizer  # noqa: E402
from liveshard_agent.runtime.trainer import Scalars, initial_state  # noqa: E402
from liveshard_agent.runtime.weights import Peers, Weights, box_view  # noqa: E402
from liveshard_core.job import TrainingSettings  # noqa: E402
from liveshard_core.layout.layout import parse_degrees  # noqa: E402
from liveshard_core.vps.presets import preset  # noqa: E402
from liveshard_e2e.procs import free_port  # noqa: E402


def test_builtin_corpus_is_fixed_text() -> None:
    text = builtin_corpus()
    assert len(text) == 1 << 20
    assert text == builtin_corpus()
    assert text.startswith(b"the ") and text.count(b". ") > 10_000


def test_a_sample_is_a_function_of_seed_and_index_only() -> None:
    data = Dataset(load_corpus(None), seq_len=16, seed=3)
    whole = data.batch(100, 8)
    assert whole.samples.tolist() == list(range(100, 108))
    # The same samples fetched in other groupings (another dp, other micro-batches) are equal.
    for first, count in ((100, 3), (103, 5)):
        part = data.batch(first, count)
        assert torch.equal(part.inputs, whole.inputs[first - 100 : first - 100 + count])
    assert torch.equal(whole.targets[:, :-1], whole.inputs[:, 1:])
    other = Dataset(load_corpus(None), seq_len=16, seed=4).batch(100, 8)
    assert not torch.equal(other.inputs, whole.inputs)


def test_data_file_and_errors(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "text.txt"  # type: ignore[operator]
    path.write_bytes(b"abcdefghij" * 10)
    data = Dataset(load_corpus(str(path)), seq_len=8, seed=0)
    assert set(data.batch(0, 4).inputs.flatten().tolist()) <= set(b"abcdefghij")
    with pytest.raises(ValueError, match="cannot read the data file"):
        load_corpus(str(tmp_path / "missing"))  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"text.txt: corpus shorter than one sample: 100 tokens"):
        Dataset(load_corpus(str(path)), seq_len=128, seed=0)
    # In order, sample j is the stream's tokens [j*S, j*S + S]; the next epoch starts over.
    ordered = Dataset(load_corpus(str(path)), seq_len=8, seed=0, data_order="sequential")
    stream = torch.tensor(list(path.read_bytes()))
    batch = ordered.batch(0, 13)  # 12 samples of 8 (+1) in 100 bytes, then sample 0 again
    for j in range(12):
        assert batch.inputs[j].tolist() == stream[j * 8 : j * 8 + 8].tolist()
        assert batch.targets[j].tolist() == stream[j * 8 + 1 : j * 8 + 9].tolist()
    assert torch.equal(batch.inputs[12], batch.inputs[0])
    settings = TrainingSettings(data=str(path), seq_len=8, global_batch=16, micro_batch=2)
    with pytest.raises(ValueError, match=r"corpus shorter than one step: 12 samples of seq_len=8"):
        job_dataset(settings, None, 256)
    with pytest.raises(ValueError, match=r"byte-level text needs 256; give a tokenizer"):
        job_dataset(settings, None, 100)


def test_dropout_masks_do_not_depend_on_the_layout() -> None:
    """A sample's mask in a layer is the same whichever micro-batch or rank computes it."""
    key = rng.key("dropout", 0)
    together = dropout_keep(key, 5, 3, torch.tensor([40, 41, 42, 43]), 16, 32, 0.1)
    apart = [dropout_keep(key, 5, 3, torch.tensor([s]), 16, 32, 0.1) for s in (42, 40)]
    assert torch.equal(together[2], apart[0][0]) and torch.equal(together[0], apart[1][0])
    assert 0.05 < 1 - together.float().mean().item() < 0.15  # about p of them dropped
    assert not torch.equal(
        together, dropout_keep(key, 6, 3, torch.tensor([40, 41, 42, 43]), 16, 32, 0.1)
    )
    assert not torch.equal(
        together, dropout_keep(key, 5, 4, torch.tensor([40, 41, 42, 43]), 16, 32, 0.1)
    )


def test_uniform_values_are_spread() -> None:
    values = rng.uniform(rng.key("x"), torch.arange(100_000))
    assert values.min() >= 0 and values.max() < 1
    assert abs(values.mean().item() - 0.5) < 0.01
    assert torch.unique(values).numel() > 99_000


def test_global_batch_must_divide_and_the_error_names_the_numbers() -> None:
    settings = TrainingSettings(global_batch=24, micro_batch=2)
    assert [settings.micro_batches(dp) for dp in (1, 2, 3, 4, 6)] == [12, 6, 4, 3, 2]
    with pytest.raises(ValueError, match=r"global batch 24 does not divide into dp=5 .* 2 samples"):
        settings.micro_batches(5)
    with pytest.raises(ValueError, match="micro_batch=5 must divide global_batch=24"):
        TrainingSettings(global_batch=24, micro_batch=5)


def test_learning_rate_warms_up_then_decays() -> None:
    s = TrainingSettings(lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=110)
    assert s.learning_rate(0) == pytest.approx(1e-4)
    assert s.learning_rate(9) == pytest.approx(1e-3)
    assert s.learning_rate(60) == pytest.approx(5.5e-4)
    assert s.learning_rate(110) == pytest.approx(1e-4)


def test_scalars_advance_together() -> None:
    s = Scalars(seed=3).advanced(24).advanced(24)
    assert (s.step, s.adam_step, s.samples, s.seed) == (2, 2, 48, 3)
    assert Scalars.from_dict(s.as_dict()) == s


def test_peers_send_each_box_held_once_to_the_member_that_holds_its_copy() -> None:
    spec = preset("tiny")
    # tp=2 on each of 2 stages, mirrored: each box of a stage is copied by the member of the
    # same tp index on the other stage, a split weight's tp half as the norms (alike over tp).
    grid = parse_degrees("tp=2,pp=2,mirror=1").layout(spec, ["a", "b", "c", "d"])
    peers = [Peers.build(spec, grid, rank) for rank in range(4)]
    assert [(set(p.sends), set(p.copies)) for p in peers] == [({2}, {2}), ({3}, {3}),
                                                              ({0}, {0}), ({1}, {1})]  # fmt: skip
    names = {param.name for param, _ in peers[0].sends[2]}
    assert "layers.0.attn.o" in names and "layers.3.attn.o" not in names
    assert "layers.0.attn.norm" in names
    assert names == {param.name for param, _ in peers[1].sends[3]}
    # What 0 sends to 2 is what 2 holds from 0, in the same order.
    assert peers[0].sends[2] == peers[2].copies[0]
    assert peers[2].sends[0] == peers[0].copies[2]
    # tp alone: the other tp rank copies a split weight's half; the norms have no copy.
    pair = parse_degrees("tp=2,mirror=1").layout(spec, ["a", "b"])
    sends = Peers.build(spec, pair, 0).sends[1]
    assert sends == Peers.build(spec, pair, 1).copies[0]
    assert not any(param.name.endswith("norm") for param, _ in sends)
    # pp=3: round the stages; without the mirror, nothing.
    ring = parse_degrees("pp=3,mirror=1").layout(spec, ["a", "b", "c"])
    assert [(set(p.sends), set(p.copies)) for p in (Peers.build(spec, ring, r) for r in range(3))
            ] == [({1}, {2}), ({2}, {0}), ({0}, {1})]  # fmt: skip
    plain = parse_degrees("pp=3").layout(spec, ["a", "b", "c"])
    assert Peers.build(spec, plain, 0) == Peers()


@torch.no_grad()
def test_a_copy_updated_from_its_holders_gradients_stays_equal_to_it_bit_for_bit() -> None:
    # pp=2 mirrored, each member's optimizer alone (no collective): rank 1's copies of rank 0's
    # boxes, updated from the gradients rank 0 would send, equal rank 0's own after each step.
    spec = preset("tiny")
    layout = parse_degrees("pp=2,zero=1,mirror=1").layout(spec, ["a", "b"])
    settings = TrainingSettings()
    holder, peer = (
        Weights.build(initial_state(spec, layout, rank, 0, torch.device("cpu")), world=None)
        for rank in (0, 1)
    )
    route = peer.peers.copies[0]
    assert route == holder.peers.sends[1]
    generator = torch.Generator().manual_seed(3)
    for step in (1, 2, 3):
        grads = {w.name: [torch.randn(t.shape, generator=generator) for t in w.tensors]
                 for w in holder.all()}  # fmt: skip
        Optimizer(holder, settings).adam(holder.all(), grads, 0.5, 1e-3, step)
        sent = [(p, box, box_view(holder[p.name].boxes, grads[p.name], box).clone())
                for p, box in route]  # fmt: skip
        Optimizer(peer, settings).adam([], {}, 0.5, 1e-3, step, sent)
        for param, box in route:
            for kind in spec.kinds:
                ref = spec.ref(param.name, kind)
                assert torch.equal(holder.state.view(ref, box), peer.state.view(ref, box)), ref


def test_a_prepare_is_obeyed_as_it_is_taken_when_its_store_connects_at_once() -> None:
    """A training member waits a grace (`_CONNECT_GRACE`) for the connect to a change's store as
    it takes a Prepare, so it prepares at that boundary, not a step later; a store nothing serves
    is held (the member trains on meanwhile: `tests/agent/server/test_flow.py`). The grace here
    is long: a machine whose DNS server drops torch's reverse lookups makes a connect wait 5 s."""
    assert _CONNECT_GRACE > 0
    layout = parse_degrees("dp=1").layout(preset("tiny"), ["a"])
    served, idle = (StoreAddress("127.0.0.1", free_port()) for _ in range(2))
    store = host_store(served, timeout=10.0)
    stores = _Stores(timeout=10.0)
    assert not stores.connecting(Prepare(Change(1, layout, layout), served), grace=10.0)
    stores(served).set("seen", "yes")
    assert store.get("seen") == b"yes"
    assert not stores.connecting(Stop(), grace=10.0)
    assert stores.connecting(Prepare(Change(2, layout, layout), idle), grace=0.05)
