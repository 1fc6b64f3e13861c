"""A client's GenerateRequest, checked field by field and turned into plain parameters."""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from model_runner.sampling import SamplingParams
from protos import gateway_pb2

DEFAULT_MAX_TOKENS = 128
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
# Characters in one stop string: as AWS Bedrock caps them (OpenAI documents only a count, 4), far past any real
# sentinel ("\n\n", "</answer>", "User:"). The gateway's event loop builds a request's stop matcher in time linear
# in its stops' characters: 16 at the cap take ~30 ms here; a 300,000-character one would take seconds.
MAX_STOP_CHARS = 1000


class InvalidRequest(ValueError):
    """A request the gateway refuses; the message names the field."""


class RequestFailed(Exception):
    """How a request ended when it did not finish: the status its client sees, whatever the transport (gRPC
    aborts with it; HTTP maps it to a status code and an OpenAI error object). `retry_after_ms` is set when it
    was refused for load."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms


@dataclass(frozen=True)
class GenerateParams:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool

    def continued(self, sent: list[int]) -> GenerateParams:
        """The rest of this request after `sent` tokens reached the client: they become part of the prompt.

        Sampling is keyed by (seed, position), and positions are unchanged, so the continuation picks the
        tokens the uninterrupted request would have."""
        return dataclasses.replace(self, prompt_ids=self.prompt_ids + sent, max_tokens=self.max_tokens - len(sent))


CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(messages: Iterable[gateway_pb2.ChatMessage], tokenizer: Any) -> list[int]:
    """The conversation's token ids under the tokenizer's chat template, ending with the assistant's turn."""
    turns = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role = {message.role!r}: expected one of {', '.join(CHAT_ROLES)}")
        turns.append({"role": message.role, "content": message.content})
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("messages: this model's tokenizer has no chat template; send a prompt instead")
    encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def check_stop(stop: Sequence[str]) -> None:
    """Raises InvalidRequest unless `stop` is at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS
    characters each."""
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}] is {len(s)} characters; a stop string may have at most {MAX_STOP_CHARS}")


def parse_request(
    request: gateway_pb2.GenerateRequest, tokenizer: Any, vocab_size: int, max_model_len: int
) -> GenerateParams:
    given = [name for name in ("prompt", "token_ids", "messages") if getattr(request, name)]
    if len(given) != 1:
        raise InvalidRequest(f"give exactly one of prompt, token_ids and messages (got {' and '.join(given)})"
                             if given else "prompt is empty: give a non-empty prompt, token_ids or messages")
    if request.messages:
        prompt_ids = chat_prompt(request.messages, tokenizer)
    elif request.prompt:
        prompt_ids = list(tokenizer(request.prompt).input_ids)
        if not prompt_ids:
            raise InvalidRequest("prompt tokenizes to no tokens")
    else:
        prompt_ids = list(request.token_ids)
        bad = next((i for i, t in enumerate(prompt_ids) if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token_ids[{bad}] = {prompt_ids[bad]} is outside the vocabulary (size {vocab_size})")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise InvalidRequest(f"prompt is {len(prompt_ids)} tokens; the model's context is {max_model_len} tokens "
                             "and needs room for at least one generated token")
    if request.HasField("max_tokens"):
        max_tokens = request.max_tokens
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be >= 1")
        if max_tokens > room:
            raise InvalidRequest(f"max_tokens = {max_tokens} exceeds the {room} tokens the context leaves after a "
                                 f"{len(prompt_ids)}-token prompt (context {max_model_len})")
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    temperature = request.temperature if request.HasField("temperature") else 1.0
    if not 0 <= temperature <= 2:  # also refuses NaN
        raise InvalidRequest(f"temperature = {temperature} is outside [0, 2]")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p = {top_p} is outside (0, 1]")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    check_stop(request.stop)
    seed = request.seed if request.HasField("seed") else secrets.randbits(63)
    return GenerateParams(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=request.top_k, seed=seed),
        stop=list(request.stop),
        ignore_eos=request.ignore_eos,
    )
