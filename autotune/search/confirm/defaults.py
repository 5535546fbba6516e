"""SGLang's defaults for the tuned flags: what the confirmation measures (or predicts) as "the defaults"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.config import StudyConfig
from autotune.search.confirm.record import DefaultsRun, LaunchCost
from autotune.search.objective import per_gpu
from autotune.search.runner import DEFAULTS_RUN, Runner, predict

# Flags SGLang 0.5.23 chooses together: when the first is left to its default, the others must be unset too
# (speculative_hook.py asserts it), so "its default" for the first means SGLang's choice for the whole group.
CHOSEN_TOGETHER = {"speculative_num_steps": ("speculative_eagle_topk", "speculative_num_draft_tokens")}


def defaults_config(cfg: StudyConfig) -> dict[str, Any]:
    """What "SGLang's defaults" means for this study: SGLang's default for every tuned flag (searched or
    derived), with the study's fixed flags kept (the engine settings, model, device and environment, come with
    the runner). Bare defaults may not even start where the fixed flags are what makes the model run. A fixed
    flag SGLang only accepts beside a tuned one it picks together with (``CHOSEN_TOGETHER``) is left to SGLang."""
    tuned = set(cfg.space) | set(cfg.derived)
    config = {k: v for k, v in cfg.engine.fixed.items() if k not in tuned}
    for lead, group in CHOSEN_TOGETHER.items():
        if config.get(lead) is None:
            for name in group:
                config.pop(name, None)
    return config


def _defaults(cfg: StudyConfig, runner: Runner, progress: Any = None) -> Callable[[], DefaultsRun | None]:
    """SGLang 0.5.23's defaults for the tuned flags (``defaults_config``): predicted on the sim, measured once
    otherwise, in its own directory (``trials/defaults/``, the runner's ``DEFAULTS_RUN``). A run that fails is
    stored as failed (status, reason, no tok/s), never as 0 tok/s."""

    def measure() -> DefaultsRun | None:
        config = defaults_config(cfg)
        predicted = predict(cfg, config)  # None where the engine measures only
        if predicted is not None:
            result = predicted
            how = "predicted by the simulator's virtual clock"
        else:
            if progress is not None:
                progress.log("confirm: SGLang's defaults for the tuned flags (fixed flags kept)")
            result = runner(dict(config), DEFAULTS_RUN)
            how = "measured once during confirmation"
        ok = result.ok and result.output_tok_s is not None
        status = "no_measurement" if result.ok and not ok else result.status
        reason = None if ok else (result.reason or "no measurement")
        if progress is not None and predicted is None:
            progress.log(
                f"  defaults: ok {result.output_tok_s:,.0f} tok/s" if ok else f"  defaults: {status}: {reason}"
            )
        return DefaultsRun(
            status=status,
            output_tok_s=result.output_tok_s if ok else None,
            tok_s_per_gpu=per_gpu(result) if ok else None,
            reason=reason,
            how=how,
            config=config,
            trial_dir=result.trial_dir,
            log_path=result.log_path,
            cost=LaunchCost.of(result) if predicted is None else None,
        )

    return measure
