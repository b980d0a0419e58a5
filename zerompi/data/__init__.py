"""Token data: datasets, the bundled corpus and deterministic sampling (tokens.py); the
checks a `--data` source passes before the first step and while training (check.py).

`zerompi.data.X` keeps every name it had when data was one module."""
from .tokens import (DEFAULT_MAX_BYTES, H5Tokens, TokenRange, Tokens, TokenSampler, cache_dir_path,
                     default_corpus, fingerprint, open_tokens, shard_range, split_tokens, write_tokens)

__all__ = ["DEFAULT_MAX_BYTES", "H5Tokens", "TokenRange", "Tokens", "TokenSampler", "cache_dir_path",
           "default_corpus", "fingerprint", "open_tokens", "shard_range", "split_tokens", "write_tokens"]
