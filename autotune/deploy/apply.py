"""The confirmed winner of a study → the files that run it: ``sglang.yaml``, ``launch_fleet.sh``,
``fleet.toml`` and ``provenance.json``.

``sglang.yaml`` is written in the form SGLang's own ``--config`` loader reads (dash keys, store-true flags as
``true``, lists as YAML lists). A few flags cannot live there (SGLang rejects BooleanOptionalAction flags and
two deprecated ones in YAML), so those travel on the launch command line instead, where they still apply.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState
from pydantic import ValidationError

from autotune.config.sections import engine_kind
from autotune.deploy import fleetkeys, fleettls, router
from autotune.deploy import sglang_yaml as yaml_files
from autotune.deploy.confirmed import confirmed_figures
from autotune.deploy.fleet import Fleet, FleetServer, device_argv, engine_for, write_fleet
from autotune.deploy.fleet import server_gpus as launch_group
from autotune.deploy.fleetfile import KEYS_DIR, TLS_CA, spans
from autotune.deploy.inflight import client_advice
from autotune.deploy.launchscript import ScriptEntry, launch_script
from autotune.deploy.ports import pick_ports
from autotune.deploy.sglang_yaml import PER_SERVER, config_diff, read_config_file, split_config, yaml_text
from autotune.errors import ConfigError, StudyError
from autotune.launch.local import LocalLauncher
from autotune.redaction import env_for_files
from autotune.results import Capacity, StressResult, TrialResult
from autotune.search.confirm.decision import Verdict
from autotune.search.confirm.record import Confirmation
from autotune.search.numerics import contender_result
from autotune.search.objective import per_gpu
from autotune.search.storage import load_study
from autotune.search.views.jobtypes import JobView
from autotune.search.views.jobview import job_for_study
from autotune.search.views.settings import StudySettings
from autotune.search.views.summary import verdict_note
from autotune.search.views.worstcase import WorstCase, worst_case_block
from autotune.sglang.envs import env_strings, split_env
from autotune.sglang.flags import FlagTable
from autotune.sglang.parallel import server_gpus

VISIBLE = "CUDA_VISIBLE_DEVICES"  # the launch script sets it per server, as the local launcher does

SGLANG_VERSION = "0.5.23"


# -- reading the winner from a study ---------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Winner:
    """The trial to deploy and what the study measured for it (what a rollout verifies against)."""

    study: str
    trial: int
    config: dict[str, Any]
    result: TrialResult
    tok_s: float | None
    tok_s_runs: list[float] = field(default_factory=list)
    confirmed: bool = False
    gain: float | None = None
    gain_ci: tuple[float | None, float | None] = (None, None)
    baseline_config: dict[str, Any] | None = None
    settings: StudySettings = field(default_factory=StudySettings)  # the study's user_attrs["autotune"], as read
    job: JobView | None = None  # [job]: the job's hours before and after (``search.views.jobview``)
    worst_case: WorstCase | None = None  # the stress phase's verdict (``search.confirm.stress``)
    verdict: str = ""  # the confirmation's verdict as every view says it (``views.summary.verdict_note``)

    @property
    def capacity(self) -> Capacity | None:
        return self.result.capacity

    @property
    def engine(self) -> str:
        return str(self.settings.kind or self.result.engine or "sim")

    @property
    def simulated(self) -> bool:
        """The study ran a model of a GPU (``config.EngineKind.simulated``): its profile and ``sim_gpu`` apply."""
        return engine_kind(self.engine).simulated

    @property
    def model(self) -> str | None:
        """What the study launched: the config's model path, the simulator's profile, or the engine's model."""
        profile = self.settings.profile if self.simulated else None
        value = self.result.config.get("model_path") or profile or self.settings.model
        return None if value is None else str(value)

    @property
    def sim_gpu(self) -> str | None:
        """The simulated GPU of a simulator study; None for any other engine (a real or CPU server has none)."""
        return self.settings.sim_gpu if self.simulated else None

    @property
    def python(self) -> str | None:
        """The study's interpreter (None: the one that ran the study, i.e. autotune's own)."""
        return self.settings.python

    @property
    def device(self) -> str:
        return self.settings.device or "cuda"

    @property
    def env(self) -> dict[str, str]:
        """The study's engine environment (may hold secrets: write it only through ``redaction``)."""
        return self.settings.env

    @property
    def launcher(self) -> str:
        """Where the study's servers ran (``[engine] launcher``): the fleet's servers start the same way."""
        return self.settings.launcher

    @property
    def workload(self) -> dict[str, Any]:
        """The study's ``[workload]`` as stored (``settings.workload``)."""
        return self.settings.workload

    @property
    def gpu(self) -> str | None:
        """Where the study measured, by engine and device: the simulated GPU, "CPU", or the recorded GPU."""
        return self.settings.gpu


