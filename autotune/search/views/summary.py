"""The sweep's summary: what a user reads once a study has run (statuses, baseline, winner, gains, ranked by tok/s
per GPU). A winner is only ever named against a measured baseline; without one the summary says why
(``outcome`` ``"no_baseline"``). docs/contracts.md (``search/views/summary.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import StudyConfig
from autotune.redaction import redact_url
from autotune.results import TrialResult, numerics_line
from autotune.search.confirm.decision import ContenderStat, Verdict
from autotune.search.confirm.ranking import ranked
from autotune.search.confirm.record import Confirmation, DefaultsRun
from autotune.search.confirm.twins import study_held_tokens, twins_of
from autotune.search.numerics import contender_fidelity
from autotune.search.objective import gpus_spanned
from autotune.search.seeding import finished, launch_key, launches, unsettled
from autotune.search.stopping import SearchStop
from autotune.search.views.above import AboveEntry, above_baseline, above_line
from autotune.search.views.jobtypes import JobView
from autotune.search.views.origin import origin_line
from autotune.search.views.spend import Spend, study_spend
from autotune.search.views.worstcase import worst_case_line
from autotune.search.warm import record_of


def baseline_trial(trials: list[FrozenTrial]) -> FrozenTrial | None:
    """The study's finished baseline: the first that measured ok, else the first that finished at all."""
    done = [t for t in finished(trials) if t.user_attrs.get("role") == "baseline"]
    return next((t for t in done if measured(t)), done[0] if done else None)


def measured(trial: FrozenTrial | None) -> bool:
    """Whether a trial measured a throughput (COMPLETE, status ok, a positive value)."""
    return (
        trial is not None
        and trial.state == TrialState.COMPLETE
        and trial.user_attrs.get("status") == "ok"
        and bool(trial.values)
        and trial.values[0] > 0
    )


def baseline_failure(study: optuna.Study) -> str | None:
    """Why the study has no measured baseline to compare with (``"(trial 0) failed: startup_oom: …"``); None
    when it has one. A baseline that measured in the search but failed every confirmation run has none either."""
    trials = study.get_trials(deepcopy=False)
    base = baseline_trial(trials)
    if base is None:
        return "did not run (no baseline trial finished)"
    if not measured(base):
        status = base.user_attrs.get("status") or base.state.name.lower()
        reason = base.user_attrs.get("reason") or ("no tok/s measured" if status == "ok" else "no reason recorded")
        return f"(trial {base.number}) failed: {status}: {reason}"
    verdict = confirmed(Confirmation.of(study))
    stats = verdict.stat(base.number) if verdict is not None else None
    if stats and stats.runs and not stats.median:
        return f"(trial {base.number}) failed in every confirmation run ({stats.runs})"
    return None


def confirmed(confirmation: Confirmation | None) -> Verdict | None:
    """The verdict of a finished confirmation; None while it runs, or with no confirmation."""
    return confirmation.confirmed if confirmation is not None else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DefaultsEntry:
    """SGLang's defaults for the tuned flags as the confirmation measured them (``confirm.defaults``); one that
    did not run cleanly has no tok/s."""

    status: str
    output_tok_s: float | None = None
    tok_s_per_gpu: float | None = None
    reason: str | None = None
    how: str = ""  # predicted on the simulator, or measured once
    config: Mapping[str, Any] | None = None
    trial_dir: str | None = None
    log_path: str | None = None


def _defaults_entry(stored: DefaultsRun | None) -> DefaultsEntry | None:
    """The stored defaults measurement; one that did not run cleanly has no tok/s (older studies stored 0.0)."""
    if stored is None:
        return None
    status = stored.status or ("ok" if stored.output_tok_s else "failed")
    if status == "ok" and not stored.output_tok_s:
        status = "no_measurement"
    return DefaultsEntry(
        status=status,
        output_tok_s=stored.output_tok_s if status == "ok" else None,
        tok_s_per_gpu=stored.tok_s_per_gpu,
        reason=stored.reason,
        how=stored.how or "",
        config=stored.config,
        trial_dir=stored.trial_dir,
        log_path=stored.log_path,
    )


