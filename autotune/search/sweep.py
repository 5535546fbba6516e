"""The sweep's entry point: search, then confirm, then the summary ``autotune sweep`` prints."""

from __future__ import annotations

import threading
from typing import Any

from autotune.config import StudyConfig
from autotune.progress import PlainProgress
from autotune.search.confirm.defaults import _defaults
from autotune.search.confirm.stages import confirm
from autotune.search.confirm.stress import stress_winner
from autotune.search.runner import Runner
from autotune.search.signals import sigint_stops
from autotune.search.storage.diskguard import disk_error
from autotune.search.study import Sweep
from autotune.search.views.jobview import job_for_study
from autotune.search.views.summary import SweepSummary, baseline_failure, summarize


def run_sweep(cfg: StudyConfig, *, runner: Runner | None = None, progress: Any = None) -> SweepSummary:
    """Search, then confirm; returns the summary (``autotune sweep --json``).

    Ctrl-C is the same in every stage: one handler for the whole sweep (``sigint_stops``), installed even where
    SIGINT was ignored at start-up (a sweep started with ``&`` from a script), so the first SIGINT stops the
    current server and ends the sweep as interrupted, in the search and in the confirmation alike. No
    confirmation runs without a measured baseline: there would be nothing to confirm a gain over."""
    progress = progress or PlainProgress()
    stop = threading.Event()
    sweep = None
    with sigint_stops(stop):
        try:
            sweep = Sweep(cfg, runner=runner, progress=progress, stop_event=stop)
            study = sweep.run()
            failure = baseline_failure(study)
            if not stop.is_set() and cfg.study.confirm_top_k > 0 and failure is not None:
                progress.log(f"confirm: skipped, the baseline {failure}")
            elif not stop.is_set() and cfg.study.confirm_top_k > 0:
                checked = sweep.runner  # each launch reads the device first, as in the search
                try:
                    confirmation = confirm(
                        study,
                        cfg,
                        runner=checked,
                        progress=progress,
                        stop_event=stop,
                        defaults=_defaults(cfg, checked, progress),
                    )
                    # the worst case before the crown: the winner (and a tied runner-up) stressed, a failure demoted
                    stress_winner(study, cfg, confirmation, runner=checked, progress=progress, stop_event=stop)
                except BaseException as exc:  # a full disk here is one line, as in the search
                    err = disk_error(exc, db_path=sweep.db_path, fallback=cfg.work_dir)
                    if err is None:
                        raise
                    raise err from None
        finally:
            if sweep is not None:
                sweep.close()
            progress.close()
    return summarize(
        study, cfg, interrupted=stop.is_set(), job=lambda winner: job_for_study(study, winner)
    )  # None without [job]
