"""Confirmation: re-measure the top configs and the baseline, interleaved, and pick the winner honestly.

One search measurement per config is noisy and the search keeps the lucky ones, so the winner is decided here.
The top-k distinct configs, the baseline and the hand-written configs are each launched once and measured over
``confirm_windows`` windows in that launch (``harness.windows``: more windows cost seconds, a relaunch minutes);
the top two are relaunched so the launch term can be estimated; a two-level noise model (window, launch) from
these runs gives every contender an estimate and every gain a 95 % interval (``noise``); a gain is resolved, tied
within ``[study] resolution`` (a result), or open, and only the open contenders are relaunched (``stages``). A tie
goes to the fastest estimate unless its memory headroom is under ``TIE_HEADROOM_FLOOR_GIB``; then to the roomiest.
A best config that runs the baseline's own flags, or is not resolved from the baseline, did not beat it: then
there is no winner (``winner_trial`` None, ``outcome`` ``"baseline"``) and nothing to apply.

Modules: ``ranking`` (who is confirmed), ``samples`` (stored runs as launches of windows), ``noise`` (the model),
``decision`` (``decide``), ``stages`` (``confirm``), ``allocation`` (windows per contention launch),
``defaults`` (SGLang's defaults), ``stress`` (the winner's worst case), ``record`` (the stored confirmation as
one typed record, ``Confirmation``: what the stages write and every view reads). ``search.sweep`` runs it after
the search.
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
