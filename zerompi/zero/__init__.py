"""ZeRO data parallelism: shard math (partition.py), flat buffers (flat.py), the shard
state and its placement (state.py), parameter stores (params.py, partitioned.py),
gradient reduction (grads.py), the engine composing them (engine.py), partitioned
construction (init_context.py) and checkpoint state export (state_io.py)."""
