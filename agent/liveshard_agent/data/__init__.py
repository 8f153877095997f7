"""Tokenized training data: text inputs tokenized once into memory-mapped token files, and the
reader the trainer samples from.

`sources` reads documents from the inputs (jsonl, parquet, plain text, folders); `tokens` owns the
on-disk format and its reader (`TokenStream`); `order` maps global sample indices to windows of
the stream (sequential or a keyed permutation per epoch); `prepare` tokenizes inputs into a
prepared directory (the `liveshard-data prepare` command, and a cache beside the inputs);
`builtin` makes the built-in tiny model directory and its tokenized corpus, since nothing can be
downloaded. This package must not import torch (only `builtin` reaches the torch-importing
built-in corpus, lazily), so preparing data needs no GPU stack.
"""