def load_winner(
    storage: str, study: str | None = None, *, trial: int | None = None, base_dir: Path | None = None
) -> Winner:
    """The confirmed winner (or trial ``trial``) of a study on any storage (SQLite, journal, a database server;
    ``base_dir``: where a relative journal path lives). StudyError when there is nothing to deploy."""
    loaded = load_study(storage, study, base_dir=base_dir)
    complete = {t.number: t for t in loaded.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}
    usable = {n: r for n, t in complete.items() if (r := TrialResult.of(t)) is not None and r.ok and r.metrics}
    confirmation = Confirmation.of(loaded) or Confirmation()
    verdict = confirmation.verdict or Verdict(outcome="none")
    trial = verdict.winner_trial if trial is None else trial
    if trial is None and confirmation.complete:  # confirmed, and nothing beat the baseline
        raise StudyError(
            f"study {loaded.study_name!r} has no winner to apply: "
            f"{verdict_note(loaded) or 'the confirmation found none'}; "
            "keep the current config (or pass --trial N to deploy a trial anyway)"
        )
    if trial is None:
        if not usable:
            raise StudyError(
                f"study {loaded.study_name!r} has no completed trial with a measurement; "
                "run (or resume) autotune sweep first"
            )
        trial = max(usable, key=lambda n: per_gpu(usable[n]) or 0.0)  # ranked as the study ranks: per GPU
    if trial not in usable:
        known = ", ".join(str(n) for n in sorted(usable)) or "none"
        raise StudyError(
            f"trial {trial} of study {loaded.study_name!r} is not a completed, measured trial (usable trials: {known})"
        )
    result = contender_result(usable[trial], confirmation.probe(trial))  # its fidelity: its contender probe's, if any
    figures = confirmed_figures(confirmation, verdict, trial, result)  # the estimate the sweep's summary printed
    baseline = _baseline(complete, verdict.baseline_trial)
    return Winner(
        study=loaded.study_name,
        trial=trial,
        config=dict(result.config),
        result=result,
        tok_s=figures.tok_s,
        tok_s_runs=figures.runs,
        confirmed=figures.confirmed,
        gain=figures.gain,
        gain_ci=figures.gain_ci,
        baseline_config=baseline,
        settings=StudySettings.of(loaded.user_attrs.get("autotune") or {}),
        job=job_for_study(loaded, trial),
        worst_case=worst_case_block(loaded.user_attrs, trial),
        verdict=verdict_note(loaded),
    )


def winner_from_yaml(path: Path) -> Winner:
    """An ``sglang.yaml`` to deploy; the study's figures come from the ``provenance.json`` beside it, if any."""
    path = Path(path)
    config = read_config_file(path)
    meta: dict[str, Any] = {}
    beside = path.with_name("provenance.json")
    if beside.is_file():
        try:
            meta = json.loads(beside.read_text())
        except ValueError:
            raise ConfigError("not valid JSON", file=str(beside), fix="rewrite it with autotune apply") from None
        recorded = {k: v for k, v in (meta.get("config") or {}).items() if k not in PER_SERVER}
        deployed = yaml_files.deployed_config  # the YAML holds what the fleet runs: the winner plus metrics
        if config_diff(FlagTable.bundled().check(deployed(recorded)), deployed(config)):
            meta = {}  # the YAML was edited after the study: its figures no longer describe it
    result = TrialResult(
        status="ok",
        config=config,
        engine=str(meta.get("engine") or "sglang"),
        capacity=Capacity.from_dict(meta.get("capacity")),
    )
    settings = {
        "engine": meta.get("engine"),
        "model": meta.get("model_path"),
        "gpu_name": meta.get("gpu"),
        "python": meta.get("python"),
        "device": meta.get("device"),
        "env": meta.get("env") or {},
        "sim_gpu": meta.get("sim_gpu"),
        "sim_options": meta.get("sim_options") or {},
        "workload": meta.get("workload") or {},
    }
    stored = meta.get("worst_case")  # as provenance() wrote it
    worst_case = (
        WorstCase(
            line=str(stored.get("line") or ""),
            passed=bool(stored.get("passed")),
            stress=StressResult.from_dict(stored.get("stress")),
            problem=stored.get("problem"),
        )
        if stored
        else None
    )
    return Winner(
        study=str(meta.get("study") or path.name),
        trial=int(meta.get("trial") or -1),
        config=config,
        result=result,
        tok_s=meta.get("output_tok_s"),
        settings=StudySettings.of(settings),
        confirmed=bool(meta.get("confirmed")),
        gain=meta.get("gain"),
        worst_case=worst_case,
    )


