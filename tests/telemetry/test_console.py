"""diffrl.telemetry.console: quieting switches and progress lines for long phases."""

import io
import logging
import os
import time

import pytest

from diffrl.telemetry import console


def test_short_phase_prints_nothing():
    out = io.StringIO()
    with console.progress("load", delay=5.0, stream=out):
        pass
    assert out.getvalue() == ""


def test_long_phase_prints_elapsed_counts_eta_and_an_end_line():
    out = io.StringIO()
    with console.progress("validation", total=4, delay=0.05, every=10.0, stream=out) as shown:
        shown.update(1)
        time.sleep(0.3)  # one heartbeat after 0.05 s; the next would come after 10 s
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("validation: 1/4 done, ") and "elapsed" in lines[0] and "ETA" in lines[0]
    assert lines[1].startswith("validation: done in ")


def test_eta_is_elapsed_per_item_times_items_left():
    now = [100.0]
    state = console.Progress("v", 10, clock=lambda: now[0], unit="prompts")
    assert state.line() == "v: 0/10 prompts, 0s elapsed, ETA ?"
    now[0] += 20.0
    state.update(4)  # 5 s per item, 6 left
    assert state.line() == "v: 4/10 prompts, 20s elapsed, ETA 30s"


@pytest.fixture
def clean_env(monkeypatch):
    for key in console.QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(console, "_verbose", None)
    yield
    # the libraries imported in this test process go back to their defaults
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_warning()
    diffusers_logging.set_verbosity_warning()
    transformers_logging.enable_progress_bar()
    diffusers_logging.enable_progress_bar()


def test_quiet_sets_the_libraries_switches_and_hands_them_to_ray(clean_env, monkeypatch):
    import diffusers  # noqa: F401  (imported before configure: told directly)
    import transformers  # noqa: F401
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    assert console.ray_init_kwargs() == {}  # library use: Ray keeps its own settings
    monkeypatch.setenv("DIFFUSERS_VERBOSITY", "info")  # the user's own choice wins
    console.configure(verbose=False)
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error" and os.environ["TQDM_DISABLE"] == "1"
    assert transformers_logging.get_verbosity() == logging.ERROR
    assert not transformers_logging.is_progress_bar_enabled()
    assert diffusers_logging.get_verbosity() == logging.INFO
    assert not diffusers_logging.is_progress_bar_enabled()
    kwargs = console.ray_init_kwargs()
    assert kwargs["logging_level"] == logging.ERROR
    assert kwargs["runtime_env"]["env_vars"]["DIFFUSERS_VERBOSITY"] == "info"
    assert kwargs["runtime_env"]["env_vars"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_verbose_changes_nothing(clean_env):
    console.configure(verbose=True)
    assert not any(key in os.environ for key in console.QUIET_ENV)
    assert "logging_level" not in console.ray_init_kwargs()
