"""Python processes of the tests started by a fork, not by a new interpreter: the
``celery-dlock`` command's hundreds of runs, and the contention tests' helper scripts,
without paying their imports each time.

A CI run started the command about 470 times at 0.3-0.4 s of CPU each, and the contention
helper (``contend.py``) about 220 times at 0.25 s, nearly all of it importing click, redis,
psycopg, boto3 and the package before a few milliseconds of work. Here a server process per
test process imports them once; each run is a fork of it (under a small supervisor that
waits for it and reports its wait status), with the test's environment, working directory
and arguments, and either ``main`` called as the ``celery-dlock`` entry point calls it or
the script run as ``python SCRIPT`` runs it. It is still a process of its own: its exit
code, its output, its signals and its children are real; what it does not go through is the
interpreter's start, which an environment variable read at start (``PYTHON*``) would
change: such a run needs a new interpreter (:func:`forkable`).

``python -m tests.support.forked SOCKET`` is the server; :class:`ForkServer` starts one and
asks it for runs: :meth:`~ForkServer.run` (the command, its output captured, as
``subprocess.run``) and :meth:`~ForkServer.popen` (a script beside the test, its output the
test's, as ``subprocess.Popen``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import locale
import os
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO

__all__ = ["ForkServer", "Forked", "forkable", "popen_script"]

_WORD = struct.Struct("!q")
_READY = b"ready\n"
#: How long a fork may take before the server is taken for hung.
COMMAND_START = 30
_REPO = Path(__file__).resolve().parents[2]
#: What the server imports before its first fork: the command and the stores.
_PRELOADED = (
    "celery_dlock.cli",
    "celery_dlock.backends.file",
    "celery_dlock.backends.postgres",
    "celery_dlock.backends.redis",
    "celery_dlock.backends.s3",
    "celery_dlock.backends.gcs",
)
#: Seconds between two looks of the server at whether its test process is still there.
_ORPHAN_CHECK = 5.0
#: What a run is: the command, or a script given by its path (``argv[0]``).
CLI, SCRIPT = "celery-dlock", "script"


def forkable(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a run with ``env`` may be a fork of a server started with ``base``: only
    when no variable the interpreter reads at its start differs."""
    names = {name for name in (*env, *base) if name.startswith("PYTHON")}
    return all(env.get(name) == base.get(name) for name in names)


