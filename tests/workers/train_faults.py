"""`python -m zerompi.train` with faults patched in, for the exits of asynchronous saves
(tests/system/test_checkpoint_async_train.py). Environment:
  ZEROMPI_TEST_SLOW_WRITE=s   each background rank-file write starts s seconds late, so a
                              save stays in flight for several steps
  ZEROMPI_TEST_RAISE_AT=R:S   rank R raises RuntimeError in engine.step() once S optimizer
                              steps are done (an exception on one rank)
"""
from zerompi.runtime import pause_collector; pause_collector()  # until freeze_startup_heap: runtime/pygc.py
import os
import sys
import time

import zerompi.train
from zerompi.checkpoint.background import writers as background
from zerompi.zero.engine import ZeroEngine
import zerompi.runtime
zerompi.runtime.freeze_startup_heap()  # as zerompi.train does (runtime/pygc.py)

slow = float(os.environ.get("ZEROMPI_TEST_SLOW_WRITE", "0"))
if slow:  # in the rank, before the file is handed to the writer (helper process or thread)
    for cls in (background.ProcessWriter, background.ThreadWriter):
        cls.write = lambda self, *a, _w=cls.write: (time.sleep(slow), _w(self, *a))[1]
if os.environ.get("ZEROMPI_TEST_RAISE_AT"):
    rank, at = (int(x) for x in os.environ["ZEROMPI_TEST_RAISE_AT"].split(":"))
    step = ZeroEngine.step

    def failing(self):
        if self.dims.world.rank == rank and self.global_steps == at:
            raise RuntimeError(f"test fault on rank {rank} after step {at}")
        return step(self)
    ZeroEngine.step = failing

sys.exit(zerompi.train.main())
