"""The sandboxed Python interpreter tool: model-written code runs in `hybridflow.engine.agent.sandbox`, one
interpreter per trajectory, its variables kept from call to call (as a notebook's cells), closed at the
trajectory's end.

Offered to the model as the tool ``python(code: str)``. Every failure comes back to the model as text while the run
goes on: an exception (its traceback, the code's frames only), a call past its timeout or the sandbox's CPU limit
(the interpreter is stopped and the next call starts a fresh one, which the answer says), memory past the limit
(MemoryError), too many processes (the fork fails), writes outside ``/tmp`` (read-only file system), a network
connection (no network), host files (not there). Output past ``max_output_chars`` is cut inside the sandbox, so a
flood of prints never crosses the pipe.

In ``rollout.multi_turn.tool_config_path``::

    tools:
      - class: hybridflow.engine.agent.code_interpreter:PythonInterpreter
        timeout_s: 10            # per call, wall seconds
        config: {memory_mb: 1024, cpu_s: 60, max_processes: 16, tmp_mb: 64}
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hybridflow.engine.agent.sandbox import SandboxLimits, check_sandbox, sandbox_command, sandbox_python
from hybridflow.engine.agent.tools import ToolError

DRIVER = (Path(__file__).with_name("interpreter_driver.py")).read_text()
"""The loop that runs inside the sandbox (`hybridflow.engine.agent.interpreter_driver`), passed with ``-c``."""


class InterpreterLost(RuntimeError):
    """The interpreter process ended or broke its protocol (the message says how); its variables are gone."""


class PythonSession:
    """One sandboxed Python process and its namespace.

    Args:
        limits: the sandbox's resource limits.
        max_output_chars: characters of one call's output kept (the rest is counted and cut).

    Raises (from `run`): InterpreterLost, TimeoutError; SandboxUnavailable at start (no sandbox here).
    """

    def __init__(self, limits: SandboxLimits, max_output_chars: int = 65_536) -> None:
        self.limits = limits
        self.max_output_chars = int(max_output_chars)
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start the sandboxed interpreter (about 15 ms here)."""
        python = sandbox_python()
        command = sandbox_command([python, "-I", "-S", "-c", DRIVER, str(self.max_output_chars)], self.limits, python)
        self.process = await asyncio.create_subprocess_exec(
            *command.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=8 * self.max_output_chars + 4096,  # a reply's longest line: every character escaped
            start_new_session=True,
            **command.popen_kwargs(),
        )

    async def run(self, code: str) -> dict[str, Any]:
        """Run `code` in the session's namespace; the reply ``{"output": str, "error": bool, "cut": int}``.
        Cancelled (a caller's timeout), it stops the process first.

        Raises:
            InterpreterLost: the process ended (e.g. its CPU limit) or replied out of protocol (it is stopped).
        """
        if self.process is None or self.process.returncode is not None:
            await self.start()
        process = self.process
        try:
            process.stdin.write((json.dumps({"code": code}) + "\n").encode())
            await process.stdin.drain()
            line = await process.stdout.readline()
        except asyncio.CancelledError:
            await self.close()
            raise
        except (ConnectionError, ValueError, asyncio.LimitOverrunError) as e:
            await self.close()
            raise InterpreterLost(f"the interpreter's reply broke its protocol ({type(e).__name__})") from None
        if not line:
            await process.wait()
            said = (await process.stderr.read()).decode(errors="replace").strip()
            raise InterpreterLost(f"the interpreter ended ({_ended(process.returncode)}){': ' + said if said else ''}")
        try:
            reply = json.loads(line)
            if not isinstance(reply, dict) or not isinstance(reply.get("output"), str):
                raise ValueError(reply)
        except ValueError:
            await self.close()
            raise InterpreterLost("the interpreter's reply broke its protocol") from None
        return reply

    async def close(self) -> None:
        """Stop the process (and every process of its sandbox: they die with it) and wait for it."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            process.kill()
        await process.wait()


def _ended(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        import signal

        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (": its CPU time limit" if name in ("SIGXCPU", "SIGKILL") else "")
    return f"exit code {returncode}"


class PythonInterpreter:
    """The ``python`` tool: one sandboxed interpreter per trajectory (module docstring), started at its first call.
    A call the tool box cancels at its ``timeout_s`` stops the interpreter; the next call starts a fresh one
    (`restart_note` says so to the model).

    Args (the tool entry's ``config``):
        cpu_s, memory_mb, max_processes, tmp_mb: `hybridflow.engine.agent.sandbox.SandboxLimits`.
        max_output_chars: characters of output kept per call, cut inside the sandbox (the model reads at most
            ``rollout.multi_turn.max_tool_response_length`` of them).

    Raises:
        ValueError: a limit < 1.
    """

    name = "python"
    restart_note = "the interpreter was restarted, so the variables of earlier calls are gone"

    def __init__(
        self, cpu_s: int = 60, memory_mb: int = 1024, max_processes: int = 16, tmp_mb: int = 64,
        max_output_chars: int = 65_536,
    ) -> None:  # fmt: skip
        self.session = PythonSession(SandboxLimits(cpu_s, memory_mb, max_processes, tmp_mb), max_output_chars)
        self.lock = asyncio.Lock()

    @staticmethod
    def check() -> None:
        """Before any work: this machine runs the sandbox (`hybridflow.engine.agent.sandbox.check_sandbox`)."""
        check_sandbox()

    async def __call__(self, code: str) -> str:
        """Run Python code in a persistent interpreter and return what it prints; the value of a last expression is
        printed too. Variables, functions and imports are kept between calls. Standard library only.

        Args:
            code: the Python code to run
        """
        async with self.lock:  # one trajectory's calls run in the order it made them
            try:
                reply = await self.session.run(code)
            except InterpreterLost as e:
                raise ToolError(f"{e}; the next call starts a fresh interpreter") from None
        text = reply["output"]
        if reply.get("cut"):
            text += f"...({reply['cut']} more characters cut)"
        if reply.get("error"):
            raise CodeError(text)
        return text if text else "(no output)"

    async def close(self) -> None:
        """Stop the trajectory's interpreter."""
        await self.session.close()


class CodeError(ToolError):
    """The code raised: the message is its output and traceback, shown to the model as the tool's error."""
