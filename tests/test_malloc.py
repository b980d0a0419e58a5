"""runtime.fix_mmap_threshold (opt-in, ZEROMPI_MALLOC=return): a freed large block goes
back to the OS even after glibc's dynamic threshold would have kept it in the heap."""
import os
import subprocess
import sys

import pytest

PROBE = r'''
import os
from zerompi import runtime
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
