"""Small documents, their JSONL and Parquet files, and a BPE tokenizer trained on them in
the test (no download): the inputs of `python -m zerompi.prepare` in the tests."""
import json
import random

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about "
         "rivers mountains data shards tokens epochs and windows").split()


def documents(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + "." for _ in range(n)]


def write_jsonl(path, docs, field="text"):
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return path


def write_parquet(path, docs, field="text", row_group_size=50):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=row_group_size)
    return path


def train_tokenizer(path, vocab_size=300):
    """A byte-level BPE (GPT-2's kind) with <|endoftext|>, saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(200, seed=99), trainer)
    tok.save(str(path))
    return path