def _spans(trial: FrozenTrial) -> int:
    """How many GPUs a launched trial's server spanned (1 without a stored result)."""
    result = TrialResult.of(trial)
    return gpus_spanned(result) if result is not None else 1


def _defaults_per_gpu(defaults: DefaultsEntry) -> float:
    """The defaults' tok/s per GPU (stored since groups; older studies' ran on one GPU)."""
    return float(defaults.tok_s_per_gpu or defaults.output_tok_s or 0.0)


def confirmed_rate(
    confirmation: Confirmation | None, number: int, span: int
) -> tuple[float, tuple[float, float] | None] | None:
    """A confirmed trial's median server tok/s and the interval of that median; None when the confirmation did not
    finish or did not measure it. The stored statistics are of tok/s per GPU, the score: × ``span`` GPUs."""
    verdict = confirmed(confirmation)
    stats = verdict.stat(number) if verdict is not None else None
    if not stats or stats.median is None:
        return None
    ci = stats.ci
    interval = (ci[0] * span, ci[1] * span) if ci is not None and ci[0] is not None and ci[1] is not None else None
    return float(stats.median) * span, interval


def confirmation_line(confirmation: Confirmation | None) -> str | None:
    """What the confirmation ran and the noise it measured: ``7 launches, 21 windows; window CV 1.2 %, launch CV
    0.4 %`` (None for a confirmation stored before the noise model)."""
    verdict = (confirmation.verdict if confirmation is not None else None) or Verdict(outcome="none")
    noise = verdict.noise
    if not noise.get("line") or confirmation is None:
        return None
    stats = verdict.stats.values()
    launches = len(confirmation.runs)
    windows = sum(s.windows for s in stats if not s.from_search)  # a given search run
    return f"{launches} launches, {windows} windows; {noise['line']}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialEntry:
    """A trial as the summary shows it: the confirmed median and interval where confirmed, else its search value;
    ``output_tok_s`` the server's, ``tok_s_per_gpu`` the score."""

    trial: int
    label: str | None = None
    params: Mapping[str, Any] | None = None
    output_tok_s: float | None = None
    tok_s_per_gpu: float | None = None
    gpus: int | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    confirmed_runs: int = 0
    from_search: bool = False  # its search run stood in for a confirmation launch (far behind the leader)
    numerics: str | None = None  # its outputs against the baseline's (``results.numerics_line``), when they differ
    worst_case: str | None = None  # the stress phase's line, once the confirmation finished


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineEntry:
    """The baseline as the summary shows it: its figures when it measured, its status and why when it failed."""

    trial: int | None
    params: Mapping[str, Any] | None = None
    output_tok_s: float | None = None
    tok_s_per_gpu: float | None = None
    gpus: int | None = None
    status: str | None = None
    from_search: bool = False  # far behind: its search run stood in
    reason: str | None = None
    failed: str | None = None  # why there is no measured baseline (``baseline_failure``)
    log_path: str | None = None


@dataclasses.dataclass(frozen=True)
class UnexpectedEntry:
    """A confirmed contender other than the winner whose outputs changed though no output-changing flag did."""

    trial: int
    line: str | None


def _entry(
    by_number: dict[int, FrozenTrial],
    stats: Mapping[str, ContenderStat],
    n: int | None,
    conf: Confirmation | None = None,
) -> TrialEntry | None:
    """A trial as the summary shows it: the confirmed median and interval where confirmed, else its search value."""
    if n is None or n not in by_number:
        return None
    t = by_number[n]
    s = stats.get(str(n))
    value = s.median if s else (t.values[0] if t.values else None)  # the score: tok/s per GPU
    data = TrialResult.of(t)
    gpus = _spans(t)

    def scale(v: float | None) -> float | None:  # the server's tok/s from its per-GPU score
        return None if v is None else v * gpus

    return TrialEntry(
        trial=n,
        label=t.user_attrs.get("label"),
        params=data.config if data is not None else None,
        output_tok_s=scale(value),
        tok_s_per_gpu=value,
        gpus=gpus,
        ci_low=scale(s.ci[0]) if s and s.ci else None,
        ci_high=scale(s.ci[1]) if s and s.ci else None,
        confirmed_runs=s.runs if s and not s.from_search else 0,
        from_search=bool(s and s.from_search),
        numerics=numerics_line(
            contender_fidelity(data.fidelity if data is not None else None, conf.probe(n) if conf is not None else None)
        ),
        worst_case=worst_case_line(conf, n) if conf is not None and conf.complete else None,
    )  # the stress phase


