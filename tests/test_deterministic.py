"""`--deterministic` / `GPTOSS_MAX_DETERMINISTIC=on`: the settings it implies and the conflicts it refuses.

Whether it makes a GPU run repeat is measured on a GPU (`scripts/gpu_repeat.py`, bench/NOTES.md);
the tiny model's CLI run with it is in test_cli.py."""

from __future__ import annotations

import os

import pytest

from gptoss_max import settings

_AT_IMPORT = os.environ.get("GPTOSS_MAX_DETERMINISTIC")


def test_default_is_off_and_hybrid(monkeypatch):
    monkeypatch.delenv("GPTOSS_MAX_DETERMINISTIC", raising=False)
    monkeypatch.delenv("GPTOSS_MAX_ATTENTION", raising=False)
    assert not settings.deterministic()
    assert settings.attention_impl() == "hybrid"
    monkeypatch.setenv("GPTOSS_MAX_ATTENTION", "max")
    assert settings.attention_impl() == "max"


def test_on_runs_our_attention_and_refuses_max_s(monkeypatch):
    monkeypatch.setenv("GPTOSS_MAX_DETERMINISTIC", "on")
    monkeypatch.delenv("GPTOSS_MAX_ATTENTION", raising=False)
    assert settings.deterministic()
    assert settings.attention_impl() == "ours"
    monkeypatch.setenv("GPTOSS_MAX_ATTENTION", "ours")
    assert settings.attention_impl() == "ours"
    for impl in ("hybrid", "max"):
        monkeypatch.setenv("GPTOSS_MAX_ATTENTION", impl)
        with pytest.raises(ValueError, match=f"GPTOSS_MAX_ATTENTION={impl}"):
            settings.attention_impl()


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("GPTOSS_MAX_DETERMINISTIC", "1")
    with pytest.raises(ValueError, match="GPTOSS_MAX_DETERMINISTIC must be auto, off or on, not '1'"):
        settings.deterministic()


def test_recorded_with_benchmarks(monkeypatch):
    monkeypatch.setenv("GPTOSS_MAX_DETERMINISTIC", "on")
    assert "GPTOSS_MAX_DETERMINISTIC=on" in settings.run_setting_env()


def test_engine_refuses_graph_capture(monkeypatch):
    from gptoss_max.engine import EngineOptions, pipeline_args

    monkeypatch.setenv("GPTOSS_MAX_DETERMINISTIC", "on")
    with pytest.raises(ValueError, match="captured device graph"):
        pipeline_args(EngineOptions(model="synthetic:tiny", device="cpu", graph_capture=True))


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["serve", "--deterministic", "--graph-capture"], {}, "drop --graph-capture or --deterministic"),
        (["generate", "--prompt", "hi", "--deterministic"], {"GPTOSS_MAX_ATTENTION": "hybrid"},
         "GPTOSS_MAX_ATTENTION=hybrid"),
    ],
)  # fmt: skip
def test_cli_refuses_conflicts_before_loading(monkeypatch, capsys, argv, env, message):
    from gptoss_max.cli import main

    monkeypatch.setenv("GPTOSS_MAX_DETERMINISTIC", "off")  # recorded, so main()'s `on` is undone after
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_describes_it(capsys):
    from gptoss_max.cli import build_parser

    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        out = capsys.readouterr().out
        assert "--deterministic" in out and "GPTOSS_MAX_DETERMINISTIC=on" in out


def test_cli_conflicts_left_the_environment_alone():
    assert os.environ.get("GPTOSS_MAX_DETERMINISTIC") == _AT_IMPORT
