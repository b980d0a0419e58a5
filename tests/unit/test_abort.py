"""The abort hook's wait for its stderr reader (zerompi/runtime/abort.py), in one process;
whole jobs that abort: tests/system/test_failure.py."""


def test_abort_hook_waits_until_its_stderr_pipe_is_read():
    """The mechanism behind test_failing_rank_traceback_always_reaches_stderr
    (tests/system/test_failure.py), deterministic: _drain returns only once the reader
    has taken the bytes (or at its deadline)."""
    import os
    import time

    from zerompi.runtime.abort import _drain

    r, w = os.pipe()
    try:
        os.write(w, b"traceback")
        t0 = time.monotonic()
        _drain(w, 0.3)  # nobody reads: waits out the deadline
        assert time.monotonic() - t0 >= 0.3
        os.read(r, 100)
        t0 = time.monotonic()
        _drain(w, 5.0)  # read: returns at once
        assert time.monotonic() - t0 < 0.5
    finally:
        os.close(r)
        os.close(w)
