"""A decode worker's state and a request's life in it (server.py's steps 1, 3 and 5), free of the gRPC edge: the
reservation table, the engine and its event-loop client, the segment lender, the KV inbox and the metrics."""

from __future__ import annotations

import logging

from decode_service.config import DecodeConfig
from decode_service.inbox import KVInbox
from decode_service.lending import SegmentLender
from decode_service.metrics import decode_metrics, observe_interval, observe_step, record_sequence
from decode_service.reservations import DecodeParams, Reservation, ReservationState, ReservationTable
from engine.client import EngineClient
from engine.core import EngineCore
from engine.feed import PrefixFeed
from engine.sequence import Sequence
from kv_wire import segments
from kv_wire.receiver import ReceivedKV
from kv_wire.segments import SegmentPool
from model_runner.loading import LoadedModel
from model_runner.paged_cache import BLOCK_SIZE
from serving import tracing

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, config: DecodeConfig, runner: LoadedModel) -> None:
        spec = runner.spec
        self.config = config
        self.spec = spec
        budget = config.kv_budget_bytes(spec)
        self.table = ReservationTable(config.max_seqs, budget, spec.kv_bytes_per_token, config.lease_s)
        # Every reservation's blocks fit: the budget in whole blocks, plus a partly used last block per sequence.
        blocks = budget // (BLOCK_SIZE * spec.kv_bytes_per_token) + config.max_seqs
        self.engine = EngineCore(runner, kv_blocks=blocks, chunk_tokens=config.prefill_chunk,
                                 batch_tokens=config.prefill_batch_tokens,
                                 kv_warm_bytes=min(int(config.kv_warm_mb * (1 << 20)), budget),
                                 on_step=lambda seconds, batch: observe_step(self.metrics, seconds, batch),
                                 prompt_pass_s=config.prefill_pass_ms / 1e3, pass_steps=config.prefill_pass_steps,
                                 on_interval=lambda seconds: observe_interval(self.metrics, seconds),
                                 busy_pass_steps=config.prefill_busy_steps,
                                 busy_backlog_s=config.prefill_busy_ms / 1e3)
        self.client = EngineClient(self.engine)  # the engine thread's hops to this event loop
        keep = int(config.buffer_keep_mb * (1 << 20))
        pool = SegmentPool(keep_bytes=keep) if config.kv_shm and segments.SHM_DIR.is_dir() else None
        self.lender = SegmentLender(pool, spec.kv_bytes_per_token)
        self.metrics = decode_metrics(self.engine, self.table, self.lender)
        self.inbox = KVInbox(spec, self.table, self._admit, self.metrics, config.lease_s, config.max_chunk_bytes)

    async def start(self, reservation: Reservation) -> None:
        """Step 1's work once reserved: lend a segment for the KV to come, or queue the prompt this worker
        prefills itself (colocated), or both (split: the prefix's KV comes from prefill, the rest runs here)."""
        params = reservation.params
        if params.split_tokens:
            reservation.feed = PrefixFeed(params.split_tokens, self.spec.num_layers)
            reservation.sequence = self._sequence(reservation, tokens=[])
            self.engine.submit_prompt(reservation.sequence, list(params.prompt), cache_salt=params.cache_salt,
                                      feed=reservation.feed)
            await self.lender.lend(reservation)
        elif params.prompt:  # colocated: prefilled here, no KV to wait for
            reservation.state = ReservationState.ADMITTED
            reservation.sequence = self._sequence(reservation, tokens=[])
            self.engine.submit_prompt(reservation.sequence, list(params.prompt), params.decoded_tokens,
                                      params.cache_salt)
        else:
            await self.lender.lend(reservation)
        if reservation.state is ReservationState.CLOSED:  # the call ended while its segment was being made
            self.lender.retire(reservation)

    def release(self, reservation: Reservation) -> None:
        """Step 5: done, cancelled, expired or failed, everything the request holds is freed. Called twice (the
        call's end, then its stream's own cleanup), the second frees what came since and counts nothing again."""
        params, first = reservation.params, reservation.state is not ReservationState.CLOSED  # table.release closes
        if reservation.sequence is not None:
            self.engine.abort(reservation.sequence)
            if first:
                record_sequence(self.metrics, reservation.sequence, colocated=bool(params.prompt))
                log.info("released after %d tokens (%s)", len(reservation.sequence.tokens),
                         "colocated" if params.prompt else "KV received")
        elif first:
            log.info("released before its KV was admitted (%s)", reservation.state.value)
        self.lender.retire(reservation)  # admitted KV took its segment already
        self.table.release(reservation)
        if reservation.transfer is not None and not reservation.transfer.done():
            reservation.transfer.cancel()  # a KV stream still arriving for a request nobody waits for

    def _admit(self, reservation: Reservation, received: ReceivedKV) -> None:
        """Step 3, for the KV inbox: the whole KV joins the batch at the next step."""
        if reservation.state is not ReservationState.TRANSFERRING:  # released while the last chunk was checked
            return  # (and its segment retired)
        release = self.lender.hand_back(reservation, received.in_segment)
        reservation.state = ReservationState.ADMITTED
        if reservation.feed is not None:  # split: every layer went to the pass already, copied out
            release()
            return
        reservation.sequence = self._sequence(reservation, tokens=[received.first_token])
        self.engine.submit_kv(reservation.sequence, received.pieces, release)

    def _sequence(self, reservation: Reservation, tokens: list[int]) -> Sequence:
        """The engine's view of a reservation; its tokens stream back through the reservation's events."""
        params: DecodeParams = reservation.params
        return Sequence(request_id=params.request_id, prompt_len=params.prompt_tokens, max_tokens=params.max_tokens,
                        sampling=params.sampling,
                        stop_token_ids=frozenset() if params.ignore_eos else frozenset(self.spec.eos_token_ids),
                        emit=self.client.emit_to(reservation.events.put_nowait), tokens=tokens,
                        steps=[] if tracing.recording() else None, tpot_target_s=params.tpot_target_ms / 1e3)

    async def close(self) -> None:
        await self.client.close()
        self.lender.close()
