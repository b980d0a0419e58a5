"""DeepSpeed JSON read as DeepSpeed means it (docs/migrating-from-deepspeed.md):

    translation.py  the translation onto ZeroConfig (and the trainer's keys)
    keys.py         the one table: every key mapped, ignored or refused, with DeepSpeed's
                    default (`python -m zerompi.config.deepspeed.keys` prints it as markdown)
    values.py       values read through that table ("auto", defaults, types)
    zero.py         zero_optimization and its neighbours onto ZeroConfig
    optim.py        SGD / Adagrad optimizer blocks
    schedules.py    the scheduler blocks' parameters and defaults
    report.py       the start-up lines that say what was read and how
"""
__all__ = ["DeepSpeedConfigWarning", "Run", "Translation", "looks_like_deepspeed", "ranks", "translate"]


def __getattr__(name: str):
    # translation.py's names, imported on first use: `python -m zerompi.config.deepspeed.keys`
    # then runs keys.py without having imported it through the package first
    if name in __all__:
        import importlib

        return getattr(importlib.import_module(__name__ + ".translation"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
