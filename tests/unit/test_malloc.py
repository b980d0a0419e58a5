"""runtime.fix_mmap_threshold (opt-in, ZEROMPI_MALLOC=return): a freed large block goes
back to the OS even after glibc's dynamic threshold would have kept it in the heap."""
import os
import subprocess
import sys

import pytest

PROBE = r'''
import os
from zerompi.runtime import malloc as runtime
runtime.fix_mmap_threshold()
import torch
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
a = torch.ones(4 << 20); del a          # 16 MiB, mmapped and freed: glibc raises its threshold
base = rss()
b = torch.ones(2 << 20)                 # 8 MiB: from the heap by default, mmapped when pinned
pin = torch.ones(16)                    # a small block allocated after it
del b
print(runtime._mmap_fixed, (rss() - base) >> 20)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_pinned_threshold_returns_freed_blocks_default_keeps_them():
    out = {}
    for mode in ("default", "return"):
        env = dict(os.environ, ZEROMPI_MALLOC=mode)
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        fixed, kept_mib = p.stdout.split()
        out[mode] = (fixed == "True", int(kept_mib))
    assert out["default"][0] is False and out["default"][1] >= 6, out  # the 8 MiB stayed resident
    assert out["return"][0] is True and out["return"][1] <= 1, out    # returned to the OS


TRIM_PROBE = r'''
import os, sys
import torch
from zerompi import runtime
from zerompi.device import Placement
from zerompi.runtime.malloc import HeapTrimmer
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
a = torch.ones(4 << 20); del a            # 16 MiB, mmapped and freed: glibc raises its threshold
base = rss()
big, pins = [], []
for _ in range(6):                        # a unit's transients: 4 MiB blocks from the heap, each
    big.append(torch.ones(1 << 20))       # followed by a small long-lived one (heap never shrinks)
    pins.append(torch.ones(16))
del big
kept = rss() - base
trim = HeapTrimmer(Placement.of(sys.argv[1]), every=16 << 20)
trim.released(8 << 20)                    # below `every`: nothing yet
half = rss() - base
trim.released(8 << 20)                    # 16 MiB released in all: trimmed
print(kept >> 20, half >> 20, (rss() - base) >> 20)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_heap_trimmer_returns_freed_transients_every_n_bytes():
    """runtime.malloc.HeapTrimmer (stage 3 calls it as units finish backward): freed heap blocks
    that glibc keeps resident go back to the OS once `every` bytes were released."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "ZEROMPI_MALLOC"}
    p = subprocess.run([sys.executable, "-c", TRIM_PROBE, "cpu"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    kept, half, after = map(int, p.stdout.split())
    assert kept >= 20 and half >= 20, (kept, half, after)  # 24 MiB freed but resident
    assert after <= 2, (kept, half, after)                 # returned to the OS


def test_heap_trimmer_is_off_for_gpu_placements(monkeypatch):
    from zerompi.device import Placement
    from zerompi.runtime import malloc
    from zerompi.runtime.malloc import HeapTrimmer

    calls = []
    monkeypatch.setattr(malloc, "release_free_memory", lambda: calls.append(1))
    gpu = HeapTrimmer(Placement.of("cuda:0"), every=1)
    gpu.released(1 << 30)
    host = HeapTrimmer(Placement.of("cpu"), every=10)
    for n in (4, 5, 1, 30, 3):
        host.released(n)
    assert calls == [1, 1], calls  # at 10 and at 40 bytes; never for the GPU placement
