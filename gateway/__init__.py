"""Gateway: the asyncio front door that drives prefill and decode for each client stream."""
