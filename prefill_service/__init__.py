"""Prefill service: runs the prompt's forward pass, samples the first token, streams the KV to decode.

- server.py: the gRPC edge (Prefill, GetInfo) and the life of a request here;
- validation.py: what a PrefillRequest must pass before the engine takes it;
- lease.py: renewing the decode reservation's lease while the prompt waits in the queue;
- kv_push.py: the KV stream to the decode worker, over one channel per decode address;
- metrics.py: the worker's /metrics, and what each prompt records in them and in the trace.
"""
