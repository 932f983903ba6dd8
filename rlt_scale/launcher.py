"""The launchers' stop-signal rule: a signal that every worker answered with a checkpoint is a clean exit.

rlt-train answers SIGTERM and SIGUSR1 by checkpointing at the end of the current
step and exiting 0. The launchers around it do not report that:

* torchrun's agent, on SIGTERM/SIGINT/SIGHUP/SIGQUIT, forwards the signal to its
  workers, waits ``--shutdown-timeout`` seconds, SIGKILLs the rest and then
  raises ``SignalException``: status 1 and a traceback, however the workers
  ended. SIGUSR1 is not in its default set, so SIGUSR1 killed the agent.
* DeepSpeed's runner has no handler on one machine: SIGTERM killed it at once
  and left its launcher process and the workers running without it.

So ``launch/*.sh`` start them through this module::

    python -m rlt_scale.launcher torchrun [torchrun options] -m rlt_scale.cli.train CONFIG ...
    python -m rlt_scale.launcher deepspeed SHUTDOWN_TIMEOUT DEEPSPEED [deepspeed options] ...

``torchrun`` runs torchrun's agent in this process, unchanged, with SIGUSR1
added to the signals it forwards (unless ``--signals-to-handle`` is given).
When a signal stops it, the workers' exit codes decide: all 0 -> status 0 and
one line saying so; otherwise (a worker failed, was SIGKILLed after the grace
period, or none was running) -> 128 + the signal number, naming the codes. No
traceback either way. Without a signal nothing changes (a failed job still
ends with torchrun's ``ChildFailedError`` report and status 1).

``deepspeed`` runs the deepspeed runner as a child and sends a SIGTERM, SIGUSR1
or SIGINT it receives to the workers only (the children of DeepSpeed's
per-machine ``deepspeed.launcher.launch``), then waits for the runner:
DeepSpeed's launcher exits 0 only when every worker did, so the runner's status
is the answer. After SHUTDOWN_TIMEOUT seconds the runner and everything under
it are SIGKILLed (status 128 + the signal number). Without a local launcher (a
multi-host pdsh run) the signal goes to the runner alone (SIGUSR1 as SIGTERM),
whose own handler pkills the launchers on every host and exits 1.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""torchrun's default set plus SIGUSR1, which rlt-train also answers with a checkpoint."""


def _say(message: str) -> None:
    print(f"rlt_scale.launcher: {message}", file=sys.stderr, flush=True)


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


def torchrun(argv: list[str]) -> int:
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api as launcher_api

    agents = []

    class Agent(launcher_api.LocalElasticAgent):
        """torchrun's agent, remembered so that its workers' exit codes can be read after a signal."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            agents.append(self)

    launcher_api.LocalElasticAgent = Agent
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        argv = [f"--signals-to-handle={TORCHRUN_SIGNALS}", *argv]
    try:
        torch_run.main(argv)
    except SignalException as stop:
        # The agent has forwarded the signal, waited --shutdown-timeout and
        # SIGKILLed the workers still running; their Popen objects hold the codes.
        name = signal.Signals(stop.sigval).name
        pcontext = agents[-1]._pcontext if agents else None
        handlers = getattr(pcontext, "subprocess_handlers", None) or {}
        codes = {rank: h.proc.poll() for rank, h in sorted(handlers.items())}
        listed = ", ".join(f"local rank {rank}: {_describe(code)}" for rank, code in codes.items())
        if codes and all(code == 0 for code in codes.values()):
            _say(f"{name}: every worker exited 0 ({listed}) after checkpointing; exiting 0")
            return 0
        _say(f"{name}: not every worker exited 0 ({listed or 'no workers were running'}); "
             f"exiting {128 + stop.sigval}")
        return 128 + stop.sigval
    return 0


def _deepspeed_tree(runner_pid: int) -> tuple[list, list, list]:
    """(the runner and its descendants, DeepSpeed's per-machine launchers, their children: the workers)."""
    import psutil

    try:
        runner = psutil.Process(runner_pid)
        tree = [runner, *runner.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [], [], []
    launchers = []
    for p in tree[1:]:
        try:
            if "deepspeed.launcher.launch" in p.cmdline():
                launchers.append(p)
        except psutil.Error:
            pass
    pids = {p.pid for p in launchers}
    workers = []
    for p in tree[1:]:
        try:
            if p.ppid() in pids:
                workers.append(p)
        except psutil.Error:
            pass
    return tree, launchers, workers


def _signal_all(processes: list, sig: int) -> None:
    import psutil

    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def deepspeed(shutdown_timeout: float, cmd: list[str]) -> int:
    runner = subprocess.Popen(cmd)
    received: list[int] = []
    deadline = float("inf")

    def forward(signum, _frame):
        nonlocal deadline
        if not received:
            deadline = time.monotonic() + shutdown_timeout
        received.append(signum)
        tree, launchers, workers = _deepspeed_tree(runner.pid)
        if workers:
            targets = workers
            _say(f"{signal.Signals(signum).name}: sent to the workers (pids "
                 f"{', '.join(str(p.pid) for p in workers)}); waiting up to {shutdown_timeout:g} s for them")
        elif launchers:  # this machine's workers are not started yet: stop everything
            targets = tree
        else:  # a multi-host (pdsh) run, or not started: DeepSpeed's runner handles SIGTERM/SIGINT itself
            targets = tree[:1]
            signum = signal.SIGTERM if signum == signal.SIGUSR1 else signum  # it has no SIGUSR1 handler
        _signal_all(targets, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            code = runner.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                _say(f"the workers did not exit within {shutdown_timeout:g} s; SIGKILL")
                _signal_all(_deepspeed_tree(runner.pid)[0], signal.SIGKILL)
                runner.wait()
                return 128 + received[0]
    if not received:
        return code if code >= 0 else 128 - code
    name = signal.Signals(received[0]).name
    if code == 0:
        _say(f"{name}: every worker exited 0 after checkpointing; exiting 0")
        return 0
    status = code if code > 0 else 128 - code
    _say(f"{name}: the deepspeed launcher ended with {_describe(code)}; exiting {status}")
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:
        return torchrun(argv[1:])
    if argv[:1] == ["deepspeed"] and len(argv) >= 3:
        return deepspeed(float(argv[1]), argv[2:])
    print("usage: python -m rlt_scale.launcher torchrun [torchrun options] -m rlt_scale.cli.train CONFIG ...\n"
          "       python -m rlt_scale.launcher deepspeed SHUTDOWN_TIMEOUT DEEPSPEED [deepspeed options] ...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
