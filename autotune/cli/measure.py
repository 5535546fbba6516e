"""``autotune measure``: one trial outside any study — start a server, replay the sample, stop, print."""

from __future__ import annotations

import json
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

import autotune
from autotune.config import Timeouts
from autotune.config.context import misfit_reason
from autotune.errors import ConfigError, WorkloadError
from autotune.harness.engines import ENGINES, make_engine
from autotune.harness.setup import TrialHooks, TrialSetup
from autotune.harness.tenancy import check_engine_gpu
from autotune.harness.trial import run_trial
from autotune.harness.workload import PromptSample, WorkloadSpec
from autotune.progress import PhaseInfo, settling_line
from autotune.prompts import REPEATS
from autotune.search.signals import sigint_stops
from autotune.settle import TARGET_HALF_WIDTH
from autotune.sglang.flags import parse_sets

DEFAULT_PROMPTS = Path("examples") / "prompts.jsonl"
FAILED_TRIAL_EXIT = 3


def load_config_file(path: Path) -> dict[str, Any]:
    """SGLang flags from a .toml/.yaml/.json mapping (a top-level ``flags`` table is also accepted)."""
    if not path.is_file():
        raise ConfigError("config file not found", file=str(path), fix="pass an existing .toml, .yaml or .json file")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"unsupported config type {suffix!r}", file=str(path), fix="use .toml, .yaml or .json")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parser's error becomes one line naming the file
        raise ConfigError(f"cannot parse: {exc}", file=str(path), fix="fix the syntax") from exc
    if isinstance(data, dict) and set(data) == {"flags"}:
        data = data["flags"]
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping of SGLang flags", file=str(path), fix="e.g. max-mamba-cache-size = 200")
    return data


def resolve_prompts(path: Path | None) -> Path:
    """The given file, else examples/prompts.jsonl in the cwd or beside the package."""
    if path is not None:
        if not path.is_file():
            raise WorkloadError("prompts file not found", file=str(path), fix="pass --prompts with a JSONL file")
        return path
    for candidate in (Path.cwd() / DEFAULT_PROMPTS, Path(autotune.__file__).resolve().parents[1] / DEFAULT_PROMPTS):
        if candidate.is_file():
            return candidate
    raise WorkloadError("no prompt sample given and examples/prompts.jsonl not found", fix="pass --prompts FILE.jsonl")


# The spec's fields as this command's options, for the messages a trial writes (``WorkloadSpec.option``).
MEASURE_OPTIONS = {
    "measure_s": "--window",
    "warmup_s": "--warmup",
    "measure_max_s": "--window-max",
    "warmup_max_s": "--warmup-max",
    "target_half_width": "--target-half-width",
    "ramp_s": "--ramp",
    "concurrency": "--concurrency",
    "max_tokens": "--max-tokens",
    "sample_size": "--sample",
    "repeats": "--repeats",
}


def workload_of(**fields: Any) -> WorkloadSpec:
    """The study's workload record built from this command's options; a bad value is one line naming its option."""
    try:
        return WorkloadSpec(**fields).named_by(MEASURE_OPTIONS)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        name = str(error["loc"][0]) if error["loc"] else ""
        option = MEASURE_OPTIONS.get(name, f"--{name.replace('_', '-')}")
        raise WorkloadError(error["msg"].removeprefix("Value error, "), key=option) from None


def _sim_options(items: tuple[str, ...]) -> dict[str, str | bool]:
    """``--sim-opt KEY=VALUE`` items as the simulator's options: the value as given, ``true`` as True."""
    out: dict[str, str | bool] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--sim-opt expects KEY=VALUE, got {item!r}", fix="e.g. --sim-opt startup_s=0.3")
        out[key.strip()] = True if value.strip().lower() == "true" else value.strip()
    return out


