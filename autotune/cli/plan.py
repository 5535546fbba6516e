"""``autotune plan``: SGLang's memory plan for a model, GPU and flags, without starting anything."""

from __future__ import annotations

import json
import re

import click
from rich.console import Console
from rich.table import Table

from autotune.sglang.envs import parse_envs
from autotune.sglang.flags import parse_sets
from autotune.sglang.gpus import GPUS, GpuProfile
from autotune.sglang.memory import plan as make_plan
from autotune.sglang.profiles import ModelProfile, load_gpu, load_model


@click.command("plan")
@click.option(
    "--model",
    "model_name",
    required=True,
    help="Bundled profile (qwen3.6-27b, qwen3-next-80b-a3b), a folder with config.json (and the "
    "safetensors index for exact weights), or a HuggingFace id.",
)
@click.option("--gpu", "gpu_name", required=True, help=f"GPU profile: {', '.join(GPUS)}.")
@click.option("--gpu-memory-mib", type=click.IntRange(min=1), help="Override the GPU's total memory (MiB).")
@click.option("--free-gib", type=click.FloatRange(min=0), help="Memory free before load (default: total − context).")
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="FLAG=VALUE",
    help="An SGLang flag, e.g. --set max-mamba-cache-size=200 (repeatable; switches as FLAG=true).",
)
@click.option(
    "--env",
    "envs",
    multiple=True,
    metavar="NAME=VALUE",
    help="An SGLang environment variable for the server, e.g. --env SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1 (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(
    model_name: str,
    gpu_name: str,
    gpu_memory_mib: int | None,
    free_gib: float | None,
    sets: tuple[str, ...],
    envs: tuple[str, ...],
    as_json: bool,
) -> None:
    """Print what SGLang 0.5.23 would allocate, and whether it would start."""
    flags, env = parse_sets(sets), parse_envs(envs)
    model, gpu = load_model(model_name), load_gpu(gpu_name, memory_mib=gpu_memory_mib)
    memory_plan = make_plan(model, gpu, flags, free_gib=free_gib, env=env)
    data = {**memory_plan.to_dict(), "sources": sources(model, gpu, overridden=gpu_memory_mib is not None)}
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    _render(data, env)


_WEIGHTS_FROM = {
    "index": "the safetensors index's total_size",
    "headers": "the shards' safetensors headers",
    "arithmetic": "an estimate from config.json (no safetensors index beside it)",
}


def sources(model: ModelProfile, gpu: GpuProfile, *, overridden: bool) -> dict[str, str]:
    """Where the plan's inputs came from: the model's family and weights, the GPU's memory."""
    quant = "" if model.quant_method == "none" else f", {model.quant_method} weights"
    return {
        "model": f"{model.name}: {model.family_name} family ({model.model_type}){quant}",
        "weights": f"{_WEIGHTS_FROM.get(model.weights_source, model.weights_source)} "
        f"({model.target_weights_gib:.2f} GiB target"
        f"{f', {model.draft_weights_gib:.2f} GiB MTP draft' if model.mtp_layers else ''})",
        "gpu": f"{gpu.name} profile, {gpu.memory_mib:,} MiB ({'--gpu-memory-mib' if overridden else 'nvidia-smi'}"
        f"), {gpu.arch}",
    }


