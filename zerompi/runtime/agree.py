"""Cross-rank agreement: the one way ranks agree on failures (agree, raise_agreed) and
check that what they must share is the same everywhere (configs, model shapes, data)."""
from __future__ import annotations

from typing import Any

from .watchdog import waiting


def agree(comm, errors=None) -> list[tuple[int, str, str]]:
    """The one way ranks agree on failures. Collective: every rank passes what went wrong
    on it (None, one exception or message, or a list of them); every rank gets back the
    same list of (rank, exception class name, message), in rank order, duplicates
    dropped. A rank that failed alone therefore never leaves the others waiting in a
    collective it will not join: all of them see the failure at the same point."""
    mine = as_items(errors)
    return merged(comm.allgather_object(mine) if comm.size > 1 else [mine])


def as_items(errors) -> list[tuple[str, str]]:
    """A rank's failures as agree() exchanges them: [(exception class name, message)]."""
    if errors is None:
        errors = []
    elif isinstance(errors, (str, BaseException)):
        errors = [errors]
    return [(type(e).__name__ if isinstance(e, BaseException) else "", str(e)) for e in errors]


def merged(everyone: list) -> list[tuple[int, str, str]]:
    """agree()'s result from every rank's as_items, gathered by the caller (who may send
    them along with other things in one collective)."""
    out, seen = [], set()
    for r, items in enumerate(everyone):
        for cls, msg in items:
            if msg not in seen:
                seen.add(msg)
                out.append((r, cls, msg))
    return out


def raise_agreed(comm, errors=None, context: str = "", exc_type: type = ValueError,
                 keep_types=(TypeError, ValueError), limit: int = 8) -> None:
    """agree(), then raise on every rank if any rank failed: "context: rank R: message"
    (no rank prefix in a 1-rank job), or "context: K problems:" and one such line per
    distinct message (at most `limit`). The exception keeps the failures' own class
    when they all share one of `keep_types` (bad arguments stay TypeError/ValueError);
    otherwise it is exc_type."""
    raise_found(agree(comm, errors), comm.size, context, exc_type, keep_types, limit)


def raise_found(found: list, size: int, context: str = "", exc_type: type = ValueError,
                keep_types=(TypeError, ValueError), limit: int = 8) -> None:
    """raise_agreed once agree()'s (or merged()'s) result is known."""
    if not found:
        return
    classes = {cls for _, cls, _ in found}
    cls = next((t for t in keep_types if classes == {t.__name__}), exc_type)
    lines = [msg if size == 1 else f"rank {r}: {msg}" for r, _, msg in found]
    head = f"{context}: " if context else ""
    if len(lines) == 1:
        raise cls(head + lines[0])
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    raise cls("\n  ".join([f"{head}{len(lines)} problems:"] + lines[:limit]) + more)


def first_difference(a: Any, b: Any, key: str = "") -> tuple[str, Any, Any] | None:
    """(dotted key, a's value, b's value) of the first place where two nested
    dicts/lists differ, or None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = first_difference(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{key}.{k}" if key else str(k))
            if d:
                return d
        return None
    return None if a == b else (key or "value", a, b)


def same_everywhere(comm, value: Any, what: str) -> list[str]:
    """Collective: one message per rank whose `value` (any picklable, e.g. a config dict,
    a data fingerprint, a count) differs from rank 0's, naming the dotted key and both
    values; the same list on every rank. The one check of things ranks must share."""
    everyone = comm.allgather_object(value) if comm.size > 1 else [value]
    out = []
    for r, v in enumerate(everyone[1:], start=1):
        d = first_difference(v, everyone[0])
        if d:
            k, mine, ref = d
            out.append(f"rank {r} has a different {what} than rank 0: {k} = {mine!r} (rank 0: {ref!r})")
    return out


def check_same_everywhere(comm, config: dict, shapes: list) -> None:
    """Ranks with different configs or models would issue mismatched collectives (a hang
    or garbage): compare once at set-up (one pickled allgather) and raise on every rank,
    naming the first differing rank, key and values, or parameter."""
    problems = same_everywhere(comm, {"config": config, "model": [list(s) for s in shapes]}, "setup")
    if problems:
        msg = problems[0].replace("different setup", "different config", 1).replace(": config.", ": ", 1)
        if ": model" in msg:
            everyone = comm.allgather_object(shapes)
            r = int(msg.split()[1])
            pad = [None] * (abs(len(everyone[r]) - len(everyone[0])) + 1)
            mine, ref = next((x, y) for x, y in zip(everyone[r] + pad, everyone[0] + pad) if x != y)
            msg = f"rank {r} has a different model than rank 0: parameter {mine} vs {ref}"
        raise ValueError(msg)


class ObjectCollectives:
    """The set-up collectives of pickled objects over `self.comm` (an mpi4py communicator),
    each under the watchdog's deadline; for set-up only, never in the training step.
    comm/mpi.py's MPICommunicator has them from here."""

    comm: Any

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        with waiting("bcast_object"):
            return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj: Any) -> list:
        with waiting("allgather_object"):
            return self.comm.allgather(obj)


class ObjectComm(ObjectCollectives):
    """A bare mpi4py communicator seen as agree() sees a zerompi Communicator (rank, size,
    the object collectives): what `python -m zerompi.train` agrees on before it imports
    torch, which comm/ needs."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
