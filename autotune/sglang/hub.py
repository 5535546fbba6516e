"""A HuggingFace model id → a local folder with its ``config.json`` and safetensors index (no weights).

The local HuggingFace cache is read first (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``: ``models--ORG--NAME/snapshots/REV/``); failing that, the two small files are
fetched from the Hub into autotune's cache, unless ``HF_HUB_OFFLINE`` is set. ``HF_TOKEN`` is sent for gated
models and never written anywhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from autotune.errors import ProfileError
from autotune.sglang.checkpoint import INDEX_NAME

HUB_URL = "https://huggingface.co"
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def find_model(model_id: str) -> Path | None:
    """The folder holding ``model_id``'s config.json, or None when it is not an ``org/name`` id."""
    if not _ID.match(model_id):
        return None
    cached = _in_hf_cache(model_id)
    if cached is not None:
        return cached
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return None
    return _download(model_id)


def _hf_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return home / "hub"


def _in_hf_cache(model_id: str) -> Path | None:
    repo = _hf_cache() / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
        return snapshots / ref.read_text().strip()
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1].parent if found else None


def _cache_dir() -> Path:
    return Path(os.environ.get("AUTOTUNE_CACHE_DIR") or Path.home() / ".cache" / "autotune") / "hub"


def _download(model_id: str, *, transport: httpx.BaseTransport | None = None) -> Path | None:
    """``config.json`` and (when the repo has one) the safetensors index, into autotune's cache."""
    folder = _cache_dir() / model_id.replace("/", "--")
    if (folder / "config.json").is_file():
        return folder
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    files: dict[str, bytes] = {}
    try:
        with httpx.Client(
            base_url=HUB_URL, headers=headers, timeout=15.0, follow_redirects=True, transport=transport
        ) as client:
            for name in ("config.json", INDEX_NAME):
                resp = client.get(f"/{model_id}/resolve/main/{name}")
                if resp.status_code == 404 and name != "config.json":
                    continue
                if resp.status_code in (401, 403):
                    raise ProfileError(
                        f"the Hub refused {name} of {model_id!r} ({resp.status_code})",
                        key="model",
                        fix="set HF_TOKEN for a gated model, or point at a local folder",
                    )
                if resp.status_code == 404:
                    return None
                resp.raise_for_status()
                files[name] = resp.content
    except httpx.HTTPError as exc:
        raise ProfileError(
            f"cannot fetch {model_id!r} from the Hub: {type(exc).__name__}",
            key="model",
            fix="point at a local folder with config.json (and model.safetensors.index.json), or set HF_HUB_OFFLINE=1",
        ) from None
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in sorted(files.items(), key=lambda kv: kv[0] == "config.json"):  # config.json last
        tmp = folder / f".{name}.part"
        tmp.write_bytes(body)
        tmp.replace(folder / name)
    return folder