def _baseline(complete: Mapping[int, FrozenTrial], number: int | None) -> dict[str, Any] | None:
    candidates = (
        [complete[number]]
        if number is not None and number in complete
        else [t for t in complete.values() if t.user_attrs.get("role") == "baseline"]
    )
    for t in candidates:
        if (r := TrialResult.of(t)) is not None:
            return dict(r.config)
    return None


# -- artifacts -----------------------------------------------------------------------------------------
def with_config_file(argv: list[str], config_file: str) -> list[str]:
    """An engine's command reading ``config_file`` (SGLang's ``--config``, as two tokens: ``--config=path`` is
    ignored) before its first flag, so that any flag after it overrides the file."""
    first = next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))
    return [*argv[:first], "--config", config_file, *argv[first:]]


def provenance(winner: Winner, *, now: dt.datetime | None = None) -> dict[str, Any]:
    from autotune.deploy.numerics import numerics_block

    low, high = winner.gain_ci
    return {
        "study": winner.study,
        "trial": winner.trial,
        "confirmed": winner.confirmed,
        "verdict": winner.verdict or None,
        "output_tok_s": winner.tok_s,
        "output_tok_s_runs": winner.tok_s_runs,
        "gain": winner.gain,
        "gain_ci": [low, high],
        "job": winner.job,
        "capacity": winner.capacity.to_dict() if winner.capacity else None,
        "engine": winner.engine,
        "device": winner.device,
        "python": winner.python,
        "env": env_for_files(winner.env),  # secrets as ${NAME} references, never their values
        "sim_gpu": winner.sim_gpu,
        "sim_options": winner.settings.sim_options,
        "sglang_version": winner.settings.sglang_version or SGLANG_VERSION,
        "model_path": winner.model,
        "gpu": winner.gpu,
        "gpus_per_server": server_gpus(winner.config),  # the group one server spans (tp × pp × dp)
        "config": winner.config,
        "sglang_env": env_strings(winner.config),  # the environment levers the winner ran with (``[space.env]``)
        "workload": winner.settings.workload,
        # The flags that change outputs against the baseline and the fidelity probe's figures (``deploy.numerics``).
        "numerics": block.to_dict() if (block := numerics_block(winner)) else None,
        # "worst case: peak X of Y GiB, Z retractions, survived", or why not (``views.worstcase``)
        "worst_case": asdict(winner.worst_case) if winner.worst_case else None,
        "date": (now or dt.datetime.now(dt.UTC)).isoformat(timespec="seconds"),
    }


def yaml_header(winner: Winner, client: Any) -> str:
    """The comment atop every sglang.yaml the fleet runs (``apply --out``'s and each rollout's): trial, advice."""
    header = f"autotune: study {winner.study}, trial {winner.trial}, sglang {SGLANG_VERSION}\n{client}"
    if not winner.config.get(yaml_files.METRICS_FLAG):
        header += "\nenable-metrics added: the rollout's canary and autotune watch read /metrics"
    return header


def server_name(prefix: str, group: Sequence[int]) -> str:
    """``gpu3`` for one GPU, ``gpu0-1`` for a run of them, ``gpu0_2`` otherwise: a name that says the group."""
    if len(group) == 1:
        return f"{prefix}{group[0]}"
    contiguous = list(group) == list(range(group[0], group[0] + len(group)))
    return f"{prefix}{group[0]}-{group[-1]}" if contiguous else prefix + "_".join(str(g) for g in group)


def split_groups(gpus: Sequence[int], size: int, config: Mapping[str, Any]) -> list[list[int]]:
    """``gpus`` cut in order into groups of ``size`` (one server each); ConfigError if they do not split evenly."""
    if len(gpus) % size:
        fit = len(gpus) - len(gpus) % size
        hint = (
            f"e.g. {gpus[0]}-{gpus[0] + fit - 1}, "
            if fit and list(gpus) == list(range(gpus[0], gpus[0] + len(gpus)))
            else ""
        )
        raise ConfigError(
            f"{len(gpus)} GPUs do not split into servers of {size} GPUs (the winner's {spans(config)})",
            key="--gpus",
            fix=f"give a multiple of {size} GPUs, {hint}one server per {size}",
        )
    return [list(gpus[i : i + size]) for i in range(0, len(gpus), size)]


