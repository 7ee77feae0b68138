"""A real `ft serve` process on 127.0.0.1 for the API tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

API_KEY = "test-key-123"
MODEL = "freetoken-demo"
# the server of conftest's session fixture `api_server`, which test_server and
# test_structured_output share (one start instead of two)
API_SERVER_ARGS = ("--api-key", API_KEY, "--max-batch", "4", "--max-queue", "4", "--max-seq-len", "2048")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--port", str(self.port), *extra]
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ft-serve-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300  # first use builds the demo model and the C++ executor
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"ft serve exited: {self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("ft serve did not become healthy")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
