"""adaspec on the server's /metrics and in its periodic stats log (`vllm.stat_logger_plugins` entry point).

vLLM builds this logger in the front-end process of `vllm serve` (AsyncLLM). When the engine uses an adaspec
drafter it registers a Prometheus collector that, at every scrape, reads the drafters' latest snapshots
(vllm_adaspec/metrics.py: written by our worker in the engine process) and reports them; `log()` adds one line
per stats interval. Offline `LLM` users read the same numbers with `llm.collective_rpc("adaspec_stats")`.

Metrics (labels: policy, engine):
    vllm:adaspec_draft_rounds_total{drafts}      rounds by the number of drafts the policy proposed
    vllm:adaspec_verified_drafts_total           drafts the target verified
    vllm:adaspec_accepted_drafts_total           of those, accepted
    vllm:adaspec_draft_seconds_total             time spent drafting
    vllm:adaspec_requests_finished_total         requests finished
    vllm:adaspec_decode_steps_total{drafting}    decode steps without (0) and with (1) drafts from us
    vllm:adaspec_step_cost_seconds{batch,rows}   the step cost model's fit: seconds of a step of `batch` decoding
                                                 requests with `rows` drafted rows in all (0, 1, 3, 7, 15, 31)
    vllm:adaspec_request_acceptance_rate         histogram over finished requests that drafted
    vllm:adaspec_request_drafts_per_round        histogram over finished requests that drafted
    vllm:adaspec_tree_nodes_total                tree mode: tree nodes drafted
    vllm:adaspec_tree_rounds_total{depth}        tree mode: trees verified, by accepted depth (tokens accepted)
    vllm:adaspec_tree_kv_moves_total             tree mode: KV slots moved by compaction
    vllm:adaspec_drafter_faults_total            faults of ours contained (each: a step without drafts for the
                                                 requests concerned; vllm_adaspec/faults.py)
    vllm:adaspec_drafting_off                    1 once the faults reached `fault_limit`: speculation is off
    vllm:adaspec_live_state{kind}                per-request state held now (policies, pools, KV copy tokens,
                                                 branch grams, ...): 0 once every request finished
Numbers trail the engine by up to one step and 0.5 s (finished requests are noticed at the next step).
"""

from __future__ import annotations

import logging

from vllm_adaspec.engine.vllm_surface import vllm_object
from vllm_adaspec.metrics import read_snapshots, summary_line
from vllm_adaspec.policies.cost_model import STEP_COST_ROWS

StatLoggerBase = vllm_object("StatLoggerBase")

logger = logging.getLogger("vllm_adaspec")
_REGISTERED = []  # one collector per process, however many loggers vLLM builds


def _histogram(family, labels, hist):
    cum, buckets = 0, []
    for bound, count in zip(hist["buckets"] + [float("inf")], hist["counts"]):
        cum += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
    family.add_metric(labels, buckets, hist["sum"])


class AdaspecCollector:
    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snaps = read_snapshots()
        names = ["policy", "engine"]
        rounds = CounterMetricFamily("vllm:adaspec_draft_rounds", "Draft rounds by drafts proposed",
                                     labels=names + ["drafts"])
        verified = CounterMetricFamily("vllm:adaspec_verified_drafts", "Drafts verified by the target", labels=names)
        accepted = CounterMetricFamily("vllm:adaspec_accepted_drafts", "Drafts accepted by the target", labels=names)
        seconds = CounterMetricFamily("vllm:adaspec_draft_seconds", "Seconds spent drafting", labels=names)
        finished = CounterMetricFamily("vllm:adaspec_requests_finished", "Requests finished", labels=names)
        steps = CounterMetricFamily("vllm:adaspec_decode_steps", "Decode steps without (0) and with (1) drafts",
                                    labels=names + ["drafting"])
        costs = GaugeMetricFamily("vllm:adaspec_step_cost_seconds", "Fitted seconds of a step by batch size and "
                                  "drafted rows", labels=names + ["batch", "rows"])
        acc_h = HistogramMetricFamily("vllm:adaspec_request_acceptance_rate",
                                      "Per finished request: accepted / verified drafts", labels=names)
        len_h = HistogramMetricFamily("vllm:adaspec_request_drafts_per_round",
                                      "Per finished request: drafts proposed per round", labels=names)
        nodes = CounterMetricFamily("vllm:adaspec_tree_nodes", "Tree nodes drafted", labels=names)
        depth = CounterMetricFamily("vllm:adaspec_tree_rounds", "Trees verified, by accepted depth",
                                    labels=names + ["depth"])
        moves = CounterMetricFamily("vllm:adaspec_tree_kv_moves", "KV slots moved by tree compaction", labels=names)
        faults = CounterMetricFamily("vllm:adaspec_drafter_faults", "Drafter faults contained (steps decoded without "
                                     "drafts for the requests concerned)", labels=names)
        off = GaugeMetricFamily("vllm:adaspec_drafting_off", "1 once the drafter faults reached fault_limit",
                                labels=names)
        live = GaugeMetricFamily("vllm:adaspec_live_state", "Per-request drafter state held now, by kind",
                                 labels=names + ["kind"])
        for i, st in enumerate(snaps):
            labels = [str(st.get("policy")), str(i)]
            for n, count in enumerate(st.get("round_lengths", [])):
                rounds.add_metric(labels + [str(n)], count)
            verified.add_metric(labels, st.get("verified_drafts", 0))
            accepted.add_metric(labels, st.get("accepted_drafts", 0))
            seconds.add_metric(labels, st.get("draft_seconds", 0.0))
            finished.add_metric(labels, st.get("requests_finished", 0))
            for drafting, count in enumerate(st.get("draft_steps", [])):
                steps.add_metric(labels + [str(drafting)], count)
            for batch, (_, *millis) in st.get("step_costs", {}).items():
                for rows, value in zip(STEP_COST_ROWS, millis):
                    costs.add_metric(labels + [batch, str(rows - 1)], value / 1e3)
            nodes.add_metric(labels, st.get("tree_nodes", 0))
            moves.add_metric(labels, st.get("tree_kv_moves", 0))
            for d, count in enumerate(st.get("tree_accepted_depth", [])):
                depth.add_metric(labels + [str(d)], count)
            faults.add_metric(labels, st.get("drafter_faults", 0))
            off.add_metric(labels, st.get("drafting_off", 0))
            for kind, value in st.get("live", {}).items():
                live.add_metric(labels + [kind], value)
            if "request_acceptance" in st:
                _histogram(acc_h, labels, st["request_acceptance"])
                _histogram(len_h, labels, st["request_drafts_per_round"])
        yield from (rounds, verified, accepted, seconds, finished, steps, costs, acc_h, len_h, nodes, depth, moves,
                    faults, off, live)


class AdaspecStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        from vllm_adaspec.engine.startup import adaspec_proposer_name

        self.enabled = adaspec_proposer_name(vllm_config) is not None
        self.engine_index = engine_index
        self._last = None
        if self.enabled and not _REGISTERED:
            from prometheus_client import REGISTRY

            collector = AdaspecCollector()
            REGISTRY.register(collector)
            _REGISTERED.append(collector)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        pass  # the drafter's numbers arrive through snapshots, read when logged or scraped

    def log(self):
        if not self.enabled:
            return
        snaps = read_snapshots()
        if len(snaps) > self.engine_index:
            now = snaps[self.engine_index]
            logger.info("%s", summary_line(now, self._last))
            self._last = now

    def log_engine_initialized(self):
        pass
