"""A chat message as prompt files hold it: the type rows and chat templates share, below both."""

from __future__ import annotations

from typing import Any, TypedDict


class ChatMessage(TypedDict, total=False):
    """One chat message as a prompt file holds it and the chat endpoint takes it (OpenAI's shape): its role and
    content, a string or a list of content parts. Any other key a file gives (``name``, tool calls) is kept and sent
    as it is."""

    role: str
    content: str | list[Any]