def _servers(
    winner: Winner,
    cli: list[str],
    *,
    gpus: Sequence[int] | None,
    layout: Fleet | None,
    base_port: int | None,
    host: str,
) -> list[FleetServer]:
    """One server per group of the GPUs given (as many GPUs each as the winner spans), or the servers of an
    existing fleet file (hosts, GPUs, ports kept; each group must be the winner's size)."""
    # SGLang's CPU backend (real or simulated): the index names the server and its files, and no GPU
    no_gpu = winner.device == "cpu"
    size = 1 if no_gpu else server_gpus(winner.config)
    if gpus:
        prefix = "cpu" if winner.device == "cpu" else "gpu"
        servers, groups = [], split_groups(gpus, size, winner.config)
        for group, port in zip(groups, pick_ports(len(groups), host, base_port), strict=True):
            name = server_name(prefix, group)
            servers.append(
                FleetServer(
                    name=name,
                    gpus=[] if no_gpu else group,
                    port=port,
                    bind=host,
                    config="sglang.yaml",
                    log=f"logs/{name}.log",
                    pid=f"run/{name}.pid",
                    extra_args=list(cli),
                    sim_options=winner.settings.sim_options,
                )
            )
        return servers
    if layout is not None:
        for s in layout.servers:
            if not layout.host_memory and len(s.gpus) != size:
                raise ConfigError(
                    f"server {s.name} has {len(s.gpus)} GPU(s) ({s.gpu_line}), but the winner spans "
                    f"{size} ({spans(winner.config)})",
                    key="--fleet",
                    fix=f"lay the fleet out again with --gpus (one server per group of {size} GPUs)",
                )
        return [
            s.model_copy(
                update={
                    "config": "sglang.yaml",
                    "extra_args": list(cli),
                    "sim_options": {**winner.settings.sim_options, **s.sim_options},
                }
            )
            for s in layout.servers
        ]
    raise ConfigError(
        "no GPUs given: the fleet's servers come from the command line or a fleet file",
        key="--gpus",
        fix="pass --gpus 0-7 (one server per group of as many GPUs as the winner spans; "
        "on a CPU study, one per index), or --fleet fleet.toml to reuse its servers",
    )


def _keyed(fleet: Fleet, insecure: bool) -> Fleet:
    """The fleet with keys when it binds beyond loopback (``deploy.fleetkeys``); a ConfigError in one line where
    it cannot have them (servers on other hosts or under another launcher) unless ``insecure``."""
    exposed = fleetkeys.exposed(fleet)
    if not exposed or insecure:
        return fleet
    if fleet.launcher != "local" or any(not s.local for s in fleet.servers):
        raise ConfigError(
            f"the fleet would serve beyond loopback ({'; '.join(exposed)}) without keys: autotune "
            "places keys only on servers it starts on this host with the local launcher",
            key="--host",
            fix="bind 127.0.0.1, or pass --insecure to write the fleet without keys",
        )
    return fleet.model_copy(update={"keys": True})


