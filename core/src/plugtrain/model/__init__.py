"""The model: a Llama-style transformer and its FSDP2 sharding."""

from plugtrain.exports import front_door

__getattr__, __dir__, __all__ = front_door(
    __name__,
    {
        "args": ["FLAVORS", "ModelArgs", "RopeScaling", "run_model_args"],
        "hf": [
            "from_hf",
            "hf_config",
            "model_args_from_hf",
            "parameter_shapes",
            "read_hf_config",
            "to_hf",
        ],
        "memory": ["Checkpointing", "MemoryEstimate", "estimate_memory"],
        "sharding": ["DTYPES", "build_model", "replica_sync", "reshard"],
        "decoding": ["TextTokenizer", "complete", "generate", "next_token"],
        "transformer": ["KVCache", "Transformer", "cross_entropy", "scale_rope_frequencies"],
    },
)
