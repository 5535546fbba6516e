"""The served model's own chat template: how chat rows become the text the native ``/generate`` endpoint gets.

SGLang's chat endpoint applies the model's template itself; the native endpoint takes text, so the replay has to
render it, and a hand-written ChatML is right for Qwen only. A model directory carries its template in
``chat_template.jinja`` (what recent transformers write) or in ``tokenizer_config.json``'s ``chat_template`` (a
string, or named templates of which ``default`` is used). It is rendered the way transformers renders it: a
sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks`` and loop controls, ``tojson`` that keeps
non-ASCII text, ``raise_exception`` and ``strftime_now``, with ``add_generation_prompt`` set.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from autotune.errors import WorkloadError

if TYPE_CHECKING:
    from autotune.prompts.messages import ChatMessage

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _token(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}`` (AddedToken)."""
    if isinstance(value, dict):
        return str(value.get("content") or "")
    return str(value or "")


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, compiled once; ``path`` is the file it came from (named in errors)."""

    source: str
    path: Path
    bos_token: str = ""
    eos_token: str = ""
    _compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise WorkloadError(
                f"the model's chat template does not compile ({exc.message}, template line {exc.lineno})",
                file=str(self.path),
                fix='fix the template, or send chat rows to the chat endpoint ([workload] endpoint = "chat")',
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text for ``messages``, ending where the assistant's reply begins."""
        try:
            return str(
                self._compiled.render(
                    messages=list(messages),
                    add_generation_prompt=True,
                    tools=None,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                )
            )
        except jinja2.TemplateError as exc:
            raise WorkloadError(
                f"the model's chat template refused a prompt ({exc})",
                file=str(self.path),
                fix="check the prompt's roles and order against the template, or send chat rows "
                'to the chat endpoint ([workload] endpoint = "chat")',
            ) from None

    @classmethod
    def find(cls, model_path: str | Path | None) -> ChatTemplate | None:
        """The template of the model at ``model_path`` when it is a directory that has one; None otherwise (a
        bundled profile name, a hub id, a model without a template: the caller's default applies)."""
        if model_path is None:
            return None
        root = Path(model_path)
        if not root.is_dir():
            return None
        config = _tokenizer_config(root / TOKENIZER_CONFIG)
        specials = {"bos_token": _token(config.get("bos_token")), "eos_token": _token(config.get("eos_token"))}
        standalone = root / TEMPLATE_FILE
        if standalone.is_file():
            return cls(standalone.read_text(encoding="utf-8"), standalone, **specials)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template.strip():
            return cls(template, root / TOKENIZER_CONFIG, **specials)
        return None


def _tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(
            f"cannot read the model's tokenizer config ({exc})",
            file=str(path),
            fix="repair or re-download tokenizer_config.json",
        ) from None
    return data if isinstance(data, dict) else {}
