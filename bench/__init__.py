"""Benchmarks: `pdserve bench kv` (the KV handoff against its ceilings), `pdserve bench decode` (the decode step
against its memory-bandwidth floor), `pdserve bench scenarios` (six workloads, colocated against
disaggregated)."""
