"""Data: the tokenizer, and the pipeline from documents to training batches."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.data.cache import cache_root as cache_root
    from plugtrain.data.cache import open_token_store as open_token_store
    from plugtrain.data.chat import DEFAULT_CHAT_TEMPLATE as DEFAULT_CHAT_TEMPLATE
    from plugtrain.data.chat import ChatEncoder as ChatEncoder
    from plugtrain.data.chat import ChatOptions as ChatOptions
    from plugtrain.data.chat import ChatTemplate as ChatTemplate
    from plugtrain.data.chat import fitting_seq_len as fitting_seq_len
    from plugtrain.data.examples import DocumentStream as DocumentStream
    from plugtrain.data.examples import Example as Example
    from plugtrain.data.examples import document_examples as document_examples
    from plugtrain.data.examples import read_head as read_head
    from plugtrain.data.examples import row_examples as row_examples
    from plugtrain.data.mixture import MixtureDataset as MixtureDataset
    from plugtrain.data.pipeline import IGNORE_INDEX as IGNORE_INDEX
    from plugtrain.data.pipeline import MicroBatch as MicroBatch
    from plugtrain.data.pipeline import PackedDataset as PackedDataset
    from plugtrain.data.pipeline import StatefulBatchLoader as StatefulBatchLoader
    from plugtrain.data.pipeline import count_eval_batches as count_eval_batches
    from plugtrain.data.pipeline import document_positions as document_positions
    from plugtrain.data.pipeline import iter_eval_batches as iter_eval_batches
    from plugtrain.data.prefetch import DevicePrefetcher as DevicePrefetcher
    from plugtrain.data.prepare import SHARD_TOKENS as SHARD_TOKENS
    from plugtrain.data.skips import Rewind as Rewind
    from plugtrain.data.skips import SkippingLoader as SkippingLoader
    from plugtrain.data.skips import SkipRange as SkipRange
    from plugtrain.data.skips import read_skip_file as read_skip_file
    from plugtrain.data.skips import write_skip_file as write_skip_file
    from plugtrain.data.sources import iter_documents as iter_documents
    from plugtrain.data.store import TokenStore as TokenStore
    from plugtrain.data.store import file_sha256 as file_sha256
    from plugtrain.data.tokenizer import BOS_TOKEN as BOS_TOKEN
    from plugtrain.data.tokenizer import EOS_TOKEN as EOS_TOKEN
    from plugtrain.data.tokenizer import Tokenizer as Tokenizer
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
