"""``autotune watch`` without a simulator: the recorded real SGLang 0.5.23 /metrics, the rolling window and its
state file, each drift rule on made-up windows, the study-file lengths, the Prometheus output, and memory that
stays flat over many windows of samples.
"""

from __future__ import annotations

import gc
import json
import random
import re
import threading
import tracemalloc
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from autotune.cli.watch import parse_duration
from autotune.errors import ConfigError
from autotune.inspect.probe import ProbeFailure
from autotune.watch.listen import THREAD_NAME, MetricsServer, parse_listen
from autotune.watch.metrics import SAMPLES, Histogram, Sample, parse_sample, watched_lines
from autotune.watch.output import lines
from autotune.watch.prometheus import DriftCollector, write_prometheus
from autotune.watch.reference import Tuned, median_interval
from autotune.watch.rules import RULES, Context, Limits, evaluate
from autotune.watch.suggest import draw_lengths, filler
from autotune.watch.watcher import CycleReport, ServerReport, Watcher, WatchOptions
from autotune.watch.window import ServerMemory, WatchState, Window

pytestmark = pytest.mark.timeout(120)

RECORDED = Path(__file__).parent / "data" / "recorded"
METRICS = (RECORDED / "qwen3next-metrics.prom").read_text()
SERVER_INFO = (RECORDED / "qwen3next-server_info.json").read_text()
BOUNDS = (100.0, 300.0, 500.0, 1000.0, 3000.0, 6000.0, 10000.0)
URL = "http://127.0.0.1:30000"


def hist(lengths: list[int]) -> Histogram:
    cumulative = tuple(float(sum(1 for x in lengths if x <= b)) for b in BOUNDS)
    return Histogram(bounds=BOUNDS, cumulative=cumulative, total=float(sum(lengths)), count=float(len(lengths)))


def sample(
    t: float, *, prompts: list[int] = (), outputs: list[int] = (), retracted: float = 0.0, **gauges: float
) -> Sample:
    base = {"num_running_reqs": 10.0, "num_queue_reqs": 0.0, "full_token_usage": 0.3, "mamba_usage": 0.5}
    return Sample(
        t=t,
        gauges={**base, **gauges},
        counters={"num_requests_total": float(len(prompts)), "num_retracted_requests_total": retracted},
        histograms={"prompt_tokens_histogram": hist(list(prompts)), "generation_tokens_histogram": hist(list(outputs))},
    )


def context(samples: list[Sample], tuned: Tuned | None = None, **kw) -> Context:
    window = Window(600.0, 100, samples)
    return Context(
        url=URL,
        window=window,
        memory=ServerMemory(window=window),
        tuned=tuned,
        limits=Limits(sustain_s=kw.pop("sustain_s", 60.0)),
        hybrid=kw.pop("hybrid", True),
        **kw,
    )


TUNED = Tuned(
    source="test",
    prompt_range=(100, 600),
    output_range=(200, 4096),
    tok_s=1000.0,
    tok_s_ci=(950.0, 1050.0),
    accept_length=3.0,
)
SHORT = [250] * 40


def rules(ctx: Context) -> set[str]:
    return {f.rule for f in evaluate(ctx)}


# ---------------------------------------------------------------- the recorded real /metrics
def test_recorded_real_metrics_give_histograms_gauges_and_counters():
    s = parse_sample(METRICS, 5.0)
    prompt = s.histograms["prompt_tokens_histogram"]
    assert prompt.bounds[:3] == (100.0, 300.0, 500.0) and len(prompt.bounds) == 35
    assert (prompt.count, prompt.total, prompt.mean) == (1.0, 6.0, 6.0)
    assert s.histograms["generation_tokens_histogram"].total == 8.0
    assert s.gauges["num_running_reqs"] == 4.0 and s.gauges["num_retracted_reqs"] == 0.0
    assert s.counters["prompt_tokens_total"] == 6.0 and s.counters["num_requests_total"] == 1.0
    assert s.flat()["sglang:num_queue_reqs"] == 2.0
    stored = json.loads(json.dumps(SAMPLES.dump_python([s])))  # the state file's form of it
    assert SAMPLES.validate_python(stored) == [s]
    assert list(stored[0]) == ["t", "gauges", "counters", "histograms"]  # the keys state files have always had
    assert stored[0]["histograms"]["prompt_tokens_histogram"] == {
        "bounds": list(prompt.bounds),
        "cumulative": list(prompt.cumulative),
        "total": 6.0,
        "count": 1.0,
    }


