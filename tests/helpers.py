"""What tests share besides conftest.py's fixtures: clusters and their leak checks, waiting for an event, a decode
worker's handoff driven by hand, the references outputs are held to, the fast runner's greedy decoding over a
paged cache, and sequences driven through the decode engine in-process.

Tests import these from here, never from each other or from conftest.py (docs/testing.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import torch

from engine.core import EngineCore
from engine.feed import PrefixFeed
from engine.prompts import Prefilled, PromptJob
from engine.sequence import Sequence
from kv_wire.layout import KVLayout
from kv_wire.sender import KVSender
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.paged_cache import BLOCK_SIZE, PagedKVCache, pieces_of
from model_runner.sampling import sample
from pdserve.client import Completion, generate
from pdserve.cluster import Cluster, ClusterConfig, Service, start
from protos import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, prefill_pb2_grpc, worker_pb2
from protos.types import SamplingParams
from serving.metrics import scrape

if TYPE_CHECKING:
    from kv_wire.segments import SegmentView

T = TypeVar("T")


# --- Waiting for an event -------------------------------------------------------------------------------------

def wait_until(condition: Callable[[], T], what: str | Callable[[], str], timeout_s: float = 10.0,
               interval_s: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy, and return that. After `timeout_s`, fail with "timed
    out waiting for `what`" (a callable `what` is called then, so the message can show the state it found).

    Wait on what a test can see (GetInfo, /metrics, a file, a thread's event), never sleep in its place."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")
        time.sleep(interval_s)


# --- Clusters and the leak check ------------------------------------------------------------------------------

def start_cluster(model_dir: Path, prefill: int = 1, decode: int = 1, decode_args: tuple[str, ...] = (),
                  prefill_args: tuple[str, ...] = (), colocate_below: int = 0,
                  gateway_args: tuple[str, ...] = (), tls_dir: str = "", dtype: str = "float32") -> Cluster:
    """float32 unless asked: most tests compare tokens with Hugging Face `generate` in float32. The gateway places
    prompts by the fixed thresholds unless `gateway_args` names a --placement: a test that checks a path (a KV
    transfer, a prefill queue) must not see its prompt placed elsewhere by costs measured on a busy machine."""
    if not any(arg.startswith("--placement") for arg in gateway_args):
        gateway_args = ("--placement=threshold", *gateway_args)
    return start(ClusterConfig(prefill=prefill, decode=decode, model=str(model_dir), threads=1, dtype=dtype,
                               decode_args=decode_args, prefill_args=prefill_args, startup_timeout_s=180,
                               colocate_below=colocate_below, gateway_args=gateway_args, tls_dir=tls_dir))


def start_keyed_cluster(model_dir: Path, keys: list[str], **kwargs: Any) -> Cluster:
    """start_cluster with a gateway that requires one of `keys` (PDSERVE_API_KEYS, set for the start only)."""
    import pytest

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDSERVE_API_KEYS", ",".join(keys))
        return start_cluster(model_dir, **kwargs)


def worker_infos(cluster: Cluster, prefill: bool = True) -> list[worker_pb2.WorkerInfo]:
    """GetInfo of every decode worker, and of every prefill worker unless `prefill` is False."""
    infos = []
    for services, stub_class in ((cluster.prefill if prefill else [], prefill_pb2_grpc.PrefillStub),
                                 (cluster.decode, decode_pb2_grpc.DecodeStub)):
        for service in services:
            with cluster.channel(service) as channel:  # with the client certificate under mutual TLS
                infos.append(stub_class(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5))
    return infos


def worker_info(service: Service) -> worker_pb2.WorkerInfo:
    """One plain-text decode worker's GetInfo."""
    with grpc.insecure_channel(service.address) as channel:
        return decode_pb2_grpc.DecodeStub(channel).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5)


def held(info: worker_pb2.WorkerInfo) -> tuple[int, int, int, int]:
    return info.live_reservations, info.live_sequences, info.live_kv_bytes, info.live_buffer_bytes


