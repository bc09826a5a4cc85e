"""The routing names (llmgw.config.names) agree with everything keyed by them: the scorers,
the pickers, the presets, the config's [[strategies]] checks and weights table, and the docs."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from llmgw.config import ConfigError, ScorerWeights, StrategyConfig, parse_config
from llmgw.config.names import DEFAULT_PICKER, PICKER_NAMES, PRESET_NAMES, SCORER_NAMES
from llmgw.route.pickers import PICKERS
from llmgw.route.prefix_scorer import PrefixRouting
from llmgw.route.scheduler import Scheduler
from llmgw.route.scorers import SCORERS
from llmgw.route.strategies import PRESETS, Strategy

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_each_list_is_plain_and_without_duplicates() -> None:
    for names in (SCORER_NAMES, PICKER_NAMES, PRESET_NAMES):
        assert isinstance(names, tuple) and all(isinstance(n, str) for n in names)
        assert len(set(names)) == len(names)


def test_scorer_names_are_the_builtin_scorers_and_prefix() -> None:
    assert set(SCORER_NAMES) == set(SCORERS) | {"prefix"}
    # "prefix" is the scorer PrefixRouting adds to a scheduler when cache-aware routing is on
    assert set(PrefixRouting().scorers()) == {"prefix"}
    assert set(Scheduler(scorers=PrefixRouting().scorers()).scorers) == set(SCORER_NAMES)


def test_picker_and_preset_names() -> None:
    assert set(PICKER_NAMES) == set(PICKERS)
    assert set(PRESET_NAMES) == set(PRESETS)
    assert DEFAULT_PICKER in PICKER_NAMES
    assert Strategy("t", {"load": 1.0}).picker == DEFAULT_PICKER
    assert StrategyConfig(name="t").picker == DEFAULT_PICKER


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_weighs_known_scorers_with_a_known_picker(name: str) -> None:
    preset = PRESETS[name]
    assert preset.name == name
    assert set(preset.weights) <= set(SCORER_NAMES)
    assert preset.picker in PICKER_NAMES


def test_config_weights_table_has_one_field_per_scorer() -> None:
    assert tuple(f.name for f in fields(ScorerWeights)) == SCORER_NAMES


@pytest.mark.parametrize("scorer", SCORER_NAMES)
def test_config_accepts_each_scorer_as_the_only_weight(scorer: str) -> None:
    cfg = parse_config(f'[[strategies]]\nname = "s"\nweights = {{ {scorer} = 1.0 }}\n')
    assert getattr(cfg.strategies[0].weights, scorer) == 1.0
    with pytest.raises(ConfigError, match="at least one weight must be > 0"):
        parse_config(f'[[strategies]]\nname = "s"\nweights = {{ {scorer} = 0.0 }}\n')


@pytest.mark.parametrize("picker", PICKER_NAMES)
def test_config_accepts_every_picker(picker: str) -> None:
    text = f'[[strategies]]\nname = "s"\npicker = "{picker}"\nweights = {{ load = 1.0 }}\n'
    assert parse_config(text).strategies[0].picker == picker


def test_config_rejects_an_unknown_picker_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config('[[strategies]]\nname = "s"\npicker = "maxscore"\nweights = { load = 1.0 }\n')
    msg = str(info.value)
    assert all(repr(p) in msg for p in PICKER_NAMES) and "did you mean 'max-score'" in msg


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_config_accepts_every_preset_as_a_models_strategy(preset: str) -> None:
    cfg = parse_config(f'[[models]]\nname = "m"\nengine = "vllm"\nstrategy = "{preset}"\n')
    assert cfg.models[0].strategy == preset


def test_config_rejects_an_unknown_strategy_naming_the_presets() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config('[[models]]\nname = "m"\nengine = "vllm"\nstrategy = "chatty"\n')
    msg = str(info.value)
    assert all(repr(p) in msg for p in PRESET_NAMES)


@pytest.mark.parametrize("name", [*SCORER_NAMES, *PICKER_NAMES, *PRESET_NAMES])
def test_docs_mention_every_name(name: str) -> None:
    text = "\n".join((DOCS / f).read_text(encoding="utf-8")
                     for f in ("router.md", "configuration.md"))
    assert re.search(rf"`{re.escape(name)}`", text), \
        f"`{name}` is in neither docs/router.md nor docs/configuration.md"
