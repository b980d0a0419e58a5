"""The pytest-xdist scheduler of `bash tests/run.sh` (conftest.py, pytest_xdist_make_scheduler).

Most of the suite is bound by CPU; the groups named in WAITING are not: their jobs sleep
through Slurm's time-limit checks and a lost node's detection, ~40% of their worker's
time. With as many workers as cores, a worker that waits leaves a core idle. So one
worker more than the CPU-bound ones takes the waiting groups (and nothing else while the
others have work), and the CPU-bound workers never start one: each group keeps one
worker, as loadgroup does, and the queue's order (conftest.py, HEAD) stands within each
kind.
"""
from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

WAITING = ("slurm", "netns")


class WaitersApart(LoadGroupScheduling):
    """loadgroup, with the WAITING groups on the last worker."""

    def _waiter(self, node) -> bool:
        """The worker with the highest number (gwN) of two or more, decided at the first
        assignment, when all have started: a worker that ends leaves self.nodes, and the
        next highest must not become the waiter."""
        if not hasattr(self, "_waiter_id"):
            ids = sorted((n.workerinput["workerid"] for n in self.nodes), key=lambda w: int(w[2:]))
            self._waiter_id = ids[-1] if len(ids) > 1 else None
        return node.workerinput["workerid"] == self._waiter_id

    def _assign_work_unit(self, node) -> None:
        waiting = [s for s in self.workqueue if s in WAITING]
        if self._waiter(node):
            if not waiting:  # its groups are done: it ends rather than add a third CPU-bound worker
                node.shutdown()
                return
            scope = waiting[0]
        else:  # a CPU-bound worker whose kind has run out takes a waiting group rather than idle
            scope = next((s for s in self.workqueue if s not in WAITING), waiting[0] if waiting else None)
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)
