"""The simulated server's command line: SGLang 0.5.23's own parser, rebuilt from the bundled flag table.

Every SGLang flag keeps its type, choices, nargs and store-true/boolean-optional action, and prefix matching
stays on as in SGLang, so ``--tp 2`` works and ``--cuda-graph-max-bs`` is an *ambiguous option*. Removed flags
(``--mamba-scheduler-strategy``) are argparse errors (exit 2), exactly what a real launch would print. The
``--sim-*`` flags steer the simulation and never reach the memory planner.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import yaml

from autotune.sglang.flags import FlagRow
from autotune.sim.requests import OUTPUT_DISTS

PROG = "autotune.sim"
DEFAULT_GPU_ENV = "AUTOTUNE_SIM_GPU"
_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """SGLang's token-count type: ``32k`` = 32,000, ``32K`` = 32,768, plain integers as is."""
    raw = str(text).strip()
    if raw and raw[-1] in _SUFFIX:
        return int(float(raw[:-1]) * _SUFFIX[raw[-1]])
    return int(raw)


def nullable_str(text: str) -> str | None:
    return None if text in ("None", "none", "") else text


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_TYPES = {
    "str": str,
    "int": int,
    "float": float,
    "human_readable_int": human_readable_int,
    "nullable_str": nullable_str,
    "loads": json.loads,
    "json_list_type": json.loads,
    "parse_cuda_graph_backend_arg": str,
    "parse_cuda_graph_config_arg": _json_or_text,
}


@cache
def flag_table() -> tuple[FlagRow, ...]:
    """The 532 options of SGLang 0.5.23's parser, as recorded from the real one."""
    text = resources.files("autotune").joinpath("data/sglang-0.5.23-flags.json").read_text()
    return tuple(json.loads(text))


def sglang_defaults() -> dict[str, Any]:
    """Every SGLang dest with its parser default (what ``server_args`` shows for flags not given)."""
    return {row["dest"]: row["default"] for row in flag_table() if row["dest"] not in ("help", "config")}


def _add_sglang_flag(parser: argparse.ArgumentParser, row: FlagRow) -> None:
    names = [name for name in row["flags"] if not name.startswith("--no-")]
    dest, default = row["dest"], argparse.SUPPRESS  # only given flags land in the namespace
    if row["is_store_true"]:
        parser.add_argument(*names, action="store_true", dest=dest, default=default)
    elif row["nargs"] == 0:  # --x / --no-x pairs (BooleanOptionalAction in SGLang)
        parser.add_argument(*names, action=argparse.BooleanOptionalAction, dest=dest, default=default)
    else:
        kwargs: dict[str, Any] = {"type": _TYPES.get(row["type"] or "str", str)}
        if row["choices"] is not None:
            kwargs["choices"] = row["choices"]
        if row["nargs"] is not None:
            kwargs["nargs"] = row["nargs"]
        parser.add_argument(*names, **kwargs, dest=dest, default=default)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _flag_names(text: str) -> tuple[str, ...]:
    """``chunked-prefill-size,--schedule-policy`` → SGLang dests; an unknown name is an argparse error."""
    by_name = {name.lstrip("-").replace("-", "_"): row["dest"] for row in flag_table() for name in row["flags"]}
    out = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        dest = by_name.get(raw.lstrip("-").replace("-", "_"))
        if dest is None:
            raise argparse.ArgumentTypeError(f"{raw!r} is not an SGLang 0.5.23 flag")
        out.append(dest)
    return tuple(out)


