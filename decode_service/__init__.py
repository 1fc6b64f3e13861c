"""Decode service: receives KV from prefill, continuous-batches decode, streams tokens to the gateway."""