def _render(data: dict, env: dict[str, str] | None = None) -> None:
    console = Console()
    extra = data["extra"]
    verdict = "[green]fits[/green]" if data["fits"] else f"[red]{data['failure']}[/red]"
    console.print(
        f"Plan: {verdict}  mem_fraction_static={data['mem_fraction_static']}  "
        f"strategy={extra.get('strategy')}  ratio={extra.get('ratio')}  "
        f"D={extra.get('draft_tokens')}  page_size={extra.get('page_size')}"
    )
    summary = Table(show_header=False, box=None)
    for name, text in data.get("sources", {}).items():
        summary.add_row(name, text)
    summary.add_row("max_running_requests", f"{data['max_running_requests']} (binding: {extra.get('binding')})")
    summary.add_row("max_mamba_cache_size", str(data["max_mamba_cache_size"]))
    if env:
        summary.add_row("environment", " ".join(f"{k}={v}" for k, v in env.items()))
    summary.add_row("kv_tokens", f"{data['kv_tokens']:,}")
    for name, text in lever_rows(extra):
        summary.add_row(name, text)
    if extra.get("mamba_tree"):
        summary.add_row("Mamba states on prefixes", tree_levers(extra))
    summary.add_row("modelled startup", f"{extra.get('startup_s', 0):.0f} s")
    if data["inert"]:
        summary.add_row("inert flags", ", ".join(data["inert"]))
    console.print(summary)
    table = Table(title="GPU memory (GiB)")
    table.add_column("pool")
    table.add_column("GiB", justify="right")
    for key, value in data["gib"].items():
        table.add_row(key, f"{value:.2f}")
    console.print(table)
    if data["message"]:
        console.print(data["message"], style="red" if data["failure"] else "yellow", markup=False)
        advice = inert_advice(data["message"], data["inert"])
        if advice:
            console.print(advice, markup=False)


def lever_rows(extra: dict) -> list[tuple[str, str]]:
    """What --enable-unified-memory and --speculative-adaptive did to this plan, one row each (none when unset)."""
    rows = []
    arena = extra.get("unified")
    if arena:
        rows.append(
            (
                "unified arena",
                f"{arena['total_gib']:.2f} GiB shared by KV and Mamba state: "
                f"{arena['tokens']:,} KV tokens with no state in it, one state displaces "
                f"{arena['state_tokens']:,} (kv_tokens above is SGLang's boot label)",
            )
        )
    adaptive = extra.get("adaptive")
    if adaptive:
        slots = ", ".join(f"bs≥{k}: {v['candidate_steps']}" for k, v in adaptive["slots"].items())
        rows.append(
            (
                "adaptive steps",
                f"starts at {adaptive['initial_steps']} ({slots}); buffers and Mamba "
                f"scratch for D={adaptive['max_draft_tokens']}",
            )
        )
    for note in extra.get("warnings") or []:
        if str(note).startswith(("speculative_adaptive disabled", "--enable-unified-memory:")):
            rows.append(("lever note", str(note)))
    return rows


def tree_levers(extra: dict) -> str:
    """What the radix cache keeps of Mamba state (--mamba-track-interval, --mamba-max-states-per-path): no pool
    is sized by either, so the memory above is the same for any value (docs/sglang-memory.md §1)."""
    cap = extra.get("mamba_max_states_per_path")
    per_path = f"at most {cap} per path" if cap else "unlimited per path"
    if extra.get("mamba_track_interval") is None:
        return f"at each prompt's end (no_buffer), {per_path}; no memory"
    return (
        f"prefill: one at each chunk's end or branch point on a {extra['mamba_checkpoint_grid']}-token grid; "
        f"decode: every {extra['mamba_track_grid']} tokens (track interval {extra['mamba_track_interval']}); "
        f"{per_path}; no memory"
    )


def inert_advice(message: str, inert: list[str]) -> str | None:
    """When SGLang's message advises a flag this plan found inert, say so and which of its advice still applies
    (the plan must never send the user to a flag that changes nothing here)."""
    advised = list(dict.fromkeys(m.group(1) for m in re.finditer(r"--([a-z][a-z0-9-]+)", message)))
    dead = [flag for flag in advised if flag.replace("-", "_") in set(inert)]
    if not dead:
        return None
    live = [f"--{flag}" for flag in advised if flag not in dead]
    names = ", ".join(f"--{flag}" for flag in dead)
    rest = f"; change {' or '.join(live)} instead" if live else ""
    return f"autotune: {names} {'is' if len(dead) == 1 else 'are'} inert for this config (no effect here){rest}."
