"""Secrets kept out of everything autotune writes or prints: a study's environment, and storage URLs.

A study's ``engine.env`` may carry credentials (``HF_TOKEN``, ``WANDB_API_KEY``). A launcher, a fleet file or
a provenance record never holds such a value: it holds the reference ``${NAME}``, which ``launch_fleet.sh`` and
``autotune fleet up`` fill from the environment of whoever starts the fleet. Messages and reports show the
name, never the value. A storage URL is shown with its password (``user:pw@`` or ``?password=``) as ``***``
(``redact_url``), and driver messages that echo the password get the same (``redact_text``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from autotune.errors import ConfigError

# Words that name a credential in a variable or flag name (whole words: TOKENIZERS_PARALLELISM and
# max_total_tokens are not secrets), and the pairs that do (WANDB_API_KEY, AWS_SECRET_ACCESS_KEY).
_SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "AUTH", "APIKEY"}
)
_SECRET_PAIRS = frozenset({("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY")})
# Values shaped like the usual token formats (Hugging Face, OpenAI, GitHub, GitLab, Slack, AWS, Google, JWT).
_TOKEN_PREFIX = re.compile(
    r"^(?:hf_|sk-|sk_|ghp_|gho_|ghu_|ghs_|github_pat_|glpat-|xox[abposr]-|AKIA|ASIA|AIza|eyJ)"
    r"[A-Za-z0-9_\-.=+/]{8,}$"
)
_OPAQUE = re.compile(r"^[A-Za-z0-9_\-+=]{20,}$")  # long, no path or list separators
_HEX = re.compile(r"^[0-9a-fA-F]{32,}$")
_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
SHOWN = "***"
_PASSWORD_PARAM = re.compile(r"(?i)([?&](?:password|pass|pwd)=)([^&]*)")


def reference(value: str) -> str | None:
    """``"${HF_TOKEN}"`` → ``"HF_TOKEN"``: the variable a value is read from at launch; None for a literal."""
    match = _REFERENCE.match(str(value))
    return match.group(1) if match else None


def secret_name(name: str) -> bool:
    """A variable or flag named like a credential (``HF_TOKEN``, ``--api-key``, ``ssl_keyfile_password``)."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name.upper()) if w]
    pairs = zip(words, words[1:], strict=False)
    return any(w in _SECRET_WORDS for w in words) or any(pair in _SECRET_PAIRS for pair in pairs)


def looks_secret(name: str, value: str) -> bool:
    """True for a literal value that is, or may well be, a credential (a reference never is)."""
    value = str(value)
    if not value or reference(value):
        return False
    if secret_name(name):
        return True
    if _TOKEN_PREFIX.match(value) or _HEX.match(value):
        return True
    # An opaque random-looking string: long, mixed case, several digits.
    return bool(
        _OPAQUE.match(value)
        and sum(c.isdigit() for c in value) >= 3
        and any(c.islower() for c in value)
        and any(c.isupper() for c in value)
    )


def redact_argv(argv: list[str]) -> list[str]:
    """Another process's command line, fit to print: the value of a credential-named flag (``--api-key X``,
    ``--api-key=X``) and any argument shaped like a token become ``***``."""
    out: list[str] = []
    secret_next = False
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if secret_next and not arg.startswith("-"):
            out.append(SHOWN)
            secret_next = False
            continue
        secret_next = False
        if arg.startswith("-") and eq:
            out.append(f"{flag}={SHOWN}" if looks_secret(flag, value) else arg)
        elif arg.startswith("-"):
            out.append(arg)
            secret_next = secret_name(arg)
        else:
            out.append(SHOWN if looks_secret("", arg) else arg)
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment as messages and reports may show it: secret values replaced by ``***``."""
    return {k: SHOWN if looks_secret(k, v) else str(v) for k, v in env.items()}


def env_for_files(env: Mapping[str, str]) -> dict[str, str]:
    """The environment as artifacts hold it: each secret becomes a reference to the variable of its own name."""
    return {k: f"${{{k}}}" if looks_secret(k, v) else str(v) for k, v in env.items()}


def resolve_env(env: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """References filled from ``environ`` (default: this process's); ConfigError naming the first one unset."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for key, value in env.items():
        name = reference(value)
        if name is None:
            out[key] = str(value)
        elif name in environ:
            out[key] = environ[name]
        else:
            raise ConfigError(
                f"{key} is read from the environment (${{{name}}}), which does not set {name}",
                key=f"env.{key}",
                fix=f"export {name}=... before starting the fleet",
            )
    return out


# --- storage URLs ------------------------------------------------------------------------------------------
def redact_url(url: str) -> str:
    """The URL with any password (``user:pw@`` or ``?password=``) replaced by ``***``, for messages."""
    head, sep, tail = url.partition("://")
    if sep and "@" in tail:
        cred, _, host = tail.rpartition("@")
        user, colon, _ = cred.partition(":")
        tail = f"{user}:{SHOWN}@{host}" if colon else f"{user}@{host}"
    return _PASSWORD_PARAM.sub(rf"\1{SHOWN}", f"{head}{sep}{tail}")


def url_passwords(url: str) -> list[str]:
    """The passwords a URL carries (``user:pw@`` and ``?password=``), for scrubbing driver messages."""
    _, _, tail = url.partition("://")
    cred = tail.rpartition("@")[0] if "@" in tail else ""
    _, colon, password = cred.partition(":")
    found = [password] if colon and password else []
    return found + [m.group(2) for m in _PASSWORD_PARAM.finditer(url) if m.group(2)]


def redact_text(text: str, url: str) -> str:
    """``text`` (a driver's message about ``url``) with every password of the URL replaced by ``***``."""
    for password in url_passwords(url):
        text = text.replace(password, SHOWN)
    return text


def scrub(data: Any) -> Any:
    """A server's JSON (``/server_info`` echoes its ``--api-key``) with every credential-named value shown as
    ``***``, at any depth: what autotune keeps, prints or writes of a server never holds its key."""
    if isinstance(data, Mapping):
        return {k: SHOWN if secret_name(str(k)) and data[k] not in (None, "", False) else scrub(data[k]) for k in data}
    if isinstance(data, list):
        return [scrub(v) for v in data]
    return data
