"""One exception tree. Every message says what failed and what to do next.

The CLI prints ``Error: <message>`` on one line and exits 1 for any ``AutotuneError``;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Root of every error the tool raises on purpose."""


class ConfigError(AutotuneError):
    """A study file, flag, profile or CLI value is wrong. Raised before any server starts."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None, fix: str | None = None):
        self.file, self.key, self.fix = file, key, fix
        where = ": ".join(part for part in (file, key) if part)
        text = f"{where}: {message}" if where else message
        if fix:
            text = f"{text} ({fix})"
        super().__init__(text)


class ProfileError(ConfigError):
    """A model or GPU profile cannot be used (unknown name, unsupported architecture, bad config.json)."""


class WorkloadError(ConfigError):
    """The prompt sample cannot be read (missing file, bad JSONL row)."""


class EngineError(AutotuneError):
    """The engine cannot be launched at all (interpreter missing, SGLang not importable)."""


class ServerError(AutotuneError):
    """A server process misbehaved in a way that is not a trial outcome (port busy, teardown timed out)."""


class GpuError(AutotuneError):
    """GPU monitoring is unavailable (no NVML driver on a real run)."""


class StudyError(AutotuneError):
    """A study cannot be created, loaded or resumed (unknown study, no completed trial)."""


class StorageError(StudyError):
    """An Optuna storage URL is malformed or unreachable. Messages carry the URL with its password redacted."""


class FleetError(AutotuneError):
    """A fleet file is malformed, or a rollout step failed."""
