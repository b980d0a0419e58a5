"""Reference models. They know nothing about ZeRO."""
