"""Stage 3: parameters partitioned between uses.

    store.py        PartitionedParams: units gathered just in time, released after use
    units.py        which module subtrees are gathered together; a unit's run-time record
    agreement.py    the rounds in which ranks agree what to gather (returns decisions)
    gather_pool.py  the fixed slots gathered units borrow
    secondary.py    the secondary partition (hpZ): node-local copies for backward
"""
from .store import PartitionedParams

__all__ = ["PartitionedParams"]