def _best(
    trials: list[FrozenTrial], base: FrozenTrial | None, verdict: Verdict | None
) -> tuple[int | None, str | None, str | None]:
    """(the best trial's number, the outcome, the note): the confirmed winner, else the best search value."""
    if verdict is not None:
        return verdict.winner_trial, verdict.outcome, verdict.note
    note = "not confirmed: these are single search measurements"
    ok = [t for t in finished(trials) if t.user_attrs.get("status") == "ok" and t.values and not unsettled(t)]
    best_n = max(ok, key=lambda t: t.values[0]).number if ok else None
    if (
        best_n is not None
        and base is not None
        and launch_key(next(t for t in ok if t.number == best_n)) == launch_key(base)
    ):
        return (
            None,
            "baseline",
            (f"no config beat the baseline: the best search trial ({best_n}) runs the baseline's flags; {note}"),
        )
    return best_n, None, note


def verdict_note(study: optuna.Study) -> str:
    """The one account of the study's verdict every view prints (the sweep's summary, ``report``, ``trials``,
    ``apply`` and ``provenance.json``): with no winner, the configs that measured above the baseline and why none
    was crowned (``views.above``), else the verdict's own note (or why the figures are unconfirmed)."""
    trials = study.get_trials(deepcopy=False)
    return _verdict(trials, baseline_trial(trials), confirmed(Confirmation.of(study)))[2] or ""


def _verdict(
    trials: list[FrozenTrial], base_t: FrozenTrial | None, verdict: Verdict | None
) -> tuple[int | None, str | None, str | None, list[AboveEntry]]:
    """(the best trial, the outcome, the note, the uncrowned configs above the baseline): ``_best`` with the note
    naming those configs when there are any."""
    best_n, outcome, note = _best(trials, base_t, verdict)
    above = above_baseline(trials, verdict, base_t) if best_n is None and outcome == "baseline" else []
    return best_n, outcome, above_line(above) if above else note, above


def _unexpected(conf: Confirmation | None, best: TrialEntry | None) -> list[UnexpectedEntry]:
    """The confirmed contenders other than the winner whose outputs changed though no output-changing flag did, each
    with its one line (``results.numerics_line``)."""
    if conf is None:
        return []
    return [UnexpectedEntry(n, numerics_line(conf.probe(n))) for n in conf.unexpected() if not best or n != best.trial]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepSummary:
    """What a user reads once a study has run, built once (``summarize``); ``autotune sweep --json`` prints its
    ``asdict`` (the fields in this order are the JSON's keys). ``baseline``, ``best``, ``enqueued`` entries and
    ``defaults`` are the trials as the summary shows them; ``above_baseline``: the uncrowned configs that measured
    above the baseline (``views.above``; the note then says so); ``job``: the ``[job]`` view (None without one)."""

    study: str
    storage: str
    n_trials: int
    statuses: dict[str, int]
    launched: int
    launched_oom: int
    launched_interrupted: int
    confirmed: bool
    baseline: BaselineEntry
    best: TrialEntry | None
    outcome: str  # "winner" | "baseline" | "no_baseline" | "none"
    gain_over_baseline: float | None
    gain_ci: list[float | None] | None
    enqueued: list[TrialEntry]
    defaults: DefaultsEntry | None
    gain_over_defaults: float | None
    multi_gpu: bool
    unexpected: list[UnexpectedEntry]
    confirmation: str | None
    search_stop: SearchStop | None  # how the search ended: the budget spent or ``[study] patience`` (``stopping``)
    note: str | None
    error: str | None
    above_baseline: list[AboveEntry]
    job: JobView | None = None
    interrupted: bool = False
    origin: str | None = None  # where a re-tune started (``--from``: ``views.origin``); None for a cold study
    spend: Spend | None = None  # launches and GPU-hours by phase (``views.spend``)
    twins: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # contender: the launches it stood for
    defaults_lead: str | None = None  # SGLang's defaults measured above every searched config: the line and the fix


