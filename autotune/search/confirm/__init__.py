"""Confirmation: re-measure the top configs and the baseline, interleaved, and pick the winner honestly under a
two-level noise model; no winner when the best did not beat the baseline. One job per module (``ranking``,
``samples``, ``noise``, ``decision``, ``stages``, ``allocation``, ``defaults``, ``stress``, ``record``):
docs/contracts.md (``search/confirm/``), docs/search.md ("The confirmation").
"""

from autotune.search.confirm.decision import RESOLUTION, TIE_HEADROOM_FLOOR_GIB, decide
from autotune.search.confirm.defaults import CHOSEN_TOGETHER, _defaults, defaults_config
from autotune.search.confirm.noise import NoiseModel, estimate_noise
from autotune.search.confirm.ranking import contenders
from autotune.search.confirm.stages import confirm, next_launches

__all__ = [
    "CHOSEN_TOGETHER",
    "RESOLUTION",
    "TIE_HEADROOM_FLOOR_GIB",
    "NoiseModel",
    "_defaults",
    "confirm",
    "contenders",
    "decide",
    "defaults_config",
    "estimate_noise",
    "next_launches",
]