def assert_nothing_held(cluster: Cluster, within_s: float = 10.0, prefill: bool = True) -> None:
    """Every worker's live reservations, sequences, KV bytes and transfer buffers return to zero in `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        infos = worker_infos(cluster, prefill)
        if all(held(info) == (0, 0, 0, 0) for info in infos):
            return
        if time.monotonic() > deadline:
            raise AssertionError("still held (reservations, sequences, kv bytes, buffer bytes): "
                                 + ", ".join(f"{i.role} pid {i.pid}: {held(i)}" for i in infos))
        time.sleep(0.05)


# The gauges of what is in flight, by role: each returns to zero when nothing is.
LIVE_GAUGES = {"gateway": ["pdserve_live_requests"], "prefill": ["pdserve_live_prefills", "pdserve_queued_tokens"],
               "decode": ["pdserve_live_reservations", "pdserve_live_sequences", "pdserve_live_kv_bytes",
                          "pdserve_live_buffer_bytes"]}


def services_by_role(cluster: Cluster) -> list[tuple[str, Service]]:
    return [("gateway", cluster.gateway), *(("prefill", s) for s in cluster.prefill),
            *(("decode", s) for s in cluster.decode)]


def live_gauges(cluster: Cluster) -> dict[str, float]:
    """Each of LIVE_GAUGES summed over the cluster's services, scraped from their /metrics."""
    totals: dict[str, float] = {}
    for role, service in services_by_role(cluster):
        samples = scrape(service.metrics)
        for name in LIVE_GAUGES[role]:
            totals[name] = totals.get(name, 0) + samples[name]
    return totals


def assert_nothing_live(cluster: Cluster, within_s: float = 10.0) -> None:
    """The leak check as /metrics tells it, gateway included: every live gauge is back to zero in `within_s`."""
    wait_until(lambda: set(live_gauges(cluster).values()) == {0},
               lambda: f"every live gauge at zero: {live_gauges(cluster)}", timeout_s=within_s)


# --- A decode worker's handoff, driven by hand (as the gateway and prefill drive it) ----------------------------

PROMPT_TOKENS = 6  # the prompt length `reserve` asks decode to hold KV for
GREEDY = worker_pb2.SamplingParams(temperature=0.0, top_p=1.0)


def reserve(stub: decode_pb2_grpc.DecodeStub, request_id: str, max_tokens: int = 4) -> tuple[Any, str]:
    """A reservation for PROMPT_TOKENS of KV, as the gateway makes one: the decode call (its next messages are the
    tokens) and the reservation's token, which `kv_stream` must present."""
    call = stub.Generate(decode_pb2.DecodeRequest(request_id=request_id, prompt_tokens=PROMPT_TOKENS,
                                                  max_tokens=max_tokens, sampling=GREEDY), timeout=30)
    return call, next(call).reserved.token


def kv_layout(stub: decode_pb2_grpc.DecodeStub) -> tuple[worker_pb2.ModelInfo, KVLayout]:
    """The worker's model, and the layout of PROMPT_TOKENS of its KV."""
    model = stub.GetInfo(worker_pb2.WorkerInfoRequest()).model
    return model, KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, PROMPT_TOKENS, model.dtype)


def kv_stream(stub: decode_pb2_grpc.DecodeStub, request_id: str, token: str, fingerprint: str | None = None,
              segment: SegmentView | None = None, layers: int | None = None) -> list[kv_transfer_pb2.KVTransfer]:
    """Random KV for a reservation, as prefill sends it, one layer at a time as each is produced; into `segment` if
    given (descriptors on the wire). With `layers`, only that many layers are sent, and the stream stops there (a
    writer that never finished)."""
    model, layout = kv_layout(stub)
    sender = KVSender(request_id, token, fingerprint or model.fingerprint, layout, chunk_bytes=256, segment=segment)
    messages = [sender.header()]
    for layer in range(model.num_layers if layers is None else layers):
        chunks = sender.encode([(layer, torch.randn(layout.tensor_shape), torch.randn(layout.tensor_shape))])
        messages += map(kv_transfer_pb2.KVTransfer.FromString, chunks)
    return messages + ([sender.trailer(first_token=42)] if layers is None else [])


