"""`python -m MODULE ARGS` for the tests without paying the same imports in every run: one server per pytest process
(tests/workers/forkserver.py) imports once what `python -m llmtrain` imports before it reads its arguments (torch,
transformers' model loading, datasets, llmtrain's config and run modules: ~4.7 CPU-s, most of a tiny run's cost),
then forks a fresh process for every run (multiprocessing's forkserver with `preload`, for whole commands).

Each run is still a process of its own: MODULE run as `__main__` by runpy, as `python -m` runs it, with its own argv,
environment, working directory (`sys.path[0]`), stdin (/dev/null), stdout and stderr, and the exit status the
interpreter gives it (an uncaught exception, `sys.exit`, `os._exit`, a signal). What differs from a cold start is
only that the modules above are already imported. A run whose environment differs from the server's in anything
but the variables read at run time (RUNTIME_PREFIXES, RUNTIME_KEYS; not PYTHONPATH, OMP_NUM_THREADS, PATH, ...)
starts cold, as do launches under torchrun and the README's command (tests/e2e/test_readme.py);
LLMTRAIN_TESTS_COLD=1 starts every run cold.

Protocol (a Unix socket): the client sends one JSON line {argv, env, cwd, stdout, stderr} (argv[0] the module;
stdout and stderr file paths); a supervisor forked for it answers `pid N` (the run's process, for a timeout's kill),
then `status S` (subprocess's returncode: the exit code, or -signal)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

# Read by a run when it needs them, never at import (wandb is not preloaded; pytest sets PYTEST_CURRENT_TEST for each
# test; torch's inductor sets TORCHINDUCTOR_CACHE_DIR in the pytest process the first time it asks for its cache).
RUNTIME_PREFIXES = ("LLMTRAIN_", "WANDB_")
RUNTIME_KEYS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


def serves(server_env: dict, env: dict) -> bool:
    """Whether a run with ENV may start from a server started with SERVER_ENV: the two differ only in runtime keys."""
    keys = set(server_env) | set(env)
    return all(server_env.get(k) == env.get(k) for k in keys
               if not k.startswith(RUNTIME_PREFIXES) and k not in RUNTIME_KEYS)


class Client:
    """The pytest process's side: starts the server on first use, in the tests' usual run environment
    (tests.helpers.cli_env, whatever the first run's own), and stops it at exit."""

    def __init__(self):
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._env: dict | None = None
        self._dir: Path | None = None
        self.forked = 0  # runs served so far

    def _started(self, env: dict) -> Path | None:
        """The socket of a server that serves ENV (started now if none is), or None: start this run cold."""
        import atexit
        import tempfile

        from tests.helpers import cli_env

        with self._lock:
            if self._env is None:
                self._env = cli_env()
                self._dir = Path(tempfile.mkdtemp(prefix="llmtrain-forkserver-"))
                repo = Path(__file__).resolve().parent.parent
                with open(self._dir / "server.log", "w") as log:
                    command = [sys.executable, "-m", "tests.workers.forkserver", str(self._dir / "s")]
                    self._server = subprocess.Popen(command, env=self._env, cwd=repo, stdout=subprocess.PIPE,
                                                    stderr=log, stdin=subprocess.DEVNULL, text=True)
                atexit.register(self.stop)
                if self._server.stdout.readline().strip() != "ready":
                    self._server = None  # it failed to start (server.log says why): every run starts cold
            if self._server is None or self._server.poll() is not None or not serves(self._env, env):
                return None
            return self._dir / "s"

    def run(self, argv: list[str], *, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess | None:
        """`python -m ARGV[0] ARGV[1:]` in ENV forked from the server, as subprocess.run(..., capture_output=True,
        text=True, timeout=TIMEOUT) returns it; None where this run must start cold."""
        import tempfile

        if os.environ.get("LLMTRAIN_TESTS_COLD") == "1":
            return None
        path = self._started(env)
        if path is None:
            return None
        command = [sys.executable, "-m", *argv]
        with tempfile.TemporaryDirectory(prefix="llmtrain-run-") as folder:
            stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
            stdout.touch()
            stderr.touch()
            request = dict(argv=argv, env=env, cwd=str(cwd), stdout=str(stdout), stderr=str(stderr))
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(str(path))
                connection.sendall((json.dumps(request) + "\n").encode())
                answers = _Lines(connection)
                pid = int(answers.next(None).split()[1])
                try:
                    status = answers.next(timeout)
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    answers.next(None)
                    raise subprocess.TimeoutExpired(command, timeout, _text(stdout), _text(stderr)) from None
            self.forked += 1
            return subprocess.CompletedProcess(command, int(status.split()[1]), _text(stdout), _text(stderr))

    def stop(self) -> None:
        import shutil

        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            self._server.wait(timeout=30)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _Lines:
    """The server's answers, one line at a time, each within a timeout (None: wait as long as it takes)."""

    def __init__(self, connection: socket.socket):
        self._connection, self._buffer = connection, b""

    def next(self, timeout: float | None) -> str:
        self._connection.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._connection.recv(4096)
            if not chunk:
                raise ConnectionError("the forkserver's supervisor closed the connection without an answer")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


def _text(path: Path) -> str:
    """A captured stream as subprocess's text=True decodes it (locale encoding, universal newlines)."""
    import io

    return io.TextIOWrapper(io.BytesIO(path.read_bytes())).read()


CLIENT = Client()
