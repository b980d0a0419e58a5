"""Floating buffers in bf16/fp16 runs follow DeepSpeed (>= 0.19.2): they keep their dtype
unless zero.buffer_dtype (DeepSpeed: data_types.buffer_dtype) says fp32 or the
parameters' dtype; frozen parameters are cast with the trained ones."""
import pytest
import torch

import zerompi
from zerompi.config import ConfigError, load


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("inv_freq", torch.rand(2, dtype=torch.float64))  # not fp32: kept as is

    def forward(self, x):
        return self.bn(self.lin(x).float()).sum() + self.frozen(x).float().sum()


@pytest.mark.parametrize("setting,want", [(None, {"bn": torch.float32, "inv": torch.float64}),
                                          ("fp32", {"bn": torch.float32, "inv": torch.float32}),
                                          ("param", {"bn": torch.bfloat16, "inv": torch.bfloat16})])
def test_buffers_keep_their_dtype_unless_told(setting, want):
    cfg = {"stage": 2, "precision": "bf16", **({} if setting is None else {"buffer_dtype": setting})}
    m = Net()
    zerompi.initialize(m, cfg)
    assert m.bn.running_mean.dtype == want["bn"] and m.inv_freq.dtype == want["inv"]
    assert m.frozen.weight.dtype == torch.bfloat16 and m.lin.weight.dtype == torch.bfloat16
    assert m.bn.num_batches_tracked.dtype == torch.int64


def test_deepspeed_buffer_dtype_is_accepted():
    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    assert load(base, dp_size=1).buffer_dtype == "keep"
    assert load(dict(base, data_types={"buffer_dtype": "fp32"}), dp_size=1).buffer_dtype == "fp32"
    assert load(dict(base, data_types={"buffer_dtype": "bf16"}), dp_size=1).buffer_dtype == "param"
    with pytest.raises(ConfigError, match="data_types.buffer_dtype"):
        load(dict(base, data_types={"buffer_dtype": "fp16"}), dp_size=1)
