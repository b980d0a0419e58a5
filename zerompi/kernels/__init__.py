"""CUDA kernels for the partitioned optimizer, compiled at run time by CuPy (NVRTC).

Importing this package needs only numpy; CuPy is imported when a kernel is launched.
GPU entry points take cupy arrays (bf16 as uint16/int16 bit patterns) and launch on
CuPy's current stream. Each has a numpy reference computing the same fp32 arithmetic.
"""
from .adamw import adamw_reference, adamw_scalars, adamw_step
from .adamw_table import (adamw_table_reference, adamw_table_step, build_table,
                          grad_stats_table, grad_stats_table_reference)
from .cast import (bf16_bits_to_float32, cast_into, cast_reference, float32_to_bf16_bits,
                   float32_to_fp16_bits, fp16_bits_to_float32, scaled_copy,
                   scaled_copy_reference)
from .grad_stats import compute_grad_stats, grad_stats_reference

__all__ = [
    "adamw_reference", "adamw_scalars", "adamw_step",
    "adamw_table_reference", "adamw_table_step", "build_table", "grad_stats_table",
    "grad_stats_table_reference",
    "bf16_bits_to_float32", "cast_into", "cast_reference", "float32_to_bf16_bits",
    "float32_to_fp16_bits", "fp16_bits_to_float32", "scaled_copy", "scaled_copy_reference",
    "compute_grad_stats", "grad_stats_reference",
]