def decoding_worker(cluster: Cluster) -> Service:
    """The decode worker running a sequence now (waits up to 10 s for one to start)."""
    def running() -> Service | None:
        return next((service for service in cluster.decode if worker_info(service).live_sequences), None)

    return wait_until(running, "a decode worker running a sequence", interval_s=0.01)


# --- References -----------------------------------------------------------------------------------------------

POEM = "Write a short poem about the sea, the wind, and the long night of the northern winter."
PROMPTS = [
    "Hi",
    "The capital of France is",
    POEM,
    "def fibonacci(n):\n    " * 12,
]

_models: dict[Path, torch.nn.Module] = {}


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: Hugging Face generate, greedy, same model, in float32 (each model loaded once per session)."""
    if model_dir not in _models:
        from transformers import AutoModelForCausalLM

        _models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    output = _models[model_dir].generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, len(prompt_ids):].tolist()


def assert_greedy_matches_hugging_face(cluster: Cluster, model_dir: Path) -> list[Completion]:
    """PROMPTS at once through the cluster's gateway, greedy: tokens, text, finish reason and usage are those of
    Hugging Face's `generate`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    address = cluster.gateway.address
    max_tokens = 24
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        completions = list(pool.map(
            lambda p: generate(address, timeout=60, prompt=p, max_tokens=max_tokens, temperature=0.0), PROMPTS))
    for prompt, completion in zip(PROMPTS, completions):
        prompt_ids = tokenizer(prompt).input_ids
        expected = hf_greedy(model_dir, prompt_ids, max_tokens)
        assert completion.token_ids == expected, prompt
        assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if expected[-1] == 2 else "length")
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == len(prompt_ids)
        assert completion.usage.completion_tokens == len(expected)
        assert completion.timing.ttft_ms > 0
    return completions


class Recorder:
    """A prefill engine job whose delivered layers and outcome are kept; `hold` blocks the engine inside its first
    delivery."""

    def __init__(self, prompt: list[int], hold: threading.Event | None = None) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.addresses: dict[int, tuple[int, int]] = {}  # where each delivered layer's keys and values lie
        self.outcome: Prefilled | BaseException | None = None
        self.finished = threading.Event()
        self.entered = threading.Event()
        self.hold = hold
        self.job = PromptJob(prompt, SamplingParams(temperature=0.0), self._deliver, self._finish)

    def _deliver(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        assert layer not in self.layers
        self.layers[layer] = (keys.clone(), values.clone())
        self.addresses[layer] = (keys.data_ptr(), values.data_ptr())
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(30)

    def _finish(self, outcome: Prefilled | BaseException) -> None:
        assert self.outcome is None
        self.outcome = outcome
        self.finished.set()

    def wait(self) -> Prefilled | BaseException:
        assert self.finished.wait(60)
        assert self.outcome is not None
        return self.outcome



# --- The fast runner's references -----------------------------------------------------------------------------

def save_random_llama(path: Path, **config: Any) -> Path:
    """A Llama of this config (tied embeddings) with random weights, seed 0, saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **config)).save_pretrained(path)
    return path


def greedy(runner: LoadedModel, prompts: list[list[int]], steps: int) -> list[tuple[list[int], list[list[int]]]]:
    """Each prompt's greedy tokens and the top 5 at every position, prompts prefilled one by one and decoded
    together as the decode engine does: a paged cache, one batch."""
    spec = runner.spec
    cache = PagedKVCache(spec.num_layers, sum(cache_blocks(len(p) + steps) for p in prompts), spec.num_kv_heads,
                         spec.head_dim, runner.dtype, runner.device)
    tables, logits = [], []
    for prompt in prompts:
        last, kv = forward.prefill(runner, prompt)
        tables.append(cache.allocate(len(prompt) + steps))
        cache.load(tables[-1], pieces_of(kv), len(prompt))
        logits.append(last)
    rows = torch.stack(logits)
    out: list[tuple[list[int], list[list[int]]]] = [([], []) for _ in prompts]
    positions = [len(p) for p in prompts]
    for step in range(steps):
        for (tokens, top), row in zip(out, rows):
            tokens.append(int(row.argmax()))
            top.append(row.float().topk(5).indices.tolist())
        if step + 1 < steps:
            rows = forward.decode_step(runner, cache, [t[-1] for t, _ in out], tables, positions)
            positions = [p + 1 for p in positions]
    return out


def cache_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def hf_reference(model_dir: Path, prompt: list[int], steps: int) -> tuple[list[int], list[list[int]]]:
    """Hugging Face `generate` in float32 on the CPU, greedy: its tokens and the top 5 at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].topk(5).indices.tolist() for s in out.scores]


