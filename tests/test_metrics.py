"""Drafting statistics across processes: histograms, snapshot files, the Prometheus collector, the log line."""

import json
import os

import pytest

from vllm_adaspec import metrics
from vllm_adaspec.metrics import SnapshotWriter, new_histogram, observe, read_snapshots, summary_line


def test_histogram_puts_values_in_the_first_bucket_that_holds_them():
    h = new_histogram((0.5, 1.0))
    for v in (0.1, 0.5, 0.7, 1.0, 3.0):
        observe(h, v)
    assert h["counts"] == [2, 2, 1] and h["count"] == 5 and h["sum"] == pytest.approx(5.3)


def test_snapshots_round_trip_throttle_and_skip_dead_engines(tmp_path, monkeypatch):
    monkeypatch.setenv(metrics.ENV, str(tmp_path))
    w = SnapshotWriter("dp0", interval=60)
    assert w.maybe_write({"policy": "fixed", "verified_drafts": 3})
    assert not w.maybe_write({"policy": "fixed", "verified_drafts": 4})  # throttled
    assert read_snapshots() == [{"policy": "fixed", "verified_drafts": 3}]
    assert w.maybe_write({"policy": "fixed", "verified_drafts": 5}, force=True)
    assert read_snapshots()[0]["verified_drafts"] == 5
    # an engine of an earlier LLM in this process, long gone
    (tmp_path / "engine-999999999-dp0.json").write_text(json.dumps({"pid": 999999999, "stats": {"x": 1}}))
    (tmp_path / "engine-broken.json").write_text("{not json")
    assert len(read_snapshots()) == 1


def test_writer_without_a_folder_is_a_no_op(monkeypatch):
    monkeypatch.delenv(metrics.ENV, raising=False)
    assert not SnapshotWriter("dp0").maybe_write({"a": 1}, force=True)
    assert read_snapshots() == []


def test_ensure_stats_dir_is_created_once(monkeypatch):
    monkeypatch.setenv(metrics.ENV, "")  # unset for the test; monkeypatch restores the variable afterwards
    a = metrics.ensure_stats_dir()
    assert os.path.isdir(a) and metrics.ensure_stats_dir() == a


def test_summary_line_reports_the_interval():
    before = {"draft_tokens": 10, "verified_drafts": 10, "accepted_drafts": 4, "round_lengths": [1, 4, 0],
              "draft_seconds": 1.0, "policy": "adaedl"}
    now = {"draft_tokens": 30, "verified_drafts": 30, "accepted_drafts": 14, "round_lengths": [1, 8, 6],
           "draft_seconds": 1.5, "policy": "adaedl"}
    line = summary_line(now, before)
    assert "adaspec [adaedl]: 10 draft rounds, 2.00 drafts/round, acceptance 50.0%" in line


def test_collector_reports_counters_and_cumulative_histograms(tmp_path, monkeypatch):
    from vllm_adaspec.engine.metrics import AdaspecCollector

    monkeypatch.setenv(metrics.ENV, str(tmp_path))
    h = new_histogram((0.5, 1.0))
    observe(h, 0.25)
    observe(h, 0.75)
    stats = {"policy": "thompson-beta", "round_lengths": [0, 2, 3], "verified_drafts": 8, "accepted_drafts": 5,
             "draft_seconds": 0.5, "requests_finished": 2, "draft_steps": [1, 4],
             "step_costs": {"1": [12.0, 20.0, 21.0, 22.5, 26.0, 31.0, 40.0]},
             "request_acceptance": h, "request_drafts_per_round": h,
             "tree_nodes": 40, "tree_accepted_depth": [3, 2, 1], "tree_kv_moves": 4, "drafter_faults": 3,
             "drafting_off": 1}
    SnapshotWriter("dp0").maybe_write(stats, force=True)
    fams = {f.name: f for f in AdaspecCollector().collect()}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    lab = (("engine", "0"), ("policy", "thompson-beta"))
    assert samples[("vllm:adaspec_verified_drafts_total", lab)] == 8
    assert samples[("vllm:adaspec_draft_rounds_total", tuple(sorted(lab + (("drafts", "2"),))))] == 3
    assert samples[("vllm:adaspec_request_acceptance_rate_bucket", tuple(sorted(lab + (("le", "0.5"),))))] == 1
    assert samples[("vllm:adaspec_request_acceptance_rate_bucket", tuple(sorted(lab + (("le", "+Inf"),))))] == 2
    assert samples[("vllm:adaspec_request_acceptance_rate_count", lab)] == 2
    assert samples[("vllm:adaspec_tree_nodes_total", lab)] == 40
    assert samples[("vllm:adaspec_tree_rounds_total", tuple(sorted(lab + (("depth", "2"),))))] == 1
    assert samples[("vllm:adaspec_tree_kv_moves_total", lab)] == 4
    assert samples[("vllm:adaspec_drafter_faults_total", lab)] == 3
    assert samples[("vllm:adaspec_drafting_off", lab)] == 1
    assert samples[("vllm:adaspec_decode_steps_total", tuple(sorted(lab + (("drafting", "1"),))))] == 4
    # the cost model's fit: batch 1, 3 drafted rows (1 + 3 = the table's 4-row point) = 22.5 ms
    assert samples[("vllm:adaspec_step_cost_seconds", tuple(sorted(lab + (("batch", "1"), ("rows", "3")))))] == 0.0225
