"""``serve`` before the page: it binds first and then says where it listens (the real port
of ``--port 0``), a port in use is a clear error with no "serving on" line, and Ctrl-C
stops it cleanly. Run for real (``celery-dlock serve`` as a process) on the file store."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import urllib.request

import pytest

from tests.cli.clitools import BIN, COMMAND_TIMEOUT, CliStore, environment, run_cli

pytest.importorskip("flask")
pytest.importorskip("waitress")


def test_a_port_in_use_is_named_with_no_serving_line(file_store: CliStore) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--backend", file_store.url, "serve", "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in result.stderr
    assert "serving" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_port_0_prints_the_real_port_and_ctrl_c_stops_it(file_store: CliStore) -> None:
    server = subprocess.Popen(
        [str(BIN / "celery-dlock"), "--backend", file_store.url, "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(None),
        start_new_session=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline().decode()
        found = re.search(r" on http://127\.0\.0\.1:(\d+)/ ", line)
        assert found, line
        port = int(found.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            assert reply.status == 200  # the port printed is the one it listens on
        server.send_signal(signal.SIGINT)  # Ctrl-C, the documented way to stop it
        _, err = server.communicate(timeout=COMMAND_TIMEOUT)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0
    assert b"Traceback" not in err and b"Aborted" not in err
