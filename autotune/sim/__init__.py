"""The simulated SGLang engine: a real HTTP server (``python -m autotune.sim``) and ``evaluate``, the same
scheduler on a virtual clock. ``evaluate`` is imported on first use so the server's start-up stays light."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SimEvaluation", "SimWorkload", "evaluate"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'autotune.sim' has no attribute {name!r}")
    module = importlib.import_module("autotune.sim.evaluate")
    # Importing the submodule binds the package attribute ``evaluate`` to the module; the function wins.
    globals().update({key: getattr(module, key) for key in __all__})
    return globals()[name]
