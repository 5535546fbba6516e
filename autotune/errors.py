"""One exception tree. Every message says what failed and what to do next.

The CLI prints ``Error: <message>`` on one line and exits 1 for any ``AutotuneError``;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Root of every error the tool raises on purpose."""


class ConfigError(AutotuneError):
    """A study file, flag, profile or CLI value is wrong. Raised before any server starts.

    The parts stay apart (``message``, ``file``, ``key``, ``fix``, ``note``) so a caller can anchor the same error
    at another file or key (``at``) without cutting its text."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        key: str | None = None,
        fix: str | None = None,
        note: str | None = None,
    ):
        self.message, self.file, self.key, self.fix, self.note = message, file, key, fix, note
        where = ": ".join(part for part in (file, key) if part)
        text = f"{where}: {message}" if where else message
        if fix:
            text = f"{text} ({fix})"
        if note:
            text = f"{text} [note: {note}]"
        super().__init__(text)

    def at(self, *, file: str | None, key: str | None) -> ConfigError:
        """The same error (its class, message, fix and note) anchored at ``file`` and ``key`` instead."""
        return type(self)(self.message, file=file, key=key, fix=self.fix, note=self.note)


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


class GpuBusyError(GpuError):
    """A GPU a trial would launch on is held by processes that are not the study's: a launch there would size its
    pools from what the tenant left, and every figure (and every OOM the planner learns from) would be wrong."""

    def __init__(
        self,
        message: str,
        *,
        gpu: int | str | None = None,
        holders: list[str] | None = None,
        held_gib: float | None = None,
    ):
        self.gpu, self.holders, self.held_gib = gpu, list(holders or []), held_gib
        super().__init__(message)


class DiskError(AutotuneError):
    """A file the study must write (records, results, logs, the study database) could not be written: the disk is
    full or read-only. Carries the path and the free space, so the message can say what to free."""

    def __init__(self, message: str, *, path: str | None = None, free_bytes: int | None = None):
        self.path, self.free_bytes = path, free_bytes
        super().__init__(message)


class StudyError(AutotuneError):
    """A study cannot be created, loaded or resumed (unknown study, no completed trial)."""


class StorageError(StudyError):
    """An Optuna storage URL is malformed or unreachable. Messages carry the URL with its password redacted."""


class FleetError(AutotuneError):
    """A fleet file is malformed, or a rollout step failed."""
