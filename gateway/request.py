"""A client's request (messages.GenerateInput, from either edge), checked field by field and turned into the
parameters the journey runs with."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import math
import secrets
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message
from jinja2 import TemplateError

from gateway.errors import InvalidRequest
from gateway.messages import ChatTurn, GenerateInput, Slo
from protos.types import MAX_TPOT_TARGET_MS, SamplingParams, check_cache_salt

DEFAULT_MAX_TOKENS = 128
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
# Characters in one stop string: as AWS Bedrock caps them (OpenAI documents only a count, 4), far past any real
# sentinel ("\n\n", "</answer>", "User:"). The gateway's event loop builds a request's stop matcher in time linear
# in its stops' characters, so the cap bounds that (docs/architecture.md, "Why these numbers").
MAX_STOP_CHARS = 1000
# Turns of a conversation: as OpenAI's API caps `messages` ("maximum length of 2048 items"). Each is checked and
# rendered through the chat template, so the count bounds that work; no model's context holds more turns anyway.
MAX_MESSAGES = 2048

# Tokenizing and rendering chat templates take time linear in the prompt (up to ~1 s for a prompt at the size
# limit). They run on threads, never on the event loop (the Rust tokenizer lets go of the GIL while it encodes), in
# two lanes of one thread each: prompts up to SHORT_PROMPT_CHARS (~4k tokens, ~10 ms) in one, longer ones in the
# other, so that a flood of long prompts never queues a short one behind it, and takes at most one of the host's
# cores from the workers. Requests reach the lanes only once admitted (server.py), so a lane holds at most
# --max-in-flight jobs; a job whose request's deadline passed while it waited is dropped unrun.
SHORT_PROMPT_CHARS = 16384
_SHORT_LANE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
_LONG_LANE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-long")
_T = TypeVar("_T")
_M = TypeVar("_M", bound=Message)


@dataclass(frozen=True)
class Undecodable:
    """Bytes that are no valid request message: a string field that is not UTF-8, a corrupt wire format. The gRPC
    handler answers INVALID_ARGUMENT; had the deserializer raised, grpc would have answered UNKNOWN."""

    error: str


def lenient(message_class: type[_M]) -> Callable[[bytes], _M | Undecodable]:
    """A gRPC request deserializer that hands undecodable bytes on as Undecodable, for the handler to refuse."""

    def decode(data: bytes) -> _M | Undecodable:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Undecodable(f"the request is not a valid {message_class.DESCRIPTOR.full_name}: {exc}")

    return decode


@dataclass(frozen=True)
class GenerateParams:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool
    decoded: int = 0  # how many of prompt_ids, at their end, decode steps generated (a continuation's sent tokens)
    cache_salt: str = ""  # the prefix-cache namespace the workers get (effective_cache_salt); "" is the shared one
    ttft_target_ms: int = 0  # its service level (gateway.proto Slo; 0: the gateway's default)
    tpot_target_ms: int = 0
    refuse_late: bool = False

    @property
    def cacheable_ids(self) -> list[int]:
        """The tokens a prefill worker computes as prompt, and may keep in its prefix cache: all but the decoded."""
        return self.prompt_ids[: len(self.prompt_ids) - self.decoded]

    def continued(self, sent: list[int]) -> GenerateParams:
        """The rest of this request after `sent` tokens reached the client: they become part of the prompt.

        Sampling is keyed by (seed, position), and positions are unchanged; the workers run the sent tokens as the
        decode steps that generated them did (`decoded`: same bits), so the continuation picks the tokens the
        uninterrupted request would have."""
        return dataclasses.replace(self, prompt_ids=self.prompt_ids + sent, max_tokens=self.max_tokens - len(sent),
                                   decoded=self.decoded + len(sent))


CHAT_ROLES = ("system", "user", "assistant")


def chat_turns(messages: Sequence[ChatTurn], tokenizer: Any, max_chars: int) -> list[dict[str, str]]:
    """The conversation as the chat template takes it, checked: known roles, at most MAX_MESSAGES turns and
    `max_chars` characters of content."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages: {len(messages)} messages; at most {MAX_MESSAGES} are accepted")
    turns = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            role = message.role[:32] + ("..." if len(message.role) > 32 else "")
            raise InvalidRequest(f"messages[{i}].role = {role!r}: expected one of {', '.join(CHAT_ROLES)}")
        turns.append({"role": message.role, "content": message.content})
    chars = sum(len(turn["content"]) for turn in turns)
    if chars > max_chars:
        raise InvalidRequest(f"messages hold {chars} characters of content; none over {max_chars} can fit the "
                             "model's context")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("messages: this model's tokenizer has no chat template; send a prompt instead")
    return turns


