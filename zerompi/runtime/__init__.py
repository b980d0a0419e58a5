"""What a job needs around the training itself: MPI start-up and whole-job abort
(abort.py), the deadline on MPI_Init and the launch-mismatch check (startup.py),
cross-rank agreement (agree.py), glibc heap helpers (malloc.py), deadlines on
collective waits and stop signals (watchdog.py), the run directory's lock (rundir.py),
atomic file writes (fileio.py), the collector after start-up (pygc.py), running a job on
this machine and ending it cleanly (jobs.py: the tests' and benchmarks' launcher;
imported on its own, not here).

`zerompi.runtime.X` keeps every name it had when runtime was one module."""
from .abort import (JobError, abort, exit_together, init, install_abort_hook, mpi, one_line_job_errors,
                    seed_everything)
from .agree import (agree, as_items, check_same_everywhere, first_difference, merged, raise_agreed, raise_found,
                    same_everywhere)
from .malloc import MMAP_THRESHOLD, HeapTrimmer, fix_mmap_threshold, release_free_memory
from .pygc import freeze_startup_heap, pause_collector
from . import startup

__all__ = ["JobError", "abort", "exit_together", "init", "install_abort_hook", "mpi", "one_line_job_errors",
           "seed_everything", "agree", "as_items", "check_same_everywhere", "first_difference", "merged",
           "raise_agreed", "raise_found", "same_everywhere", "MMAP_THRESHOLD", "HeapTrimmer", "fix_mmap_threshold",
           "release_free_memory", "freeze_startup_heap", "pause_collector", "startup"]
