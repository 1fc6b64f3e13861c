"""The KV wire codec: how a prompt's KV cache travels from a prefill worker to a decode worker."""
