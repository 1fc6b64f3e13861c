"""Benchmarks: `pdserve bench kv` (the KV handoff against its ceilings)."""
