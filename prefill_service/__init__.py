"""Prefill service: runs the prompt's forward pass, samples the first token, streams the KV to decode."""
