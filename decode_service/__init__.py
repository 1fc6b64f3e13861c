"""Decode service: receives KV from prefill, continuous-batches decode, streams tokens to the gateway.

- server.py: the gRPC edge (Generate, GetInfo) and the life of a request here;
- validation.py: what a DecodeRequest must pass before anything is reserved for it;
- reservations.py: the slot and KV budget promised to a request before its prefill starts;
- lending.py: the shared-memory segment a reservation lends to a prefill worker on the same host;
- inbox.py: the KV inbox (TransferKV), where a reservation's KV arrives and is checked;
- relay.py: what a reservation's Generate stream relays: its tokens, heartbeats, or a failure;
- metrics.py: the worker's /metrics, and what each step and sequence records in them and in the trace.
"""
