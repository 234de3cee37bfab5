"""The forkserver tests/forkserver.py starts (`python -m tests.workers.forkserver SOCKET`): imports PRELOAD, then
forks, for every request on SOCKET, a supervisor that forks the run and reports its pid and exit status (the protocol
is in tests/forkserver.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

# what `python -m llmtrain` imports before it reads its arguments (llmtrain/__main__.py), and transformers' model code
PRELOAD = ("llmtrain.compose", "llmtrain.data.errors", "llmtrain.distributed", "llmtrain.faults", "llmtrain.run",
           "llmtrain.trainer", "transformers.modeling_utils")


def _run(request: dict) -> None:
    """In the run's process: become `python -m MODULE ARGS` in REQUEST's cwd, env and files; never returns (the
    interpreter exits as after a cold `python -m`, atexit handlers and stdio flush included)."""
    import runpy

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores its children; a run waits on its own
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    module, *args = request["argv"]
    sys.argv = [module, *args]
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def _supervise(connection: socket.socket, request: dict) -> None:
    """In a process forked per run: fork the run, tell the client its pid, wait, tell its status; then _exit (the
    server's atexit handlers are not this process's)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        connection.close()
        _run(request)
    connection.sendall(f"pid {pid}\n".encode())
    _, wait_status = os.waitpid(pid, 0)
    connection.sendall(f"status {os.waitstatus_to_exitcode(wait_status)}\n".encode())
    os._exit(0)


def serve(path: str) -> None:
    import importlib
    import threading

    for module in PRELOAD:
        importlib.import_module(module)
    assert threading.active_count() == 1, "the forkserver must fork from a single Python thread"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(5.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent:  # the pytest process that started it is gone: stop
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        connection.settimeout(None)
        request = json.loads(connection.makefile("r").readline())
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _supervise(connection, request)
        connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
