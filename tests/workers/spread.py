"""Test data for collectives: rank r's input of a case, magnitudes spread over 6 decades
so that summation order shows up in the last bits; and the rank-ordered sum."""
import torch


def data(case: int, r: int, n: int, dtype=torch.float32, base: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(base * case + r)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= 10.0 ** (6 * torch.rand(n, generator=g, dtype=torch.float64) - 3)
    return x.to(dtype)


def ordered_sum(xs):
    acc = xs[0].clone()
    for x in xs[1:]:
        acc.add_(x)
    return acc
