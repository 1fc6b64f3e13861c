"""The gateway's tokenizer: the model's tokenizer.json run by the `tokenizers` library, and its chat template rendered
with jinja2 the way transformers renders it. transformers itself is not imported: it loads torch (~2 s of start-up
and ~300 MB in a process that never runs the model).

It reads what transformers' generic fast tokenizer reads from a model directory: tokenizer.json (whose post-processor
says which special tokens every input gets), the named special tokens of tokenizer_config.json, and the chat
template (chat_template.jinja, or tokenizer_config.json's "chat_template"). A tokenizer class of transformers' own
that adds tokens in Python is not imitated; the directories transformers saves carry them in tokenizer.json.
tests/test_gateway_tokenizer.py checks it against transformers.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.models import DEFAULT_MODEL, model_dir

# transformers' named special tokens: the chat template sees each one the config names (bos_token, eos_token, ...)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Text <-> token ids, and chat turns -> token ids, for one model. Thread-safe: the request threads share it."""

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: dict[str, str],
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self.special_tokens = special_tokens  # name (bos_token, ...) -> its text
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template is not None else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json: the gateway reads a model's fast tokenizer only "
                             "(transformers writes one: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        backend = tokenizers.Tokenizer.from_file(str(path))
        special = {name: _content(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        known = {token.content for token in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens([tokenizers.AddedToken(text, special=True, normalized=False)
                                    for text in dict.fromkeys(special.values()) if text not in known])
        return cls(backend, special, _chat_template(model_dir, config))

    def encode(self, text: str) -> list[int]:
        """The text's token ids, with the special tokens the model adds to every input (a BOS, for some)."""
        return _ids(self.backend, text, add_special_tokens=True)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, turns: list[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int] | str:
        """The conversation rendered by the chat template and, with `tokenize`, its token ids (no special tokens
        added: the template writes them). Raises jinja2.TemplateError when the template refuses the conversation."""
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template")
        text = self._template.render(messages=turns, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return _ids(self.backend, text, add_special_tokens=False) if tokenize else text


def _ids(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The text's ids by the batch call, which releases the GIL while it works (`encode` holds it: a 660,000-character
    prompt tokenized in a thread stopped the gateway's event loop 0.67 s); the fast one skips the offsets, which
    nobody reads, at half the time."""
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _content(token: str | dict[str, Any]) -> str:
    return token if isinstance(token, str) else str(token["content"])  # an AddedToken, serialized


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    """As transformers compiles chat templates: a sandbox (templates come from model repositories: untrusted code),
    trim_blocks and lstrip_blocks, loop controls, and the helpers templates call."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def tokenizer_dir(model: str) -> Path:
    """The model's directory. The gateway never converts the default model: a worker does, before it answers
    GetInfo, and serve() reads the tokenizer only once workers have answered."""
    path = model_dir(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: {path} holds no converted model yet; a prefill or decode worker "
                         "converts it when it starts (with PDSERVE_CACHE pointing where this gateway looks)")
    return path


def model_name(model: str) -> str:
    """The name clients use for the model: the default model's name, or a model directory's name."""
    return model if model == DEFAULT_MODEL else os.path.basename(os.path.normpath(model))