def _baseline_entry(trial: FrozenTrial | None, base: TrialEntry | None, failure: str | None) -> BaselineEntry:
    """The baseline as the summary shows it: its figures when it measured, its status and why when it failed."""
    attrs = trial.user_attrs if trial is not None else {}
    result = TrialResult.of(trial)
    return BaselineEntry(
        trial=trial.number if trial is not None else None,
        params=result.config if result is not None else None,
        output_tok_s=base.output_tok_s if base else None,
        tok_s_per_gpu=base.tok_s_per_gpu if base else None,
        gpus=base.gpus if base else None,
        status=attrs.get("status"),
        from_search=bool(base and base.from_search),
        reason=attrs.get("reason") if failure else None,
        failed=failure,
        log_path=attrs.get("log_path"),
    )


def summarize(
    study: optuna.Study,
    cfg: StudyConfig,
    *,
    interrupted: bool = False,
    job: Callable[[int | None], JobView | None] | None = None,
) -> SweepSummary:
    """The figures a user reads: statuses, baseline, confirmed winner and gains (search values if unconfirmed);
    ``job``: the ``[job]`` view of the winner's trial (``jobview.job_for_study``), ``interrupted``: the sweep was.

    ``outcome`` is ``"winner"``, ``"baseline"`` (no config beat the baseline: the confirmation found none, or,
    unconfirmed, the best search trial runs the baseline's flags; ``best`` is None, the reason in ``note``),
    ``"no_baseline"`` (the baseline did not measure: no winner, ``error`` says why) or ``"none"`` (nothing
    measured cleanly). ``launched`` counts servers started in every session of the study, interrupted ones
    included."""
    trials = study.get_trials(deepcopy=False)
    done = finished(trials)
    statuses = dict(collections.Counter(t.user_attrs.get("status", t.state.name.lower()) for t in done))
    by_number, conf = {t.number: t for t in trials}, Confirmation.of(study)
    verdict = confirmed(conf)
    entry = functools.partial(_entry, by_number, dict(verdict.stats) if verdict is not None else {}, conf=conf)
    base_t = baseline_trial(trials)
    baseline = base_t.number if base_t is not None else None
    best_n, outcome, note, above = _verdict(trials, base_t, verdict)
    failure = baseline_failure(study)
    if failure is not None:
        best_n, outcome, note = None, "no_baseline", None  # the baseline line and ``error`` say why
    base, best = (entry(baseline) if failure is None else None), entry(best_n)
    gain = (
        verdict.gain
        if verdict is not None
        # per GPU: a TP-2 winner must beat twice a TP-1 baseline's tok/s
        else (
            best.tok_s_per_gpu / base.tok_s_per_gpu
            if best and base and best.tok_s_per_gpu and base.tok_s_per_gpu
            else None
        )
    )
    enqueued = [
        entry(t.number)
        for t in trials
        if t.user_attrs.get("role") == "enqueued"
        and t.state.name == "COMPLETE"
        and t.user_attrs.get("requeued_from") is None
    ]
    defaults = _defaults_entry(conf.defaults) if conf is not None and verdict is not None else None
    started = launches(trials)
    launched_oom = sum(1 for t in started if t.user_attrs.get("status") in ("startup_oom", "runtime_oom"))
    reran = sum(1 for t in started if t.state.name == "FAIL" and t.user_attrs.get("status") in (None, "interrupted"))
    attrs = base_t.user_attrs if base_t is not None else {}
    outcome = "winner" if best is not None else (outcome if outcome in ("baseline", "no_baseline") else "none")
    above = above if outcome == "baseline" else []  # measured above, uncrowned (the note names them)
    return SweepSummary(
        study=study.study_name,
        storage=redact_url(cfg.storage_url),
        n_trials=len(done),
        statuses=statuses,
        launched=len(started),
        launched_oom=launched_oom,
        launched_interrupted=reran,
        confirmed=verdict is not None,
        baseline=_baseline_entry(base_t, base, failure),
        best=best,
        outcome=outcome,
        gain_over_baseline=gain if best is not None else None,
        gain_ci=[verdict.ci_low, verdict.ci_high] if verdict is not None and best is not None else None,
        enqueued=[e for e in enqueued if e],
        defaults=defaults,
        gain_over_defaults=(
            best.tok_s_per_gpu / _defaults_per_gpu(defaults)
            if best and best.tok_s_per_gpu is not None and defaults and defaults.output_tok_s
            else None
        ),
        multi_gpu=any(_spans(t) > 1 for t in started),
        unexpected=_unexpected(conf, best),
        confirmation=confirmation_line(conf) if verdict is not None else None,
        search_stop=SearchStop.of(study.user_attrs),
        note=note,  # the rule that ended the search; the verdict
        error=None
        if failure is None
        else (
            f"the baseline {failure}; no winner without a measured baseline to compare with"
            + (f" (its log: {attrs['log_path']})" if attrs.get("log_path") else "")
        ),
        above_baseline=above,
        job=job(best.trial if best else None) if job is not None else None,
        interrupted=interrupted,
        origin=origin_line(record_of(study)),
        spend=study_spend(trials, conf, simulated=cfg.engine.simulated, cpu=cfg.engine.device == "cpu"),
        twins=_twins(cfg, study, trials, conf),
        defaults_lead=_defaults_lead(defaults, _measured(trials, entry)),
    )