def write_artifacts(
    winner: Winner,
    out_dir: Path,
    *,
    gpus: Sequence[int] | None = None,
    layout: Fleet | None = None,
    base_port: int | None = None,
    host: str = "127.0.0.1",
    python: str | None = None,
    model: str | None = None,
    insecure: bool = False,
) -> list[Path]:
    """Write the four artifacts into ``out_dir`` (created) and return their paths.

    The servers are one per group of ``gpus`` (as many GPUs as the winner's config spans: ``--gpus 0-7`` and a TP=2
    winner make four servers on pairs), on free ports (``pick_ports``), else those of ``layout`` (a loaded fleet
    file); there is no default. Engine, interpreter (``python`` overrides the study's), device, environment and
    model are the study's, so the fleet runs what the study measured. A fleet that binds beyond loopback runs with
    keys (``deploy.fleetkeys``), or is refused unless ``insecure``."""
    model = model or winner.model
    if not model:
        raise ConfigError("the study does not record a model path", key="--model", fix="pass --model")
    flags, levers = split_env(winner.config)[0], env_strings(winner.config)  # levers: the servers' env, not sglang.yaml
    document, cli = split_config(yaml_files.deployed_config(flags))
    servers = _servers(winner, cli, gpus=gpus, layout=layout, base_port=base_port, host=host)
    routing = router.for_servers(servers, layout)  # [router]: sglang-router in front of two or more servers
    if layout is None and routing is not None and routing.router and router.installed():
        # behind a router, a new fleet's servers prove themselves with its own CA: no request of the job goes to
        # a process that took a fleet server's port (deploy.fleettls)
        servers = [s.model_copy(update={"tls": True}) if s.local else s for s in servers]
    client = router.advise(client_advice(winner, servers=len(servers)), routing)  # what the job's client sends
    python = python or winner.python or (layout.python if layout is not None else None)
    # the study's launcher; a study that ran locally keeps the launcher of the fleet file it is laid out on
    launcher, settings = winner.launcher, winner.settings.launcher_settings
    if layout is not None and launcher == "local":
        launcher, settings = layout.launcher, layout.launcher_settings
    try:
        fleet = Fleet(
            engine=winner.engine,
            model=model,
            python=python,
            device=winner.device,
            env=env_for_files(winner.env),
            sglang_env=levers,
            sim_gpu=winner.sim_gpu,
            launcher=launcher,
            launcher_settings=settings,
            remote_dir=layout.remote_dir if layout is not None else "autotune-fleet",
            servers=servers,
            router=routing,
        )
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "fleet"
        raise ConfigError(err["msg"].removeprefix("Value error, "), key=where) from None
    fleet = _keyed(fleet, insecure)
    if fleet.keys:
        client = replace(client, api_key_file=f"{KEYS_DIR}/api.key")
    header = yaml_header(winner, client)
    size = server_gpus(winner.config)
    if size > 1 and not fleet.host_memory:
        header += f"\neach server spans {size} GPUs ({spans(winner.config)}): " + "; ".join(
            f"{s.name} on {s.gpu_line}" for s in servers
        )
    # The script exports what the engine exports for every server (references to secrets stay references) and
    # the local launcher's device order where servers have GPUs; CUDA_VISIBLE_DEVICES per server, as it sets it.
    local = LocalLauncher()
    # where the fleet file goes: its CA and each server's certificate and key go to tls/ beside it (user-only keys)
    placed = fleet.model_copy(update={"path": (Path(out_dir) / "fleet.toml").resolve()})
    shared = {
        **engine_for(fleet, servers[0], env=fleet.env).env(),
        **{k: v for k, v in local.device_env(launch_group(fleet, servers[0])).items() if k != VISIBLE},
    }
    starts, elsewhere = [], []
    for s in servers:
        if not s.local:
            elsewhere.append(f"{s.name} on {s.host} ({s.where})")
            continue
        gpu = local.device_env(launch_group(fleet, s)).get(VISIBLE, "")
        ssl = fleettls.ssl_argv(placed, s, relative=True)  # the CA and the server's certificate, made here
        base = engine_for(fleet, s).argv({}, port=s.port, host=s.bind)  # the engine's own command, no flags
        argv = with_config_file(base, s.config) + [*s.extra_args, *device_argv(fleet, base), *ssl]
        argv = fleetkeys.server_argv(placed, argv, relative=True)  # the key read from its file, in the process
        if levers:  # `env NAME=VALUE … argv`: each assignment one quoted word, never a shell string of config
            argv = ["env", *(f"{k}={v}" for k, v in levers.items()), *argv]
        starts.append(ScriptEntry(log=s.log, pid=s.pid, gpus=gpu, argv=argv))
    script = launch_script(
        [
            *starts,
            *filter(
                None,
                [
                    router.script_entry(
                        routing,
                        [s.url for s in servers],
                        ca=TLS_CA if fleet.tls else None,
                        keyed=placed if fleet.keys else None,
                    )
                ],
            ),
        ],
        env=shared,
        elsewhere=elsewhere,
        private=fleet.keys,
        header=header + f"\nengine {fleet.engine}, device {fleet.device}; one server per entry of fleet.toml."
        "\nStop one with: kill -TERM -- -$(cat run/<name>.pid)"
        + (
            f"\nfleet.toml's launcher is {launcher}: `autotune fleet up` starts the servers that way; "
            "this script starts them as local processes."
            if launcher != "local"
            else ""
        ),
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "sglang.yaml": yaml_text(document, header=header),
        "launch_fleet.sh": script,
        "client.json": client.json_text(),
        "provenance.json": json.dumps(
            {**provenance(winner), "model_path": model, "python": python, "client": client.to_dict()},
            indent=2,
            default=str,
        )
        + "\n",
    }
    written = []
    for name, text in paths.items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    (out_dir / "launch_fleet.sh").chmod(0o755)
    written.append(write_fleet(fleet, out_dir / "fleet.toml"))
    return written
