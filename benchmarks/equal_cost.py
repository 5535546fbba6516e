"""Every strategy at equal GPU-hours: the rivals' budgets extended by what ours spent after its search.

Ours pays for a confirmation (relaunches of its contenders) and a stress phase before it names a config; the
rivals name their best *measured* launch and pay nothing after the search. At equal launches that favours them by
ours' confirmation and stress GPU-hours. Here each rival runs again, per seed, with its budget extended by that
many GPU-hours, as extra launches at the rival's own mean launch cost in its equal-launch run (an OOM is cheap, so
a rival that OOMs often gets more launches), and still names its best measured launch: what ours would have to
name without a confirmation.
"""

from __future__ import annotations

import math
from typing import Any

# The rows the search is compared against (the ablations take a part of ours away and are not rivals).
RIVALS = ("tpe-no-planner", "random", "tiered-grid", "vllm-2knob-grid")


def after_search_s(ours: Any) -> float:
    """GPU-seconds ours spent after its search: the confirmation's launches and every stress phase."""
    return float(getattr(ours, "confirm_cost_s", 0.0)) + float(getattr(ours, "stress_cost_s", 0.0))


def extra_launches(ours: Any, rival: list[Any]) -> int:
    """Launches worth ``after_search_s(ours)`` at the rival's mean launch cost (0 when ours spent nothing)."""
    launched = [x.cost_s for x in rival if x.launched]
    if not launched or not after_search_s(ours):
        return 0
    return math.ceil(after_search_s(ours) / (sum(launched) / len(launched)))


def equal_cost_runs(
    case: Any,
    oracle: Any,
    strategies: dict[str, Any],
    runs: dict[tuple[str, int], list[Any]],
    budgets: list[int],
    seeds: int,
    wrap,
) -> dict[tuple[str, int], list[Any]]:
    """Each rival in ``strategies`` rerun per budget and seed with its budget extended (``extra_launches``);
    ``wrap``: the per-GPU view every run of the table gets. Ours' own runs are its equal-GPU-hours runs."""
    out: dict[tuple[str, int], list[Any]] = {}
    for name in (n for n in RIVALS if n in strategies):
        for budget in budgets:
            out[name, budget] = [
                wrap(
                    strategies[name](
                        case,
                        oracle,
                        budget + extra_launches(runs["ours", budget][seed], runs[name, budget][seed]),
                        seed,
                    )
                )
                for seed in range(seeds)
            ]
    return out
