"""Confirmation: re-measure the top configs and the baseline, interleaved, and pick the winner honestly.

One search measurement per config is noisy and the search keeps the lucky ones, so the winner is decided
here: the top-k distinct configs, the baseline and the hand-written configs are run ``repeats`` times each in
the order A B C base A B C base … (drift hits everyone alike); the winner has the best median; the gain over
the baseline carries a seeded bootstrap confidence interval; contenders whose intervals overlap are a tie,
which goes to the fastest median unless its memory headroom is under ``TIE_HEADROOM_FLOOR_GIB``; then to the
roomiest. A best config that runs the baseline's own flags, or whose
interval overlaps the baseline's, did not beat it: then there is no winner (``winner_trial`` None, ``outcome``
``"baseline"``) and nothing to apply.
"""

from autotune.search.confirm.decision import TIE_HEADROOM_FLOOR_GIB, decide
from autotune.search.confirm.defaults import CHOSEN_TOGETHER, _defaults, defaults_config
from autotune.search.confirm.ranking import contenders
from autotune.search.confirm.stages import confirm, repeat_stages
from autotune.search.confirm.statistics import BOOTSTRAP
from autotune.search.confirm.sweep import run_sweep
from autotune.search.summary import summarize

__all__ = ["BOOTSTRAP", "CHOSEN_TOGETHER", "TIE_HEADROOM_FLOOR_GIB", "_defaults", "confirm", "contenders", "decide",
           "defaults_config", "repeat_stages", "run_sweep", "summarize"]
