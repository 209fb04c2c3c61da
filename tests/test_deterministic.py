"""`--deterministic` / `GPTOSS_MAX_DETERMINISTIC=on`: the settings it implies and the conflicts it refuses.

Whether it makes a GPU run repeat is measured on a GPU (`scripts/gpu_repeat.py`, bench/NOTES.md);
the tiny model's CLI run with it is in test_cli.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gptoss_max import settings

_AT_IMPORT = {name: os.environ.get(name) for name in ("GPTOSS_MAX_DETERMINISTIC", settings.MODULAR_DEBUG_ENV)}


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
    monkeypatch.setenv(settings.MODULAR_DEBUG_ENV, os.environ.get(settings.MODULAR_DEBUG_ENV, ""))  # and its export
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("before", "after"), [(None, "device-sync-mode"), ("nan-check", "nan-check,device-sync-mode"),
                                                ("device-sync-mode", "device-sync-mode")])  # fmt: skip
def test_export_device_sync_adds_max_s_switch_once(monkeypatch, before, after):
    monkeypatch.setenv("GPTOSS_MAX_DETERMINISTIC", "on")
    monkeypatch.setenv(settings.MODULAR_DEBUG_ENV, before or "")  # recorded, so the export is undone after
    if before is None:
        monkeypatch.delenv(settings.MODULAR_DEBUG_ENV)
    settings.export_device_sync()
    settings.export_device_sync()
    assert os.environ[settings.MODULAR_DEBUG_ENV] == after


def test_export_device_sync_does_nothing_when_off(monkeypatch):
    monkeypatch.setenv("GPTOSS_MAX_DETERMINISTIC", "off")
    monkeypatch.delenv(settings.MODULAR_DEBUG_ENV, raising=False)
    settings.export_device_sync()
    assert settings.MODULAR_DEBUG_ENV not in os.environ


def _max_flag_after_import(env: dict[str, str]) -> str:
    """MAX's device_sync_mode in a fresh process that imports gptoss_max, then MAX (as every entry
    point does; setting the flag after the session exists did not hold on an H200)."""
    code = "import gptoss_max; from max.engine import InferenceSession as S; print(S.debug.device_sync_mode)"
    base = {k: v for k, v in os.environ.items() if k not in ("GPTOSS_MAX_DETERMINISTIC", settings.MODULAR_DEBUG_ENV)}
    proc = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    return proc.stdout.strip().splitlines()[-1]


def test_package_import_turns_max_s_device_sync_on():
    assert _max_flag_after_import({"GPTOSS_MAX_DETERMINISTIC": "on"}) == "True"
    assert _max_flag_after_import({}) == "False"
    # a bad value is refused where the setting is used, not by the import
    assert _max_flag_after_import({"GPTOSS_MAX_DETERMINISTIC": "1"}) == "False"


def test_help_describes_it(capsys):
    from gptoss_max.cli import build_parser

    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        out = capsys.readouterr().out
        assert "--deterministic" in out and "GPTOSS_MAX_DETERMINISTIC=on" in out


def test_cli_conflicts_left_the_environment_alone():
    """main(--deterministic) sets both in os.environ; later tests' MAX processes must not inherit them."""
    assert {name: os.environ.get(name) for name in _AT_IMPORT} == _AT_IMPORT
