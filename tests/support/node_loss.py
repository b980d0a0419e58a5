"""One node lost under a running job on the simulated 2-node Slurm bed (netcluster.py,
netslurm.py), and what must hold afterwards (tests/system/test_multinode_loss.py and its
soak, tests/system/test_node_loss_soak.py).

Faults, applied to node 2 (ranks 2-3) once the run has trained past a checkpoint:
  kill         every process of the node SIGKILLed, its link up (the kernel answers
               for the dead sockets: the survivors' connections are reset). The
               launcher sees its proxy's connection reset and ends the job at once,
               before any deadline, in words that name no node (hydra: "control_cb
               ... assert (!closed) failed"); the batch script's line names it
               (slurm/_requeue.sh, zerompi_silent_nodes)
  link-down    its link cut, every process left running (a failed cable or switch port)
  power        link cut, then every process killed (a node losing power)
  async-write  power, while a background checkpoint write (checkpoint.async_save, each
               rank file's write slowed) is in flight
`lose_node` returns the list of what went wrong (empty: it held), with the numbers seen.
Each run builds its own cluster and tears it down (namespaces, processes by PID).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

from multinode_jobs import REPO, SITE_ENV, metrics, write_config
from slurm_jobs import PY, _read

TEMPLATE = REPO / "slurm" / "multinode-ib.sbatch"
FAULTS = ("kill", "link-down", "power", "async-write")
CKPT = 3          # checkpoint_interval
SLOW_WRITE_S = 6  # async-write: each rank file's background write starts this late
RANK_MARKS = ("zerompi.train", "train_faults.py")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def job_processes(net, node: str | None = None, ranks_only: bool = False) -> dict[int, str]:
    """{pid: command line} of the job's processes in the cluster (or one node): every
    process there but the Slurm daemons, or (ranks_only) the training ranks only."""
    out = {}
    for pid in net.pids(node):
        cmd = _cmdline(pid)
        if not cmd or not _alive(pid) or re.search(r"(^|/)(slurmd|munged)\b", cmd.split(" ")[0]):
            continue
        if cmd.startswith(("nsenter", "unshare")) or "netcluster.py exec" in cmd and "slurmd" in cmd:
            continue  # the wrappers slurmd runs under
        if ranks_only and not any(m in cmd for m in RANK_MARKS):
            continue
        out[pid] = cmd
    return out


def _wrapper(tmp: Path) -> Path:
    """A PYTHON for the template that runs tests/workers/train_faults.py (slowed writes)
    where the template says `$PYTHON -m zerompi.train`."""
    w = tmp / "python-faults"
    w.write_text(f"#!/bin/sh\nexport PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                 f"[ \"$1 $2\" = \"-m zerompi.train\" ] && shift 2 && "
                 f"exec {PY} {REPO / 'tests' / 'workers' / 'train_faults.py'} \"$@\"\nexec {PY} \"$@\"\n")
    w.chmod(0o755)
    return w


def lose_node(fault: str, timeout_s: int, tmp: Path) -> tuple[list[str], dict]:
    """Run the job on 2 nodes x 2 ranks, apply `fault` to node 2, check the ending and
    resume on node 1. Returns (problems, facts)."""
    from netcluster import NetCluster
    from netslurm import NetSlurm

    assert fault in FAULTS, fault
    tmp.mkdir(parents=True, exist_ok=True)
    facts: dict = {"fault": fault, "timeout_s": timeout_s}
    # Slurm must not end the job "due to node failure" before the watchdog has spoken.
    with NetCluster(nodes=2, rate_mbit=None) as net, NetSlurm(net, slurmd_timeout=timeout_s + 40) as slurm:
        problems = _run(net, slurm, fault, timeout_s, tmp, facts)
        left = job_processes(net)
        if fault == "link-down":  # the cut-off node keeps Slurm's step daemon until it is back
            facts["left_on_cut_node"] = sorted(c for c in left.values() if c.startswith("slurmstepd"))
            left = {p: c for p, c in left.items() if not c.startswith("slurmstepd")}
        if left:
            problems.append(f"left running at the end: {left}")
    return problems, facts


def _run(net, slurm, fault, timeout_s, tmp, facts) -> list[str]:
    keep, lost = net.nodes
    settings = {"top": f"checkpoint_interval = {CKPT}\nlog_interval = 1\n",
                "zero": f"comm = {{ timeout_s = {timeout_s} }}\n"}
    cfg = write_config(tmp / "fast.toml", max_steps=1_000_000, **settings)
    run_dir, log = tmp / "run", tmp / "job.log"
    env = {**SITE_ENV, "CONFIG": str(cfg), "RUN_DIR": str(run_dir)}
    args = []
    if fault == "async-write":
        env.update(PYTHON=str(_wrapper(tmp)), ZEROMPI_TEST_SLOW_WRITE=str(SLOW_WRITE_S))
        args = ["--checkpoint.async_save", "true"]
    job = slurm.sbatch(TEMPLATE, *args, cwd=REPO, env=env,
                       options=["--nodes=2", "--ntasks-per-node=2", f"--output={log}"])
    why = lambda: f"\n--- job log:\n{_read(log)[-4000:]}"  # noqa: E731
    latest = run_dir / "checkpoints" / "latest"

    def published() -> int:
        t = _read(latest).strip()
        return int(t.split("_")[-1]) if t.startswith("step_") else 0

    # Past a published checkpoint; async-write: while the next save's write is in flight
    # (its step is done, `latest` still names the one before).
    t0 = time.monotonic()
    while True:
        steps, k = len(metrics(run_dir)), published()
        if k >= CKPT and (fault != "async-write" or (steps > k + CKPT and published() == k)):
            break
        if slurm.state(job) not in ("PENDING", "CONFIGURING", "RUNNING") or time.monotonic() - t0 > 240:
            return [f"the job did not reach its fault point (state {slurm.state(job)}, {steps} steps, "
                    f"latest {k})" + why()]
        time.sleep(0.05)
    before, k_before = metrics(run_dir), published()
    if fault in ("link-down", "power", "async-write"):
        net.link_down(lost)
    if fault != "link-down":
        net.kill_node(lost)
    t_lost = time.monotonic()
    facts["at_step"] = len(before)
    problems = []

    line = None
    limit = timeout_s + 30
    # kill: the batch script's line; otherwise the survivors' watchdog
    said = r"^\[.*\] job \d+ restart 0: the launcher ended the job.*$" if fault == "kill" else \
        r"^\[rank [01]\] zerompi watchdog: .*$"
    while line is None and time.monotonic() - t_lost < limit:
        m = re.search(said, _read(log), re.M)
        line = m and m.group(0)
        time.sleep(0.1)
    facts["line_s"] = round(time.monotonic() - t_lost, 1)
    if not line:
        problems.append(f"no line naming the lost node within {limit} s")
    else:
        facts["line"] = line
        named = f"lost: node {lost} (1 of 2 did not" if fault == "kill" else \
            f"ranks 2-3 (all of node {lost}) did not answer"
        if named not in line:
            problems.append(f"the line does not name node {lost} as lost: {line}")
    while job_processes(net, ranks_only=True) and time.monotonic() - t_lost < limit:
        time.sleep(0.2)
    facts["ranks_gone_s"] = round(time.monotonic() - t_lost, 1)
    ranks = job_processes(net, ranks_only=True)
    if ranks:
        problems.append(f"ranks still running {limit} s after the loss: {ranks}")
    text = _read(log)
    for bad in ("Segmentation fault", "Caught signal", "Fatal Python error", "Traceback"):
        if bad in text:
            problems.append(f"{bad!r} in the job log")
    facts["watchdog_lines"] = len(re.findall(r"zerompi watchdog:", text))

    # Cancelled (the template would wait for Slurm's verdict on the node, then requeue:
    # test_multinode_loss.py's first test follows that path). The job stays COMPLETING on
    # the lost node until Slurm declares it down; node 1 is free at once.
    slurm.run(["scancel", str(job)], check=False)
    t_end = time.monotonic() + 20
    while slurm.state(job) in ("RUNNING", "CONFIGURING", "PENDING") and time.monotonic() < t_end:
        time.sleep(0.3)
    while job_processes(net, keep) and time.monotonic() < t_end:
        time.sleep(0.2)
    left = job_processes(net, keep)
    if left:
        problems.append(f"left running on {keep} after the job ended: {left}")
    if problems:
        return problems + [why()]

    # Resume on the node that remains, with the same run directory.
    k = published()
    facts["resumed_at"] = k
    if fault == "async-write" and k != k_before:
        problems.append(f"the save in flight at the loss was published (latest {k_before} -> {k})")
    write_config(cfg, max_steps=k + 3, **settings)
    job = slurm.sbatch(TEMPLATE, cwd=REPO, env={**SITE_ENV, "CONFIG": str(cfg), "RUN_DIR": str(run_dir)},
                       options=["--nodes=1", f"--nodelist={keep}", "--ntasks-per-node=2", f"--output={log}",
                                "--open-mode=append"])
    try:
        state = slurm.wait(job, timeout=150)
    except TimeoutError as e:
        state = str(e)
    text = _read(log)
    if state != "COMPLETED":
        problems.append(f"the resumed job ended {state}")
    elif not re.search(rf"^zerompi\.train: run_dir \S+; resumed at step {k}\b", text, re.M):
        problems.append(f"the resumed job did not say 'resumed at step {k}'")
    else:
        after, kept = metrics(run_dir), min(k, len(before))
        if [m["step"] for m in after] != list(range(1, k + 4)):
            problems.append(f"steps after the resume: {[m['step'] for m in after]}")
        elif after[:kept] != before[:kept]:
            problems.append("the steps before the checkpoint changed")
    return problems + ([why()] if problems else [])


def summary(results: list[tuple[str, int, list[str], dict]]) -> str:
    """One line per run and a count per (fault, timeout)."""
    rows = []
    for fault, t, problems, facts in results:
        ok = "ok  " if not problems else "FAIL"
        rows.append(f"{ok} {fault:11s} timeout {t:3d}: line after {facts.get('line_s')} s, ranks gone after "
                    f"{facts.get('ranks_gone_s')} s, {facts.get('watchdog_lines')} watchdog lines, resumed at "
                    f"{facts.get('resumed_at')}" + ("" if not problems else f"\n     {problems[0]}"))
    return "\n".join(rows)

