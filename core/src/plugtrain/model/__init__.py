"""The model: a Llama-style transformer and its FSDP2 sharding."""