def test_histogram_window_quantile_and_buckets():
    early, late = hist([250] * 10), hist([250] * 10 + [5000] * 30)
    delta = late.minus(early)
    assert delta.count == 30 and delta.mean == 5000.0
    assert 3000.0 < delta.quantile(0.5) <= 6000.0
    assert [n for _, _, n in delta.buckets()] == [0, 0, 0, 0, 0, 30, 0, 0]
    assert early.minus(late) is None  # a count that fell is a restart, not a negative window


# ---------------------------------------------------------------- window and state file
def test_window_is_bounded_by_time_and_count_and_restarts_with_the_server():
    w = Window(span_s=10.0, max_samples=5)
    for t in range(20):
        w.add(sample(float(t), prompts=SHORT[: t + 1]))
    assert len(w) == 5 and w.seconds == 4.0
    w = Window(span_s=10.0, max_samples=50)
    for t in range(20):
        w.add(sample(float(t), prompts=SHORT[: t + 1]))
    assert len(w) == 11 and w.samples[0].t == 9.0
    w.add(sample(20.0, prompts=SHORT[:1]))  # counters fell: the server restarted
    assert w.restarted and len(w) == 1


def test_state_file_round_trips_and_a_broken_one_names_file_and_fix(tmp_path):
    path = tmp_path / "state.json"
    state = WatchState(span_s=60.0, max_samples=10)
    memory = state.server(URL)
    memory.window.add(sample(1.0, prompts=SHORT))
    memory.first_accept = 2.5
    state.save(path)
    again = WatchState.load(path, span_s=60.0, max_samples=10)
    assert again.servers[URL].window.latest == memory.window.latest and again.servers[URL].first_accept == 2.5
    path.write_text("{not json")
    with pytest.raises(ConfigError) as exc:
        WatchState.load(path, span_s=60.0, max_samples=10)
    assert str(exc.value).startswith(str(path)) and "delete it" in str(exc.value)


# ---------------------------------------------------------------- the rules
def test_steady_traffic_within_the_tuned_ranges_fires_nothing():
    ctx = context(
        [
            sample(0, prompts=SHORT[:5], outputs=[2500] * 5),
            sample(30, prompts=SHORT, outputs=[2500] * 40, gen_throughput=1000.0, spec_accept_length=3.0),
        ],
        TUNED,
    )
    assert evaluate(ctx) == []


def test_longer_prompts_fire_the_prompt_rule_with_the_evidence():
    ctx = context([sample(0, prompts=SHORT), sample(30, prompts=SHORT + [5000] * 20)], TUNED)
    (finding,) = evaluate(ctx)
    assert finding.rule == "prompt_length" and "100 % outside the tuned 100–600" in finding.evidence
    assert "longer" in finding.reason and finding.line().startswith(f"{URL} [prompt_length] prompt lengths")


def test_shorter_outputs_fire_the_output_rule():
    ctx = context([sample(0, outputs=[2500] * 10), sample(30, outputs=[2500] * 10 + [50] * 10)], TUNED)
    assert rules(ctx) == {"output_length"}


def test_kv_above_90_percent_or_any_retraction_fires_kv_pressure():
    assert "kv_pressure" in rules(context([sample(0), sample(30, full_token_usage=0.95)]))
    retracted = evaluate(context([sample(0, retracted=2), sample(30, retracted=5, full_token_usage=0.4)]))
    assert [f.rule for f in retracted] == ["kv_pressure"] and "3 request(s) retracted" in retracted[0].evidence


def test_the_binding_limit_moving_either_way():
    kv_bound = evaluate(context([sample(30, full_token_usage=0.97, mamba_usage=0.1)]))
    assert {f.rule for f in kv_bound} == {"kv_pressure", "binding_moved"}
    moved = next(f for f in kv_bound if f.rule == "binding_moved")
    assert "Mamba slots are 10 % used" in moved.evidence
    mamba_bound = evaluate(context([sample(30, full_token_usage=0.2, mamba_usage=0.95, num_queue_reqs=8)]))
    assert [f.rule for f in mamba_bound] == ["binding_moved"] and "8 request(s) queued" in mamba_bound[0].evidence
    assert rules(context([sample(30, full_token_usage=0.97, mamba_usage=0.1)], hybrid=False)) == {"kv_pressure"}