def chat_prompt(turns: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The conversation's token ids under the tokenizer's chat template, ending with the assistant's turn."""
    try:
        encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    except TemplateError as exc:  # a template may refuse a conversation (raise_exception), e.g. roles out of turn
        raise InvalidRequest(f"messages: the model's chat template refused them: {exc}") from None
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@functools.lru_cache(maxsize=4)
def _longest_token_chars(tokenizer: Any) -> int:
    # A vocabulary entry is spelled with at least as many characters as the text it stands for (byte-level BPE
    # spells each byte as one character, SentencePiece a space as one), so no token covers more than this.
    return max(map(len, tokenizer.get_vocab()), default=1)  # ~20 ms for 49,152 entries: once, off the loop


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a prompt can have and still fit the context: no token covers more than the vocabulary's
    longest. A longer prompt is refused before it is tokenized, and no prompt that fits ever is."""
    return max_model_len * _longest_token_chars(tokenizer)


def _no_room(tokens: int, max_model_len: int) -> InvalidRequest:
    return InvalidRequest(f"prompt is {tokens} tokens; the model's context is {max_model_len} tokens and needs "
                          "room for at least one generated token")


async def _off_loop(work: Callable[..., _T], *args: Any, chars: int = 0, deadline: float | None = None) -> _T:
    """`work(*args)` in the tokenizing lane for `chars` characters of text; dropped unrun once `deadline` (loop
    time, which is time.monotonic) has passed. Cancelling the caller drops it too, if it has not started."""

    def run() -> _T:
        if deadline is not None and time.monotonic() > deadline:
            raise InvalidRequest("the request's deadline passed while it waited to be tokenized")
        return work(*args)

    lane = _LONG_LANE if chars > SHORT_PROMPT_CHARS else _SHORT_LANE
    return await asyncio.get_running_loop().run_in_executor(lane, run)


def effective_cache_salt(cache_salt: str, tenant: str) -> str:
    """The prefix-cache namespace of a request: its own cache_salt if it gave one (a secret: whoever sends the same
    salt shares the cache, across API keys too), else its API key's (`tenant`), else "" (a gateway without keys is
    one tenant). Hashed with which of the two it is, so no salt a client chooses names a key's namespace, and the
    client's secret goes no further than the gateway."""
    if cache_salt:
        return hashlib.sha256(b"pdserve-cache-salt\0" + cache_salt.encode()).hexdigest()
    if tenant:
        return hashlib.sha256(b"pdserve-cache-tenant\0" + tenant.encode()).hexdigest()
    return ""


def check_stop(stop: Sequence[str]) -> None:
    """Raises InvalidRequest unless `stop` is at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS
    characters each."""
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}] is {len(s)} characters; a stop string may have at most {MAX_STOP_CHARS}")


