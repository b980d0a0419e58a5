"""A DeepSpeed config using every key zerompi maps (tests/unit/test_ds_config.py,
tests/system/test_train_deepspeed.py)."""

DS = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-7,
                                              "weight_decay": 0.1, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e5, "allgather_bucket_size": 5e8,
                          "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e4,
                          "stage3_max_live_parameters": 1e9, "offload_optimizer": {"device": "none"}},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
}
