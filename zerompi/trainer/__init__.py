"""The run behind `python -m zerompi.train` (zerompi/train.py stays the thin command that
parses, checks and agrees the config before torch is imported):

    config.py       TrainConfig: the typed, frozen settings (`--help` lists them)
    preflight.py    before torch: the data, the resume's architecture; then the run directory's lock
    loop.py         the process grid, model, engine, resume, and the training loop
    schedule.py     the learning-rate schedules (the trainer's cosine, DeepSpeed's)
    progress.py     rank 0's console and metrics.jsonl
    checkpoints.py  when the run saves, what each save records, what a resume compares

Importing this package imports nothing heavy: loop.py imports torch, and only train.py's
late import of it does.
"""