def _measured(trials: list[FrozenTrial], entry: Callable[[int], TrialEntry | None]) -> list[TrialEntry]:
    """Every trial that measured, as the summary shows it."""
    return [
        e
        for t in trials
        if t.state.name == "COMPLETE" and t.user_attrs.get("status") == "ok" and (e := entry(t.number))
    ]


def defaults_lead(study: optuna.Study) -> str | None:
    """``SweepSummary.defaults_lead`` of a stored study (the report's header says what the summary said)."""
    trials = study.get_trials(deepcopy=False)
    conf = Confirmation.of(study)
    verdict = confirmed(conf)
    if conf is None or verdict is None:
        return None
    entry = functools.partial(_entry, {t.number: t for t in trials}, dict(verdict.stats), conf=conf)
    return _defaults_lead(_defaults_entry(conf.defaults), _measured(trials, entry))


def _defaults_lead(defaults: DefaultsEntry | None, measured: list[TrialEntry]) -> str | None:
    """One line when SGLang's defaults (the fixed flags kept) measured above every config the study measured: the
    space never reached what they run. None otherwise."""
    if defaults is None or not defaults.output_tok_s or not measured:
        return None
    top = max(measured, key=lambda e: e.tok_s_per_gpu or 0.0)
    if _defaults_per_gpu(defaults) <= (top.tok_s_per_gpu or 0.0):
        return None
    return (
        f"SGLang's defaults ({defaults.output_tok_s:,.0f} tok/s, {defaults.how}) came out above every searched "
        f"config (the best: trial {top.trial}, {top.output_tok_s or 0:,.0f} tok/s): the space never reached what "
        "SGLang picks by itself for the tuned flags. Widen [space] to reach it, or measure the defaults as a "
        'config the study can crown and apply: [[enqueue]] label = "defaults" with flags = {} (then autotune '
        "apply --trial N)"
    )


def _twins(
    cfg: StudyConfig, study: optuna.Study, trials: list[FrozenTrial], conf: Confirmation | None
) -> dict[int, tuple[int, ...]]:
    """The confirmation's contenders that stood for their twins (``confirm.twins``) among the trials it could have
    taken (``ranking.ranked``), with the bound it used; none before a confirmation ran (the prompt sample is read
    only then, as the confirmation read it)."""
    if conf is None or not conf.order:
        return {}
    return twins_of(ranked(study), conf.order, study_held_tokens(cfg, trials))