def test_acceptance_down_more_than_10_percent_against_the_study_or_the_first_seen():
    assert rules(context([sample(0, spec_accept_length=2.6), sample(30, spec_accept_length=2.6)], TUNED)) == {
        "acceptance"
    }
    assert rules(context([sample(0, spec_accept_length=2.8)], TUNED)) == set()
    ctx = context([sample(0, spec_accept_length=2.0)])
    ctx.memory.first_accept = 2.5
    assert "watch first saw 2.50" in evaluate(ctx)[0].evidence


def test_throughput_below_the_interval_counts_only_when_sustained_and_saturated():
    slow = [sample(t, gen_throughput=800.0, num_queue_reqs=5) for t in range(0, 91, 30)]
    (finding,) = evaluate(context(slow, TUNED, sustain_s=60.0))
    assert finding.rule == "throughput" and "95 % CI 950–1,050" in finding.evidence
    assert evaluate(context(slow[:2], TUNED, sustain_s=60.0)) == []  # not yet sustained
    quiet = [sample(t, gen_throughput=800.0, num_queue_reqs=0) for t in range(0, 91, 30)]
    assert evaluate(context(quiet, TUNED, sustain_s=60.0)) == []  # less demand, not drift


def test_median_interval_brackets_the_runs():
    low, high = median_interval([980.0, 1000.0, 1010.0, 1020.0, 1040.0])
    assert 980.0 <= low <= 1010.0 <= high <= 1040.0
    assert median_interval([1000.0]) is None


# ---------------------------------------------------------------- the drifted study's lengths
def test_drawn_lengths_follow_the_buckets_and_keep_the_exact_mean():
    h = hist([270] * 50 + [5800] * 50)
    drawn = draw_lengths(h, 400, random.Random(0))
    assert abs(sum(drawn) / len(drawn) - h.mean) <= 0.01 * h.mean
    short = sum(1 for x in drawn if x < 1000)
    assert 150 <= short <= 250  # about half from each mode
    assert all(len(filler(n, i)) <= 4 * n for i, n in enumerate((1, 50, 6000)))
    assert len(filler(6000, 3)) >= 4 * 6000 - 12


# ---------------------------------------------------------------- output, CLI pieces
def test_prometheus_file_has_every_rule_per_server_and_up(tmp_path):
    state = [sample(0), sample(30, full_token_usage=0.95)]
    watcher_report = _report_from(evaluate(context(state)))
    path = tmp_path / "drift.prom"
    write_prometheus(watcher_report, path)
    values = {
        (s.name, s.labels.get("server"), s.labels.get("rule")): s.value
        for fam in text_string_to_metric_families(path.read_text())
        for s in fam.samples
    }
    assert values[("autotune_drift", URL, "kv_pressure")] == 1.0
    assert sum(values[("autotune_drift", URL, rule)] for rule in RULES) == 1.0
    assert values[("autotune_watch_up", URL, None)] == 1.0
    assert values[("autotune_watch_up", "http://127.0.0.1:9", None)] == 0.0


def _report_from(findings):
    server = ServerReport(url=URL, findings=findings, gauges={}, traffic={}, samples=2, window_s=30.0)
    down = ProbeFailure(url="http://127.0.0.1:9", kind="unreachable", message="http://127.0.0.1:9: unreachable")
    return CycleReport(t=100.0, servers=[server], failures=[down])


