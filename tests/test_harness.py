"""The harness's engine starts, without an engine: what a start is doing, read off vLLM's log, and the wait over
several engines that says so while it waits (the demo's engines compile for minutes)."""

import threading
import time

import pytest

from vllm_adaspec.harness import start_phase, wait_all

LOG = """INFO [llm_engine.py:80] Initializing a V1 LLM engine (v0.32.0) with config: model='m'
INFO [cpu_model_runner.py:1] Starting to load model m...
INFO [default_loader.py:1] Loading weights took 0.28 seconds
INFO [cpu_model_runner.py:2] Warming up model for the compilation...
"""


def test_the_phase_of_a_start_is_the_latest_milestone_in_its_log():
    assert start_phase("") == "starting Python and vLLM"
    assert start_phase(LOG) == "compiling"
    assert start_phase(LOG + "INFO Initial profiling/warmup run took 3.54 s\n") == "profiling"
    assert start_phase(LOG.split("Loading weights")[0]) == "loading the model"


class FakeSession:
    def __init__(self, seconds, error=None):
        self.seconds, self.error, self.ready = seconds, error, False

    def wait(self):
        time.sleep(self.seconds)
        if self.error:
            raise self.error
        self.ready = True

    def phase(self):
        return "ready" if self.ready else "compiling"


def test_waiting_for_several_engines_reports_each_ones_progress_until_all_are_ready():
    lines = []
    sessions = {"plain": FakeSession(0.2), "adaspec": FakeSession(0.7)}
    wait_all(sessions, lines.append, every=0.1)
    assert all(s.ready for s in sessions.values()) and lines
    assert "adaspec compiling" in lines[0] and "so far" in lines[0]
    assert any("plain ready" in ln and "adaspec compiling" in ln for ln in lines)
    with pytest.raises(RuntimeError, match="no model"):
        wait_all({"bad": FakeSession(0.1, RuntimeError("no model")), "ok": FakeSession(0.2)}, lines.append, every=0.1)
    assert threading.active_count() < 10
