"""When the next launch will not pay: the search stops before its budget once it has stopped improving.

A launch on a real GPU costs minutes; a study whose last ``patience`` launches found nothing beating the best so far
by more than the noise (``[study] resolution``: a smaller gain is a tie the confirmation would not resolve) is
unlikely to find it in the next one. The rule waits for the configs the study was given (baseline, enqueued) and the
planner's edge starts, so it never stops before the search proper began. The budget (``[study] trials``) stays the
upper bound; which rule ended the search is stored on the study (``STOP_ATTR``) and shown in the summary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from optuna.trial import FrozenTrial, TrialState

from autotune.search.seeding import launched, unsettled

if TYPE_CHECKING:
    import optuna

STOP_ATTR = "search_stop"  # the study's user attribute: {"rule", "why", "launches", "budget"}


def _value(trial: FrozenTrial) -> float:
    """The trial's measured score (tok/s per GPU), 0 for a failure or a figure that may not be crowned."""
    if trial.state != TrialState.COMPLETE or trial.user_attrs.get("status") != "ok" or not trial.values:
        return 0.0
    if unsettled(trial):
        return 0.0  # unsettled or pruned (``pruning``): never crowned, so no gain
    return max(0.0, float(trial.values[0]))


@dataclass(frozen=True)
class Patience:
    """Stop after ``launches`` launches in a row with no gain beyond ``threshold`` over the best so far (0: off),
    never before ``after`` launches (the given configs and edge starts)."""

    launches: int
    threshold: float
    after: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> Patience:
        study = cfg.study
        return cls(study.patience, study.resolution, 1 + len(cfg.enqueue) + study.edge_starts)

    def since_gain(self, trials: list[FrozenTrial]) -> tuple[int, int]:
        """(launches finished, launches since the last gain beyond the threshold), in the order they finished."""
        done = sorted(launched(trials), key=lambda t: (t.datetime_complete is None, t.datetime_complete, t.number))
        best, since = 0.0, 0
        for trial in done:
            value = _value(trial)
            since = 0 if value > best * (1 + self.threshold) else since + 1
            best = max(best, value)
        return len(done), since

    def why(self, trials: list[FrozenTrial]) -> str | None:
        """Why the search stops now (one clause), or None while the next launch may still pay."""
        if self.launches <= 0:
            return None
        done, since = self.since_gain(trials)
        if done < self.after or since < self.launches:
            return None
        return (
            f"{since} launches in a row found no gain beyond {round(100 * self.threshold, 2):g} % over the best "
            f"so far (patience {self.launches})"
        )


@dataclass(frozen=True)
class SearchStop:
    """How the search ended: ``rule`` ``"budget"`` (every launch of ``budget`` spent) or ``"patience"`` (``why``),
    after ``launches`` launches. Stored as plain data under ``STOP_ATTR`` (``to_dict``/``of``)."""

    rule: str
    why: str
    launches: int
    budget: int

    @classmethod
    def ended(cls, why: str | None, launches: int, budget: int) -> SearchStop:
        """The rule that stopped the search (``why``), or the budget spent when none did."""
        if why is None:
            return cls("budget", f"the budget of {budget} launches was spent", launches, budget)
        return cls("patience", why, launches, budget)

    @classmethod
    def of(cls, study_attrs: Mapping[str, Any]) -> SearchStop | None:
        """The stored record, None for a study that never stored one (an older one)."""
        stored = study_attrs.get(STOP_ATTR)
        if not stored:
            return None
        return cls(
            str(stored.get("rule")),
            str(stored.get("why") or ""),
            int(stored.get("launches") or 0),
            int(stored.get("budget") or 0),
        )

    @property
    def line(self) -> str:
        """The summary's line on how the search ended."""
        if self.rule == "budget":
            return f"search: ran its whole budget of {self.budget} launches"
        return f"search: stopped after {self.launches} of {self.budget} launches: {self.why}"


def stopped_early(study: optuna.Study, rule: Patience, budget: int, progress: Any) -> bool:
    """Whether the search stops now because the next launch will not pay; how the search ended (this rule, or the
    budget spent) is stored on the study, and an early stop said once through ``progress``."""
    trials = study.get_trials(deepcopy=False)
    why = rule.why(trials)
    done = len(launched(trials))
    if why is None and done < budget:
        return False
    record = SearchStop.ended(why, done, budget)
    if SearchStop.of(study.user_attrs) != record:
        study.set_user_attr(STOP_ATTR, asdict(record))
        if why is not None:
            progress.log(record.line)
    return why is not None
