"""A new user's first hour (issue 16): which torch install.sh takes, the plot command
after install, progress output on a terminal and in a log, what a resumed run reports,
where sbatch logs go, --help, and world sizes that do not divide the batch."""
import os
import pty
import select
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env, run_mpi


# ---------------------------------------------------------------- install.sh

STUB_PY = """#!/usr/bin/env bash
# Stands in for python: logs pip calls, fails the ones aimed at the CPU index when told.
echo "$*" >> "$LOG"
case "$1 $2" in
  "-m pip") if [[ "$*" == *--index-url* && -n "$CPU_INDEX_DOWN" ]]; then exit 1; fi; exit 0;;
  "-c "*) [ -n "$HAVE_TORCH" ] && echo "$HAVE_TORCH" && exit 0; exit 1;;
  "- ") cat >/dev/null; echo "stub: torch report"; exit 0;;
esac
"""


def _install(tmp_path, gpu=False, **env):
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "python").write_text(STUB_PY)
    (stub / "python").chmod(0o755)
    if gpu:
        (stub / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: x)'\n")
        (stub / "nvidia-smi").chmod(0o755)
    log = tmp_path / "log"
    e = {"PATH": f"{stub}:/usr/bin:/bin", "LOG": str(log), "PYTHON": str(stub / "python"), **env}
    res = subprocess.run(["bash", str(ROOT / "install.sh")], capture_output=True, text=True, env=e, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout, log.read_text().splitlines()


def test_install_cpu_machine_takes_the_cpu_build(tmp_path):
    out, calls = _install(tmp_path)
    assert "no GPU found: installing the CPU build of torch==2.13.0" in out
    assert "--index-url https://download.pytorch.org/whl/cpu" in calls[1]
    assert calls[2] == "-m pip install -q -e .[mpich]"


def test_install_pypi_only_machine_falls_back_to_the_pinned_wheel_and_says_so(tmp_path):
    out, calls = _install(tmp_path, CPU_INDEX_DOWN="1")
    assert "cannot be reached: installing PyPI's torch==2.13.0 instead" in out
    assert calls[2] == "-m pip install -q torch==2.13.0"


def test_install_gpu_machine_takes_pypi_cuda_build(tmp_path):
    out, calls = _install(tmp_path, gpu=True)
    assert "the CUDA build" in out and calls[1] == "-m pip install -q torch==2.13.0"


def test_install_keeps_an_installed_torch_2_13(tmp_path):
    out, calls = _install(tmp_path, HAVE_TORCH="2.13.0+cpu")
    assert "torch 2.13.0+cpu is already installed; keeping it" in out
    assert not any("torch==" in c for c in calls)


def test_plot_needs_nothing_beyond_the_base_install():
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    reqs = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    assert any(r.startswith("matplotlib") for r in reqs), reqs


def test_plot_without_matplotlib_is_one_clear_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    code = ("import sys; sys.modules['matplotlib'] = None; from zerompi.plot import main; "
            f"sys.exit(main([{str(tmp_path)!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=mpi_env())
    assert res.returncode == 2 and "matplotlib is not installed" in res.stderr
    assert "Traceback" not in res.stderr


# ---------------------------------------------------------------- progress


def _under_pty(cmd, timeout=90):
    """Run cmd with stdout/stderr on a pseudo-terminal, as a user at a terminal would."""
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=mpi_env(),
                         start_new_session=True)
    os.close(slave)
    out = b""
    try:
        while True:
            r, _, _ = select.select([master], [], [], timeout)
            if not r:
                os.killpg(p.pid, 9)
                pytest.fail("timeout: " + out.decode(errors="replace")[-2000:])
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        p.wait()
    return p.returncode, out.decode(errors="replace")


def test_terminal_detection_sees_through_mpiexec():
    # one write(2) per rank (print may split it), so two ranks' lines cannot interleave
    probe = ["-c", "import os; from zerompi.trainer.progress import watching_terminal as w; "
                   "os.write(1, f'TTY {w()}\\n'.encode())"]
    rc, out = _under_pty([sys.executable] + probe)
    assert "TTY True" in out
    rc, out = _under_pty(["mpiexec", "-n", "2", sys.executable] + probe)
    assert out.count("TTY True") == 2, out
    res = run_mpi(2, probe, module=False, timeout=60)  # a pipe to this test: not a person
    assert res.stdout.count("TTY False") == 2, res.stdout


FAST = ["--model.preset", "tiny", "--global_batch", "8", "--eval_interval", "0", "--threads", "1",
        "--checkpoint_interval", "0", "--log_interval", "25"]


def test_bar_on_a_terminal_lines_in_a_log(tmp_path, corpus):
    args = ["-m", "zerompi.train", "--data", corpus, "--max_steps", "30"] + FAST
    rc, out = _under_pty(["mpiexec", "-n", "2", sys.executable] + args + ["--run_dir", str(tmp_path / "a")])
    assert rc == 0, out
    assert "30/30 [" in out and "step/s" in out and "tok/s" in out, out  # tqdm bar: rate, ETA
    assert "step 1/30" not in out
    res = run_mpi(2, args + ["--run_dir", str(tmp_path / "b")], module=False, timeout=90)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/30", "25/30", "30/30"], res.stdout
    assert all(" eta " in ln and " tok/s " in ln for ln in lines)


def test_done_line_after_a_resume_says_what_it_timed(tmp_path, corpus):
    args = ["-m", "zerompi.train", "--data", corpus, "--progress", "lines", "--run_dir", str(tmp_path)] + FAST
    first = run_mpi(2, args + ["--max_steps", "10"], module=False, timeout=90)
    assert "done, 10 steps in " in first.stdout
    again = run_mpi(2, args + ["--max_steps", "15"], module=False, timeout=90)
    assert "done, 15 steps: resumed at step 10, ran 5 steps in " in again.stdout, again.stdout
    assert "step 11/15" in again.stdout  # the first step of this run is printed


# ---------------------------------------------------------------- repository hygiene


def test_sbatch_logs_are_ignored_and_not_in_the_repo_root():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    for log in ("slurm-1234.out", "slurm-train-1234.log", "logs/zerompi-1234.log"):
        assert subprocess.run(["git", "check-ignore", "-q", log], cwd=ROOT).returncode == 0, log
    assert (ROOT / "logs" / ".gitignore").exists()  # Slurm does not create the folder
    for f in (ROOT / "slurm").glob("*.sbatch"):
        text = f.read_text()
        assert "#SBATCH --output=logs/" in text, f.name


# ---------------------------------------------------------------- --help and uneven batches


def test_help_shows_the_batch_shell_signal_the_templates_use():
    res = subprocess.run([sys.executable, "-m", "zerompi.train", "--help"], capture_output=True, text=True,
                         env=mpi_env(), timeout=60)
    assert res.returncode == 0
    assert "--signal=B:USR1@120" in res.stdout and "--signal=USR1" not in res.stdout
    for f in (ROOT / "slurm").glob("*.sbatch"):
        assert "#SBATCH --signal=B:USR1@" in f.read_text(), f.name


def test_batch_note():
    from zerompi.trainer.progress import batch_note

    assert batch_note(8, 2, 2) is None and batch_note(12, 1, 3) is None
    assert "(2 to 3 rows per rank" in batch_note(8, 1, 3) and "multiple of 3" in batch_note(8, 1, 3)
    assert "rank(s) 2 get no rows" in batch_note(2, 1, 3)
    assert "rank(s) 1 get no rows" in batch_note(3, 2, 2)  # micro-step 1 has one row


def test_three_ranks_and_a_batch_of_eight_say_so(tmp_path, corpus):
    res = run_mpi(3, ["-m", "zerompi.train", "--data", corpus, "--max_steps", "2", "--progress", "lines",
                      "--run_dir", str(tmp_path)] + FAST, module=False, timeout=90)
    assert res.stdout.count("does not split evenly over 3 data-parallel ranks") == 1, res.stdout