def _values(text: str) -> dict[tuple[str, str | None, str | None], float]:
    return {
        (s.name, s.labels.get("server"), s.labels.get("rule")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.parametrize(
    ("text", "address"),
    [
        (":9400", ("127.0.0.1", 9400)),
        ("9400", ("127.0.0.1", 9400)),
        ("127.0.0.1:9400", ("127.0.0.1", 9400)),
        ("0.0.0.0:9400", ("0.0.0.0", 9400)),
        ("[::1]:9400", ("::1", 9400)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_listen_addresses_default_to_loopback(text, address):
    assert parse_listen(text) == address


@pytest.mark.parametrize("text", ["", "localhost", "host:", ":http", ":70000", "10.0.0.1:-1", "[::1]"])
def test_bad_listen_addresses_name_the_option_and_the_fix(text):
    with pytest.raises(ConfigError, match=r"--listen: cannot read address .*127\.0\.0\.1:9400"):
        parse_listen(text)


def test_listen_serves_the_prom_file_series_on_loopback_and_stops_with_its_thread(tmp_path):
    report = _report_from(evaluate(context([sample(0), sample(30, full_token_usage=0.95)])))
    write_prometheus(report, tmp_path / "drift.prom")
    collector = DriftCollector()
    with MetricsServer(*parse_listen(":0"), collector) as server:
        host, port = server.address
        assert host == "127.0.0.1" and port > 0 and server.url == f"http://127.0.0.1:{port}/metrics"
        before = httpx.get(server.url)
        assert before.status_code == 200 and _values(before.text) == {}  # no cycle yet: no series
        collector.report = report
        served = httpx.get(server.url)
        assert [t.name for t in threading.enumerate()].count(THREAD_NAME) == 1
    assert served.headers["content-type"].startswith("text/plain")
    assert served.text == (tmp_path / "drift.prom").read_text()  # the same series, byte for byte
    values = _values(served.text)
    assert values[("autotune_drift", URL, "kv_pressure")] == 1.0
    assert {rule for (name, _, rule) in values if name == "autotune_drift"} == set(RULES)
    assert values[("autotune_watch_up", "http://127.0.0.1:9", None)] == 0.0
    assert values[("autotune_watch_last_cycle_timestamp_seconds", None, None)] == 100.0
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1.0)


def test_a_busy_listen_port_is_one_config_error_naming_the_option():
    with MetricsServer("127.0.0.1", 0, DriftCollector()) as first:
        port = first.address[1]
        with pytest.raises(ConfigError, match=rf"--listen: cannot listen on 127\.0\.0\.1:{port} .*free port"):
            MetricsServer("127.0.0.1", port, DriftCollector()).start()
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("2m", 120.0), ("1.5h", 5400.0), ("250ms", 0.25), ("45", 45.0)]
)
def test_durations(text, seconds):
    assert parse_duration(text, option="--interval") == seconds


@pytest.mark.parametrize("text", ["", "0s", "fast", "3d", "-1m"])
def test_bad_durations_name_the_option_and_the_fix(text):
    with pytest.raises(ConfigError, match=r"--interval: cannot read duration .*write e\.g\. 30s"):
        parse_duration(text, option="--interval")


# ---------------------------------------------------------------- a long run against a recorded server
def _counting_server(methods: set[str]) -> httpx.MockTransport:
    """The recorded real server, its /metrics reduced to the series watch reads (parsing is most of a cycle's
    cost), whose counters grow with every scrape."""
    scrapes = [0]
    metrics = watched_lines(METRICS)

    def handler(request: httpx.Request) -> httpx.Response:
        methods.add(request.method)  # a set: the harness itself must not grow with the run
        if request.url.path == "/server_info":
            return httpx.Response(200, headers={"content-type": "application/json"}, text=SERVER_INFO)
        if request.url.path == "/metrics":
            scrapes[0] += 1
            n = scrapes[0]
            text = re.sub(
                r"^(sglang:(?:num_requests_total|prompt_tokens_total)\{[^}]*\}) [0-9.]+$",
                lambda m: f"{m[1]} {float(n)}",
                metrics,
                flags=re.MULTILINE,
            )
            return httpx.Response(200, headers={"content-type": "text/plain"}, text=text)
        return httpx.Response(404, headers={"content-type": "application/json"}, text="{}")

    return httpx.MockTransport(handler)


@pytest.mark.slow
@pytest.mark.timeout(300)  # tracemalloc slows every allocation several times over
def test_memory_stays_flat_over_many_windows_of_samples_and_watch_only_reads(tmp_path):
    methods: set[str] = set()
    options = WatchOptions(
        interval_s=0.05, window_s=1.0, state_path=tmp_path / "state.json", out_dir=tmp_path / "watch"
    )
    with Watcher([URL], None, options, transport=_counting_server(methods)) as watcher:
        for i in range(50):  # warm up: the window fills, caches and imports settle
            watcher.cycle(now=i * 0.05)
        size = (tmp_path / "state.json").stat().st_size
        tracemalloc.start()
        try:
            for i in range(50, 100):  # the window turns over twice: what it holds is now all traced
                watcher.cycle(now=i * 0.05)
            gc.collect()  # httpx responses hold reference cycles: count only what is really kept
            held, _ = tracemalloc.get_traced_memory()
            for i in range(100, 300):  # 200 more samples: 9 windows' worth
                report = watcher.cycle(now=i * 0.05)
            gc.collect()
            later, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert 20 <= len(watcher.state.servers[URL].window) <= options.max_samples
    # one kept sample is ~5 KB: a window that leaked would grow by ~1 MB here
    assert later - held < 100_000, f"grew {later - held:,} bytes over 200 samples (held {held:,})"
    assert abs((tmp_path / "state.json").stat().st_size - size) < 0.05 * size
    assert report.exit_code == 0 and lines(report)[0].endswith("no drift")
    assert methods == {"GET"}
