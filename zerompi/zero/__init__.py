"""ZeRO data parallelism: shard math (partition.py), flat buffers (flat.py), the shard
state and its placement (state.py), parameter stores (params.py, stage3/),
gradient reduction (grads.py), the engine composing them (engine.py), partitioned
construction (init_context.py) and checkpoint state export (state_io.py)."""
