"""Data: the tokenizer, and the pipeline from documents to training batches."""