class Forked:
    """A run under way, as much of :class:`subprocess.Popen` as the tests use."""

    def __init__(self, args: list[str], channel: socket.socket, pid: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._channel = channel

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._channel.settimeout(timeout)
            try:
                reply = self._channel.recv(_WORD.size)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: timeout 0
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            self._channel.close()
            if not reply:
                raise RuntimeError(f"the forked run of {self.args} ended without a wait status")
            self.returncode = os.waitstatus_to_exitcode(_WORD.unpack(reply)[0])
        return self.returncode

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """A server of forked runs with the environment ``env``, started on the first run; one
    per test process and environment (its runs may come from several threads)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._lock = threading.Lock()
        self._server: subprocess.Popen[bytes] | None = None
        self._path = ""

    def run(
        self, args: list[str], input: str | None, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """``celery-dlock ARGS``: its exit code and output, as :func:`subprocess.run` with
        ``capture_output=True, text=True`` gives them."""
        with (
            tempfile.TemporaryFile() as stdin,
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
        ):
            if input is not None:
                stdin.write(input.encode())
                stdin.seek(0)
            source = stdin.fileno() if input is not None else 0
            fds = [source, stdout.fileno(), stderr.fileno()]
            run = self._start(CLI, ["celery-dlock", *args], env, fds)
            try:
                run.wait(timeout)
            except subprocess.TimeoutExpired:
                run.kill()
                raise
            return subprocess.CompletedProcess(args, run.wait(), _text(stdout), _text(stderr))

    def popen(self, argv: list[str], env: dict[str, str]) -> Forked:
        """``python ARGV`` (``argv[0]`` a script's path) beside the test, with ``env`` and
        the test's own stdin, stdout and stderr."""
        return self._start(SCRIPT, argv, env, [0, 1, 2])

    def _start(self, kind: str, argv: list[str], env: dict[str, str], fds: list[int]) -> Forked:
        path = self._started()
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.connect(path)
            request = {"kind": kind, "argv": argv, "env": env, "cwd": os.getcwd()}
            socket.send_fds(channel, [json.dumps(request).encode()], fds)
            channel.settimeout(COMMAND_START)
            (pid,) = _WORD.unpack(channel.recv(_WORD.size))
        except BaseException:
            channel.close()
            raise
        return Forked(argv, channel, pid)

    def _started(self) -> str:
        with self._lock:
            if self._server is None or self._server.poll() is not None:
                folder = tempfile.mkdtemp(prefix="dlock-fork-")
                self._path = str(Path(folder) / "socket")
                self._server = subprocess.Popen(
                    [sys.executable, "-m", "tests.support.forked", self._path],
                    stdout=subprocess.PIPE,
                    env=self.env,
                    cwd=_REPO,  # where ``-m tests.support.forked`` is found
                )
                assert self._server.stdout is not None
                line = self._server.stdout.readline()
                if line != _READY:
                    raise RuntimeError(f"the fork server did not start: {line!r}")
                atexit.register(shutil.rmtree, folder, ignore_errors=True)
                atexit.register(self._server.kill)
            return self._path


def _text(file: IO[bytes]) -> str:
    """As :mod:`subprocess` decodes a text-mode output: the locale's encoding, universal
    newlines."""
    file.seek(0)
    data = file.read().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


#: The server of :func:`popen_script`, started with the environment the tests started with.
_SCRIPTS = ForkServer(dict(os.environ))


def popen_script(script: str | Path, *args: str) -> Forked | subprocess.Popen[bytes]:
    """``python SCRIPT ARGS`` beside the test, as ``subprocess.Popen`` starts it (the test's
    environment, stdin, stdout and stderr): forked, unless a ``PYTHON*`` variable changed."""
    argv = [str(script), *args]
    env = dict(os.environ)
    if not forkable(env, _SCRIPTS.env):
        return subprocess.Popen([sys.executable, *argv])
    return _SCRIPTS.popen(argv, env)


# -- the server ---------------------------------------------------------------------------


def serve(path: str) -> None:
    """Import the command and the stores, then fork a run for each request on ``path``."""
    for module in _PRELOADED:
        # A store whose driver is not installed (its extra): a run that needs it imports
        # it itself and fails as it would in a new interpreter, naming the extra.
        with contextlib.suppress(ImportError):
            importlib.import_module(module)

    gc.freeze()  # what is imported stays out of the runs' collections (and their pages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(_ORPHAN_CHECK)
    parent = os.getppid()
    sys.stdout.buffer.write(_READY)
    sys.stdout.flush()
    while True:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # its test process is gone (killed): so is it
                return
            continue
        _reap()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        if not message or len(fds) != 3:  # a client gone before asking
            connection.close()
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            listener.close()
            _supervise(connection, fds)
            _command(json.loads(message), fds)  # only the command comes here
        connection.close()
        for fd in fds:
            os.close(fd)


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _supervise(connection: socket.socket, fds: list[int]) -> None:
    """In the fork: fork the command, tell its pid, wait for it, tell its wait status and
    end. Only the command returns from here."""
    pid = os.fork()
    if pid == 0:
        connection.close()
        return
    for fd in fds:
        os.close(fd)
    connection.send(_WORD.pack(pid))
    _, status = os.waitpid(pid, 0)
    connection.send(_WORD.pack(status))
    os._exit(0)


def _command(request: dict[str, object], fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(request["cwd"]))
    argv = request["argv"]
    assert isinstance(argv, list)
    sys.argv = argv
    try:
        if request["kind"] == CLI:
            from celery_dlock.cli import main

            main(prog_name="celery-dlock")
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        _exit(exit.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _flushed()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        _exit(1)
    _exit(0)


def _exit(code: object) -> None:
    """End as the interpreter ends on ``SystemExit(code)``, without its teardown: freeing
    every object the server imported would touch (and copy) all of their pages, several
    times the run's own cost."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    _flushed()
    os._exit(code & 0xFF)


def _flushed() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
