"""Where a model's files are: the default model's name, the cache it is converted into, and a --model argument
checked as a directory. Torch-free: the gateway finds its tokenizer here; model_runner/loading.py converts the
default model into default_model_dir() the first time a worker needs it."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def is_default(spec: str | None) -> bool:
    return spec in (None, "", DEFAULT_MODEL)


def default_model_dir() -> Path:
    """Where the default model is converted to; it holds a config.json once it has been."""
    return cache_root() / "models" / DEFAULT_MODEL


def model_dir(spec: str | None) -> Path:
    """The local Hugging Face model directory for `spec`: the default model's name (or None), or a path. The default
    model's directory may not be converted yet; any other must hold a config.json (ValueError)."""
    if is_default(spec):
        return default_model_dir()
    assert spec is not None
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {spec!r}: not {DEFAULT_MODEL!r} and not a directory with a config.json")
    return path.resolve()
