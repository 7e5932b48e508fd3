"""Data: the tokenizer, and the pipeline from documents to training batches."""

from plugtrain.exports import front_door

__getattr__, __dir__, __all__ = front_door(
    __name__,
    {
        "cache": ["open_token_store"],
        "mixture": ["MixtureDataset"],
        "pipeline": [
            "MicroBatch",
            "PackedDataset",
            "StatefulBatchLoader",
            "count_eval_batches",
            "iter_eval_batches",
        ],
        "prefetch": ["DevicePrefetcher"],
        "prepare": ["SHARD_TOKENS"],
        "skips": ["SkippingLoader", "read_skip_file", "write_skip_file"],
        "sources": ["iter_documents"],
        "tokenizer": ["BOS_TOKEN", "EOS_TOKEN", "Tokenizer"],
    },
)