async def parse_request(
    request: GenerateInput | Undecodable, tokenizer: Any, vocab_size: int, max_model_len: int, tenant: str = "",
    deadline: float | None = None,
) -> GenerateParams:
    """`tenant`: who sent it (auth.ApiKeys.tenant). Every check costs time linear in what the request carries, and
    the cheap ones come first. A prompt or a conversation too long to fit the context is refused by its length in
    characters, before any tokenizing; what is tokenized is tokenized off the event loop."""
    if isinstance(request, Undecodable):  # from lenient(): refused here, as every other bad request is
        raise InvalidRequest(request.error)
    given = [name for name in ("prompt", "token_ids", "messages") if getattr(request, name)]
    if len(given) != 1:
        raise InvalidRequest(f"give exactly one of prompt, token_ids and messages (got {' and '.join(given)})"
                             if given else "prompt is empty: give a non-empty prompt, token_ids or messages")
    if request.max_tokens is not None and request.max_tokens < 1:
        raise InvalidRequest("max_tokens must be >= 1")
    sampling = _sampling(request)
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if not request.request_id.isprintable():  # it is logged: a newline in it would forge log lines
        raise InvalidRequest("request_id may hold printable characters only")
    check_stop(request.stop)
    try:
        check_cache_salt(request.cache_salt)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    check_slo(request.slo)
    prompt_ids = await _prompt_ids(request, tokenizer, vocab_size, max_model_len, deadline)
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise _no_room(len(prompt_ids), max_model_len)
    max_tokens = request.max_tokens if request.max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise InvalidRequest(f"max_tokens = {max_tokens} exceeds the {room} tokens the context leaves after a "
                             f"{len(prompt_ids)}-token prompt (context {max_model_len})")
    return GenerateParams(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=list(request.stop),
        ignore_eos=request.ignore_eos,
        cache_salt=effective_cache_salt(request.cache_salt, tenant),
        ttft_target_ms=request.slo.ttft_ms,
        tpot_target_ms=request.slo.tpot_ms,
        refuse_late=request.slo.refuse_late,
    )


MAX_TTFT_TARGET_MS = 3_600_000


def check_slo(slo: Slo) -> None:
    if slo.ttft_ms > MAX_TTFT_TARGET_MS:
        raise InvalidRequest(f"slo.ttft_ms {slo.ttft_ms}: must be at most {MAX_TTFT_TARGET_MS}")
    if slo.tpot_ms > MAX_TPOT_TARGET_MS:
        raise InvalidRequest(f"slo.tpot_ms {slo.tpot_ms}: must be at most {MAX_TPOT_TARGET_MS}")
    if slo.refuse_late and not slo.ttft_ms:
        raise InvalidRequest("slo.refuse_late needs slo.ttft_ms (or leave it false)")


def _float32(value: float) -> float:
    """`value` as the workers get it: sampling floats travel as float32 (worker.proto); past its range, infinite."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _sampling(request: GenerateInput) -> SamplingParams:
    """The request's sampling parameters, checked by the rules the workers apply (protos/types.py) to the values
    they will get."""
    try:
        return SamplingParams(
            temperature=_float32(request.temperature) if request.temperature is not None else 1.0,
            top_p=_float32(request.top_p) if request.top_p is not None else 1.0,
            top_k=request.top_k,
            seed=request.seed if request.seed is not None else secrets.randbits(63))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


async def _prompt_ids(
    request: GenerateInput, tokenizer: Any, vocab_size: int, max_model_len: int,
    deadline: float | None = None,
) -> list[int]:
    max_chars = await _off_loop(max_prompt_chars, tokenizer, max_model_len)  # computed once per tokenizer
    if request.messages:
        turns = chat_turns(request.messages, tokenizer, max_chars)
        chars = sum(len(turn["content"]) for turn in turns)
        return await _off_loop(chat_prompt, turns, tokenizer, chars=chars, deadline=deadline)
    if request.prompt:
        if len(request.prompt) > max_chars:
            raise InvalidRequest(f"prompt is {len(request.prompt)} characters; none over {max_chars} can fit the "
                                 f"model's context of {max_model_len} tokens")
        prompt_ids = await _off_loop(lambda: list(tokenizer.encode(request.prompt)), chars=len(request.prompt),
                                     deadline=deadline)
        if not prompt_ids:
            raise InvalidRequest("prompt tokenizes to no tokens")
        return prompt_ids
    if len(request.token_ids) >= max_model_len:  # before the ids are copied and scanned
        raise _no_room(len(request.token_ids), max_model_len)
    prompt_ids = list(request.token_ids)
    bad = next((i for i, t in enumerate(prompt_ids) if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token_ids[{bad}] = {prompt_ids[bad]} is outside the vocabulary (size {vocab_size})")
    return prompt_ids
