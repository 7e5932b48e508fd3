"""The mixture-of-experts family's parts (Qwen3-MoE layout)."""