def assert_close(ours: tuple[list[int], list[list[int]]], reference: tuple[list[int], list[list[int]]],
                 label: str) -> int:
    """vLLM's check_logprobs_close: equal tokens until the first divergence, where each side's token is in the
    other's top 5; after it the sequences are not compared. Returns the tokens that agreed."""
    for position, (a, b) in enumerate(zip(ours[0], reference[0])):
        if a != b:
            assert a in reference[1][position] and b in ours[1][position], (
                f"{label}: position {position}: ours {a} (top 5 {ours[1][position]}), reference {b} "
                f"(top 5 {reference[1][position]})")
            return position
    return len(ours[0])


# --- The decode engine in-process -----------------------------------------------------------------------------

ENGINE_MAX_TOKENS = 12


class EngineStream:
    """One sequence in the engine, with its tokens as they are emitted."""

    def __init__(self, engine: EngineCore, runner: LoadedModel, prompt: list[int], sampling: SamplingParams,
                 name: str, at: dict[int, Callable[[], None]] | None = None, colocated: bool = False,
                 max_tokens: int = ENGINE_MAX_TOKENS, feed: PrefixFeed | None = None) -> None:
        self.tokens: list[int] = []
        self.finish = ""
        self.progress = threading.Condition()
        self.at = at or {}  # token count -> hook run on the engine thread, inside the step that reached it
        self.seq = Sequence(request_id=name, prompt_len=len(prompt), max_tokens=max_tokens, sampling=sampling,
                            stop_token_ids=frozenset(), emit=self._emit)
        if colocated or feed is not None:  # the engine prefills it (split: after the prefix the feed brings)
            engine.submit_prompt(self.seq, prompt, feed=feed)
            return
        logits, kv = forward.prefill(runner, prompt)
        self.tokens = [sample(logits, sampling, position=len(prompt))]
        self.seq.tokens = list(self.tokens)
        engine.submit_kv(self.seq, pieces_of(kv), release=lambda: None)

    def _emit(self, token_ids: list[int], reason: str) -> None:
        with self.progress:
            self.tokens += token_ids
            self.finish = reason
            self.progress.notify_all()
        if len(self.tokens) in self.at:
            self.at.pop(len(self.tokens))()

    def wait_for(self, count: int = 0) -> None:
        with self.progress:
            done = self.progress.wait_for(lambda: self.finish or (count and len(self.tokens) >= count), timeout=60)
        assert done, "the engine stopped emitting"


def decode_alone(runner: LoadedModel, prompt: list[int], sampling: SamplingParams) -> list[int]:
    engine = EngineCore(runner, kv_blocks=64)
    engine.start()
    try:
        stream = EngineStream(engine, runner, prompt, sampling, "alone")
        stream.wait_for()
        return stream.tokens
    finally:
        engine.close()