@click.command("measure")
# Not a click.Choice: an unknown name is make_engine's one-line ConfigError (exit 1), like every bad input here.
@click.option(
    "--engine", "engine_name", default="sim", show_default=True, help=f"One of: {', '.join(sorted(ENGINES))}."
)
@click.option("--model", default="qwen3.6-27b", show_default=True, help="Model path (sglang) or profile (sim).")
@click.option("--gpu", default="b200", show_default=True, help="Simulated GPU profile (sim engine).")
@click.option("--gpu-index", default=0, show_default=True, type=int, help="Which device the server runs on.")
@click.option(
    "--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), help="Flags file (.toml/.yaml/.json)."
)
@click.option(
    "--set", "sets", multiple=True, metavar="FLAG=VALUE", help="An SGLang flag (repeatable; overrides --config)."
)
@click.option(
    "--prompts", type=click.Path(path_type=Path, dir_okay=False), help="JSONL prompt sample [examples/prompts.jsonl]."
)
@click.option("--sample", default=200, show_default=True, type=click.IntRange(min=1), help="Rows in the fixed sample.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sample.")
@click.option(
    "--warmup",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Warm-up floor, seconds: it runs on until the load stops rising (at most --warmup-max).",
)
@click.option(
    "--window",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Window floor, seconds: it runs on until the estimate is within --target-half-width.",
)
@click.option("--warmup-max", type=click.FloatRange(min=0), help="Warm-up cap, seconds [4 × --warmup].")
@click.option("--window-max", type=click.FloatRange(min=0.1), help="Window cap, seconds [4 × --window].")
@click.option(
    "--target-half-width",
    default=TARGET_HALF_WIDTH,
    show_default=True,
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    help="The window's 95% half-width, as a share of its tok/s, at which it may end.",
)
@click.option("--ramp", type=click.FloatRange(min=0), help="Streams start over this many seconds [half of --warmup].")
@click.option("--concurrency", type=click.IntRange(min=1), help="Requests in flight [2 × max running requests].")
@click.option("--max-tokens", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--endpoint", default="generate", show_default=True, type=click.Choice(["generate", "completions", "chat"])
)
@click.option("--ignore-eos", is_flag=True, help="Force every request to max tokens.")
@click.option(
    "--repeats",
    type=click.Choice(REPEATS),
    default="fresh",
    show_default=True,
    help="A prompt sent again when the sample comes round: marked per pass (fresh) or the same text.",
)
@click.option("--python", "python", help="Interpreter with sglang installed (sglang engine).")
@click.option(
    "--device", default="cuda", show_default=True, type=click.Choice(["cuda", "cpu"]), help="sglang engine device."
)
@click.option("--sim-opt", "sim_opts", multiple=True, metavar="KEY=VALUE", help="Simulator option, e.g. startup_s=0.3.")
@click.option("--startup-timeout", default=900.0, show_default=True, type=click.FloatRange(min=1), help="Seconds.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), help="Trial directory [runs/measure-<time>].")
@click.option("--json", "as_json", is_flag=True, help="Print the TrialResult as JSON.")
def measure(
    engine_name,
    model,
    gpu,
    gpu_index,
    config_file,
    sets,
    prompts,
    sample,
    seed,
    warmup,
    window,
    warmup_max,
    window_max,
    target_half_width,
    ramp,
    concurrency,
    max_tokens,
    endpoint,
    ignore_eos,
    repeats,
    python,
    device,
    sim_opts,
    startup_timeout,
    out,
    as_json,
) -> None:
    """Run one trial: start a server with the given flags, replay the sample, stop it, print the result.

    --warmup and --window are floors: both run on until the settle rule is met, at most to their caps.

    Exit status: 0 when the trial is ok, 3 when it failed (OOM, crash, timeout), 1 for bad input.
    """
    if ramp is not None and ramp > warmup:
        raise WorkloadError(
            f"--ramp ({ramp:g}) must lie within the warm-up floor (--warmup {warmup:g})",
            key="ramp",
            fix="lower --ramp or raise --warmup",
        )
    for cap, value, floor, least in (
        ("--warmup-max", warmup_max, "--warmup", warmup),
        ("--window-max", window_max, "--window", window),
    ):
        if value is not None and value < least:
            raise WorkloadError(f"{cap} ({value:g}) is below {floor} ({least:g})", fix=f"raise {cap} or omit it")
    engine = make_engine(
        engine_name, model_path=model, python=python, sim_gpu=gpu, sim_options=_sim_options(sim_opts), device=device
    )
    config = load_config_file(config_file) if config_file else {}
    config = {**engine.check(config), **parse_sets(sets)}
    config = engine.check(config)  # bad flags end here, before any server starts
    engine.preflight()
    check_engine_gpu(engine, gpu_index)  # a GPU another process holds would measure what the tenant left
    spec = workload_of(
        prompts=resolve_prompts(prompts),
        sample_size=sample,
        seed=seed,
        max_tokens=max_tokens,
        concurrency=concurrency,
        warmup_s=warmup,
        measure_s=window,
        endpoint=endpoint,
        ignore_eos=ignore_eos,
        repeats=repeats,
        warmup_max_s=warmup_max,
        measure_max_s=window_max,
        target_half_width=target_half_width,
        ramp_s=ramp,
    )
    loaded = PromptSample.load(spec.prompts, spec.sample_size, spec.seed)
    # A prompt over the model's context is bad input, one Error: line; check it before warning about the sample.
    misfit_reason(model, config, loaded, spec.max_tokens)
    if loaded.note:
        click.echo(f"Warning: {loaded.note}", err=True)
    trial_dir = out or Path("runs") / time.strftime("measure-%Y%m%d-%H%M%S")
    stop = threading.Event()

    last = [0.0]

    def phase(name: str, info: PhaseInfo) -> None:
        if as_json:
            return
        if name != "measuring":
            click.echo(f"[{name}]", err=True)
        elif time.monotonic() - last[0] >= 2.0:  # a live figure every couple of seconds, not every tick
            last[0] = time.monotonic()
            click.echo(
                f"[measuring] {info.get('tok_s', 0):,.0f} tok/s, {info.get('completed', 0)} done, "
                f"{info.get('errors', 0)} errors",
                err=True,
            )

    setup = TrialSetup(
        engine=engine, workload=spec, sample=loaded, gpu_index=gpu_index, timeouts=Timeouts(startup_s=startup_timeout)
    )
    with sigint_stops(stop):  # Ctrl-C: the trial stops its server cleanly and reports "interrupted"; twice: at once
        result = run_trial(setup, config, trial_dir=trial_dir, hooks=TrialHooks(on_phase=phase, stop_event=stop))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        _render(result, host_memory=device == "cpu")
    if not result.ok:
        raise SystemExit(FAILED_TRIAL_EXIT)


def _render(result, *, host_memory: bool = False) -> None:
    """The result as a table; a CPU server (``host_memory``) has no GPU: its peak is host RAM and no startup is
    modelled (the startup model is a GPU's)."""
    console = Console()
    colour = "green" if result.ok else "red"
    console.print(f"Trial [{colour}]{result.status}[/{colour}]  ({result.trial_dir})")
    if result.reason:
        console.print(f"  reason: {result.reason}")
    table = Table(show_header=False, box=None)
    m, cap, g = result.metrics, result.capacity, result.host or result.gpu
    if m is not None:
        table.add_row("output tok/s", f"{m.output_tok_s:,.1f}")
        table.add_row(
            "requests/s",
            f"{m.request_s:.3f}  (completed {m.completed}, errors {m.errors}, concurrency {m.concurrency})",
        )
        for name, p in (("TTFT ms", m.ttft_ms), ("ITL ms", m.itl_ms), ("E2E ms", m.e2e_ms)):
            if p.p50 is not None:
                table.add_row(name, f"p50 {p.p50:,.1f}  p90 {p.p90:,.1f}  p99 {p.p99:,.1f}  mean {p.mean:,.1f}")
        if m.accept_length is not None:
            table.add_row("accept length", f"{m.accept_length:.3f}")
    if cap is not None:
        table.add_row("max running requests", str(cap.max_running_requests))
        table.add_row("KV tokens / Mamba slots", f"{cap.kv_tokens} / {cap.mamba_slots}")
    if g is not None and g.peak_used_gib is not None:
        if host_memory:
            table.add_row("host memory peak", f"{g.peak_used_gib:.2f} GiB (the server's processes and files)")
        else:
            table.add_row("GPU peak used", f"{g.peak_used_gib:.2f} GiB of {g.total_gib or 0:.2f}")
    settled = settling_line(result.measurement)
    if settled:
        table.add_row("settling", settled)
    table.add_row("durations s", ", ".join(f"{k} {v:.2f}" for k, v in result.durations_s.items()))
    if result.modelled_startup_s is not None and not host_memory:
        table.add_row("modelled startup s", f"{result.modelled_startup_s:.1f}")
    console.print(table)
