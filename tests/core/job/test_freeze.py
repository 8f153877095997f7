"""The `freeze` setting (progressive layer freezing): its spellings (the CRD's list of
`{step, layers}` objects, the agent's JSON, `--freeze STEP:LAYERS` flags), its checks, and which
weights it freezes at a step. No process, no cluster."""

from __future__ import annotations

import argparse

import pytest

from liveshard_core.errors import InvalidInput
from liveshard_core.job import JobConfig, TrainingSettings
from liveshard_core.job.flags import add_training_flags, training_from_flags
from liveshard_core.vps.presets import resolve_model
from liveshard_core.vps.spec import ModelSpec

PROGRESSIVE = TrainingSettings(freeze=((20, 2), (40, 4)))


def from_flags(*argv: str) -> TrainingSettings:
    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    return training_from_flags(parser.parse_args(list(argv)))


def test_the_last_entry_whose_step_has_come_applies() -> None:
    assert TrainingSettings().freeze == ()
    frozen = {step: PROGRESSIVE.frozen_layers(step) for step in (0, 19, 20, 39, 40, 10**6)}
    assert frozen == {0: 0, 19: 0, 20: 2, 39: 2, 40: 4, 10**6: 4}
    assert TrainingSettings(freeze=((0, 3), (5, 0))).frozen_layers(7) == 0  # thawed


@pytest.mark.parametrize(("model", "tied"), [("tiny", True), ("tiny-moe", False)])
def test_frozen_weights_are_the_first_layers_and_the_untied_input_embedding(
    model: str, tied: bool
) -> None:
    params = ModelSpec.from_config(resolve_model(model).config).params
    settings = TrainingSettings(freeze=((3, 2),))
    assert not any(settings.frozen(2, p) for p in params)
    frozen = {p.name for p in params if settings.frozen(3, p)}
    layers = {p.name for p in params if p.layer is not None and p.layer < 2}
    # A tied embedding is also the head, which trains: only the untied one freezes.
    assert frozen == layers | (set() if tied else {"embed"})


def test_the_crd_the_json_and_the_flags_spell_it_each_their_way() -> None:
    crd = {"training": {"freeze": [{"step": 20, "layers": 2}, {"step": 40, "layers": 4}]}}
    assert TrainingSettings.from_crd(crd) == PROGRESSIVE
    assert PROGRESSIVE.as_dict()["freeze"] == crd["training"]["freeze"]
    assert TrainingSettings.from_dict(PROGRESSIVE.as_dict()) == PROGRESSIVE
    config = JobConfig(model=resolve_model("tiny").config, training=PROGRESSIVE)
    assert JobConfig.from_json(config.to_json()) == config
    assert from_flags("--freeze", "20:2", "--freeze", "40:4") == PROGRESSIVE
    assert from_flags().freeze == ()


@pytest.mark.parametrize(
    ("freeze", "error"),
    [
        ([{"step": 4, "layers": 1}, {"step": 4, "layers": 2}],
         r"^spec\.training\.freeze\[1\]\.step=4 must be greater than freeze\[0\]\.step=4"),
        ([{"step": 1, "layers": -1}], r"^spec\.training\.freeze\[0\]\.layers=-1 must be an integ"),
        ([{"step": "x", "layers": 1}], r"^spec\.training\.freeze\[0\]\.step='x' must be an integ"),
        ([{"step": 1}], r"^spec\.training\.freeze\[0\]=\{'step': 1\} must be an object with "
                        r"exactly the fields \['step', 'layers'\]"),
        ({"step": 1, "layers": 1}, r"^spec\.training\.freeze=.* must be a list of"),
    ],
)  # fmt: skip
def test_a_wrong_entry_is_named_as_the_crd_spells_it(freeze: object, error: str) -> None:
    with pytest.raises(InvalidInput, match=error):
        TrainingSettings.from_crd({"training": {"freeze": freeze}})


def test_wrong_values_are_refused_where_they_are_given() -> None:
    with pytest.raises(InvalidInput, match=r"^--freeze 'x': expected STEP:LAYERS, e\.g\. 20:2$"):
        from_flags("--freeze", "x")
    with pytest.raises(InvalidInput, match=r"^--freeze '2:-1': expected STEP:LAYERS"):
        from_flags("--freeze", "2:-1")
    with pytest.raises(InvalidInput, match=r"freeze\[1\]\.step=3 must be greater than"):
        from_flags("--freeze", "5:1", "--freeze", "3:2")
    with pytest.raises(InvalidInput, match=r"freeze\[0\]=\(1, 2, 3\) must be a \(step, layers\)"):
        TrainingSettings(freeze=((1, 2, 3),))  # type: ignore[arg-type]
    # Where the model is known: no more layers than it has.
    too_many = TrainingSettings(freeze=((0, 4), (9, 5)))
    with pytest.raises(InvalidInput, match=r"^training\.freeze\[1\]\.layers=5 exceeds the model"):
        JobConfig(model=resolve_model("tiny").config, training=too_many)
