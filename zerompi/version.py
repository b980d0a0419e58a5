"""The package version (setup.py reads it from here; checkpoints record it)."""
__version__ = "0.1.0"
