"""When the next launch will not pay: the search stops before its budget once it has stopped improving.

A launch on a real GPU costs minutes; a study whose last ``patience`` launches found nothing beating the best so far
by more than the noise (``[study] resolution``: a smaller gain is a tie the confirmation would not resolve) is
unlikely to find it in the next one. The rule waits for the configs the study was given (baseline, enqueued) and the
planner's edge starts, so it never stops before the search proper began. The budget (``[study] trials``) stays the
upper bound; which rule ended the search is stored on the study (``STOP_ATTR``) and shown in the summary.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        return (f"{since} launches in a row found no gain beyond {round(100 * self.threshold, 2):g} % over the best "
                f"so far (patience {self.launches})")


def stop_record(why: str | None, launches: int, budget: int) -> dict[str, Any]:
    """What the study stores about how its search ended: the rule that stopped it, or the budget spent."""
    if why is None:
        return {"rule": "budget", "why": f"the budget of {budget} launches was spent", "launches": launches,
                "budget": budget}
    return {"rule": "patience", "why": why, "launches": launches, "budget": budget}


def stop_line(record: dict[str, Any] | None) -> str | None:
    """The summary's line on how the search ended; None for a study that never recorded it (an older one)."""
    if not record:
        return None
    if record.get("rule") == "budget":
        return f"search: ran its whole budget of {record.get('budget')} launches"
    return f"search: stopped after {record.get('launches')} of {record.get('budget')} launches: {record.get('why')}"


def stopped_early(study: optuna.Study, rule: Patience, budget: int, progress: Any) -> bool:
    """Whether the search stops now because the next launch will not pay; how the search ended (this rule, or the
    budget spent) is stored on the study, and an early stop said once through ``progress``."""
    trials = study.get_trials(deepcopy=False)
    why = rule.why(trials)
    done = len(launched(trials))
    if why is None and done < budget:
        return False
    record = stop_record(why, done, budget)
    if study.user_attrs.get(STOP_ATTR) != record:
        study.set_user_attr(STOP_ATTR, record)
        if why is not None:
            progress.log(stop_line(record) or why)
    return why is not None
