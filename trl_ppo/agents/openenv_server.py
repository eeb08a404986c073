"""An OpenEnv `Environment` class served on this machine: `OpenEnvServer` starts it as a server process of its own
(uvicorn, OpenEnv's own routes, on a free port of 127.0.0.1), waits until `/health` answers, and stops it at the end.

    python -m trl_ppo.agents.openenv_server --environment pkg.module:Env [--action pkg.module:Action]
        [--observation pkg.module:Observation] [--port 8000] [--host 127.0.0.1] [--max_concurrent_envs 64]

Besides OpenEnv's routes (`/ws` for sessions, `/reset`, `/step`, `/state`, `/schema`, `/health`), the server answers
`GET /trl_ppo/sessions` with `{"active": n, "max": m}`: the sessions open now (one per episode being played), so
that a run can be checked for sessions it left open. Needs the `openenv` extra; imported only when used.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref

STARTUP_SECONDS = 120.0  # a cold start imports fastapi, fastmcp and gradio: seconds on a loaded machine


def import_object(path: str):
    """`"package.module:Name"` -> the object."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"{path!r} is not `package.module:Name`.")
    return getattr(importlib.import_module(module), name)


def object_path(obj) -> str:
    """The `package.module:Name` a server process imports `obj` by; a class of `__main__` has none."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module in (None, "__main__") or "<locals>" in name:
        raise ValueError(
            f"{obj!r} is defined in a script or a function: a server process cannot import it. Define it at the top "
            "level of a module of its own (`my_env.py`), importable from the working directory or PYTHONPATH."
        )
    return f"{module}:{name}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (a server the user named)
        return json.loads(response.read())


class OpenEnvServer:
    """An OpenEnv `Environment` class served by a process of its own on `127.0.0.1` -> `url` (`http://...`).

    `environment`, `action`, `observation`: the classes, importable by their module (not defined in a script);
    an `MCPEnvironment` takes OpenEnv's `CallToolAction` / `CallToolObservation` by default. `max_concurrent_envs`:
    the sessions it holds at once (OpenEnv refuses more than 1 unless the class sets
    `SUPPORTS_CONCURRENT_SESSIONS = True`). `env`: extra environment variables of the process. The process is
    stopped by `stop()`, at the end of a `with` block, or when this object is collected or Python exits."""

    def __init__(self, environment, action=None, observation=None, max_concurrent_envs: int = 64,
                 port: int | None = None, env: dict | None = None) -> None:  # fmt: skip
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "trl_ppo.agents.openenv_server", "--environment", object_path(environment),
                   "--port", str(self.port), "--max_concurrent_envs", str(max_concurrent_envs)]  # fmt: skip
        for flag, cls in (("--action", action), ("--observation", observation)):
            if cls is not None:
                command += [flag, object_path(cls)]
        # Its log goes to a file (`log_path`), never to a pipe nobody reads: a server that logs (FastMCP warns on
        # every invalid tool call) would block once the pipe's 64 KiB were full, and its sessions time out.
        log = tempfile.NamedTemporaryFile("w", prefix="trl_ppo-openenv-", suffix=".log", delete=False)
        self.log_path = log.name
        self.process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=log, stderr=log)
        log.close()
        self._stop = weakref.finalize(self, _terminate, self.process)
        self._wait_until_healthy()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"The OpenEnv server process ended at start (status {self.process.returncode}); "
                                   f"its log ({self.log_path}) ends:\n{_tail(self.log_path)}")  # fmt: skip
            try:
                if get_json(f"{self.url}/health", timeout=2.0).get("status") == "healthy":
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"The OpenEnv server at {self.url} did not answer /health within {STARTUP_SECONDS:g} s.")

    def sessions(self) -> dict:
        """`{"active": sessions open now, "max": max_concurrent_envs}`."""
        return get_json(f"{self.url}/trl_ppo/sessions")

    def stop(self) -> None:
        self._stop()

    def __enter__(self) -> "OpenEnvServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: str, characters: int = 3000) -> str:
    with open(path, encoding="utf-8", errors="replace") as log:
        return log.read()[-characters:]


def _terminate(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def build_app(environment, action=None, observation=None, max_concurrent_envs: int = 64):
    """OpenEnv's FastAPI app for `environment` (`HTTPEnvServer`'s routes) and `GET /trl_ppo/sessions`."""
    from fastapi import FastAPI
    from openenv.core.env_server import CallToolAction, CallToolObservation, HTTPEnvServer
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    if issubclass(environment, MCPEnvironment):
        action, observation = action or CallToolAction, observation or CallToolObservation
    if action is None or observation is None:
        raise ValueError(f"{environment.__name__} is not an MCPEnvironment: give its action and observation classes.")
    server = HTTPEnvServer(environment, action, observation, max_concurrent_envs=max_concurrent_envs)
    app = FastAPI(title=f"{environment.__name__} (OpenEnv, served by trl_ppo)")
    server.register_routes(app)

    @app.get("/trl_ppo/sessions")
    def sessions() -> dict:
        return {"active": server.active_sessions, "max": max_concurrent_envs}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--environment", required=True, help="package.module:Class of the OpenEnv Environment")
    parser.add_argument("--action", help="package.module:Class of its actions (MCP environments: CallToolAction)")
    parser.add_argument("--observation", help="package.module:Class of its observations")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_concurrent_envs", type=int, default=64)
    args = parser.parse_args(argv)
    sys.modules.setdefault("gradio", None)  # OpenEnv's optional web page: 2 s of imports the server never uses
    import uvicorn

    classes = [import_object(path) if path else None for path in (args.environment, args.action, args.observation)]
    app = build_app(*classes, max_concurrent_envs=args.max_concurrent_envs)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