def _add_sim_flags(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("simulation (not SGLang flags)")
    sim.add_argument("--sim-gpu", default=os.environ.get(DEFAULT_GPU_ENV, "b200"), help="GPU profile name")
    sim.add_argument("--sim-gpu-memory-mib", type=int, default=None, help="override the device's total memory")
    sim.add_argument("--sim-seed", type=int, default=0)
    sim.add_argument(
        "--sim-startup-s", type=float, default=1.0, help="real seconds spent 'loading' before the port opens"
    )
    sim.add_argument("--sim-warmup-s", type=float, default=0.3, help="seconds the port is open but /health is 503")
    sim.add_argument("--sim-acceptance", type=float, default=0.825, help="mean per-token draft acceptance")
    sim.add_argument("--sim-output-mean", type=int, default=2500, help="mean natural output length (tokens)")
    sim.add_argument(
        "--sim-output-dist", default="lognormal", choices=OUTPUT_DISTS, help="distribution of natural output lengths"
    )
    sim.add_argument("--sim-noise", type=float, default=0.0, help="relative noise on step times")
    sim.add_argument(
        "--sim-launch-cv",
        type=float,
        default=0.0,
        help="a relaunch's own speed (graph capture, allocator layout): each server start runs at "
        "exp(CV·z) of the modelled speed, z drawn fresh per start (0: every start alike)",
    )
    # Where the simulated machine departs from the planner's model (autotune/sim/truth.py); the planner never sees it.
    sim.add_argument(
        "--sim-free-gib-delta",
        type=float,
        default=0.0,
        help="GiB more (negative: less) free after the weights and pools than the planner's model, "
        "unseen by SGLang's profile (fragmentation, NCCL/cuBLAS workspaces): moves the room for "
        "CUDA graphs and activations",
    )
    sim.add_argument(
        "--sim-activation-scale",
        type=_positive_float,
        default=1.0,
        help="the activation/workspace peak is this multiple of the planner's",
    )
    sim.add_argument(
        "--sim-graph-scale",
        type=_positive_float,
        default=1.0,
        help="CUDA-graph memory is this multiple of the planner's",
    )
    sim.add_argument(
        "--sim-decode-efficiency",
        type=_positive_float,
        default=1.0,
        help="achieved bandwidth/compute share is this multiple of the speed model's",
    )
    sim.add_argument(
        "--sim-unified-efficiency",
        type=_positive_float,
        default=1.0,
        help="and a further multiple of it with --enable-unified-memory (translation, compaction)",
    )
    sim.add_argument(
        "--sim-adaptive-efficiency",
        type=_positive_float,
        default=1.0,
        help="and a further multiple of it with --speculative-adaptive (state swaps, the EMA's lag)",
    )
    sim.add_argument(
        "--sim-speedup",
        type=_positive_float,
        default=1.0,
        help="pace the modelled clock this many times faster than real time (tests and benchmarks: a "
        "rate the host's CPU cannot pace, which the harness must refuse)",
    )
    sim.add_argument(
        "--sim-stall",
        action="store_true",
        help="once ready, accept requests and hold their streams open without ever serving them (a "
        "server starved of memory or CPU: tests of the window's wall-time bound)",
    )
    sim.add_argument(
        "--sim-numerics-flags",
        type=_flag_names,
        default=(),
        metavar="FLAG[,FLAG]",
        help="flags outside SGLang's numerics table that change greedy outputs on this server anyway, "
        "at any value other than SGLang's default (sim/divergence.py)",
    )
    sim.add_argument("--sim-release-s", type=float, default=1.0, help="GPU memory release delay after exit")
    sim.add_argument("--sim-device-dir", default=None, help="simulated GPU registry (default $AUTOTUNE_SIM_DEVICE_DIR)")
    sim.add_argument(
        "--sim-shm",
        nargs="?",
        const="/dev/shm",
        default=None,
        metavar="DIR",
        help="leave SGLang-like shared-memory files in DIR (default /dev/shm), as a real server does",
    )


@cache
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Simulated SGLang 0.5.23 server.")
    for row in flag_table():
        if row["dest"] != "help":
            _add_sglang_flag(parser, row)
    _add_sim_flags(parser)
    return parser


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """The simulator's own ``--sim-*`` knobs as parsed (not SGLang flags; the parser above holds their defaults)."""

    gpu: str
    gpu_memory_mib: int | None
    seed: int
    startup_s: float
    warmup_s: float
    acceptance: float
    output_mean: int
    output_dist: str
    noise: float
    launch_cv: float
    free_gib_delta: float
    activation_scale: float
    graph_scale: float
    decode_efficiency: float
    unified_efficiency: float
    adaptive_efficiency: float
    speedup: float
    stall: bool
    numerics_flags: tuple[str, ...]
    release_s: float
    device_dir: str | None
    shm: str | None


@dataclass(frozen=True, kw_only=True)
class SimArgs:
    """A parsed command line: SGLang flags given (by dest), all of SGLang's args, and the simulation knobs."""

    flags: dict[str, Any]  # only the SGLang flags on the command line: what the planner gets
    server_args: dict[str, Any]  # defaults overlaid with ``flags`` (before resolution)
    sim: SimOptions
    argv: list[str] = field(default_factory=list)

    @property
    def launch_command(self) -> str:
        return " ".join(self.argv)


def _config_argv(path: str) -> list[str]:
    """SGLang's ``--config FILE.yaml`` merge: keys become ``--key`` verbatim, true → bare flag, false dropped."""
    if not path.endswith((".yaml", ".yml")):
        build_parser().error(f"--config {path}: only .yaml/.yml files are supported")
    try:
        data = yaml.safe_load(open(path)) or {}
    except (OSError, yaml.YAMLError) as exc:
        build_parser().error(f"--config {path}: {exc}")
    if not isinstance(data, dict):
        build_parser().error(f"--config {path}: expected a mapping of flag names to values")
    out: list[str] = []
    for key, value in data.items():
        if value is False or value is None:
            continue
        out.append(f"--{key}")
        if value is True:
            continue
        if isinstance(value, list):
            out.extend(str(v) for v in value)
        elif isinstance(value, dict):
            out.append(json.dumps(value))
        else:
            out.append(str(value))
    return out


def _expand_config(argv: list[str]) -> list[str]:
    # Only the separate-token form is merged (``--config=path`` is silently not, as in SGLang); config args go
    # first so command-line values win.
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        build_parser().error("argument --config: expected one argument")
    rest = argv[:i] + argv[i + 2 :]
    return _config_argv(argv[i + 1]) + rest


def parse(argv: list[str]) -> SimArgs:
    """Parse a sim command line; argparse errors exit 2 with SGLang's wording."""
    parser = build_parser()
    expanded = _expand_config(list(argv))
    ns = vars(parser.parse_args(expanded))
    ns.pop("config", None)
    sim = SimOptions(**{key[4:]: ns.pop(key) for key in list(ns) if key.startswith("sim_")})
    if "model_path" not in ns:
        parser.error("the following arguments are required: --model-path")
    flags = {k: v for k, v in ns.items() if v is not None and v is not False}
    server_args = {**sglang_defaults(), **ns}
    return SimArgs(flags=flags, server_args=server_args, sim=sim, argv=list(argv))
