"""The sandboxed Python interpreter tool (`hybridflow.engine.agent.code_interpreter` on bubblewrap): hostile code is
answered to the model as an error text while the trajectory goes on; nothing of the host is reachable.

Real sandboxes throughout (Debian's bwrap, installed by .ci/setup)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

from hybridflow.engine.agent.code_interpreter import PythonInterpreter
from hybridflow.engine.agent.sandbox import SandboxUnavailable, check_sandbox
from hybridflow.engine.agent.tools import ToolBox, ToolResult, load_tools, tool_from_class

if shutil.which("bwrap") is None and not os.environ.get("CI"):  # CI installs it (.ci/setup): there it must run
    pytest.skip("the sandbox needs Debian's bubblewrap: apt-get install bubblewrap", allow_module_level=True)


def box(timeout_s: float = 5.0, **config) -> ToolBox:
    return ToolBox([tool_from_class(PythonInterpreter, config, timeout_s)], max_response_chars=2000)


def calls(tools: ToolBox, *codes: str) -> list[ToolResult]:
    """The answers to `codes`, called in order in one trajectory's interpreter."""

    async def trajectory() -> list[ToolResult]:
        async with tools.session() as session:
            return [await session.call("python", {"code": code}) for code in codes]

    return asyncio.run(trajectory())


def test_variables_persist_across_calls_and_the_last_expression_is_shown():
    results = calls(box(), "x = 41\ndef twice(n):\n    return 2 * n", "print('x is', x)\ntwice(x + 1)", "None")
    assert [r.text for r in results] == ["(no output)", "x is 41\n84\n", "(no output)"]
    assert all(r.error is None for r in results)
    schema = box().schemas[0]["function"]
    assert schema["name"] == "python" and list(schema["parameters"]["properties"]) == ["code"]


def test_an_infinite_loop_is_stopped_at_the_timeout_and_the_next_call_gets_a_fresh_interpreter():
    started = time.monotonic()
    loop, after, fresh = calls(box(timeout_s=1.0), "x = 1", "while True:\n    pass", "x")[1:] + calls(box(), "1 + 1")
    assert time.monotonic() - started < 6
    assert loop.error == "timeout" and "within 1 s" in loop.text and "variables of earlier calls are gone" in loop.text
    assert after.error == "raised" and "NameError: name 'x' is not defined" in after.text
    assert fresh.text == "2\n"


def test_a_fork_bomb_meets_its_process_limit_and_other_sandboxes_still_start():
    async def both() -> tuple[ToolResult, ToolResult]:
        tools = box(timeout_s=10.0, max_processes=16)
        async with tools.session() as bomb, tools.session() as other:
            forks = "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(60)"  # children hold on
            bombed = await bomb.call("python", {"code": forks})
            code = "import os\npid = os.fork()\nif pid == 0:\n    os._exit(7)\nos.waitpid(pid, 0)[1] >> 8"
            fine = await other.call("python", {"code": code})
            return bombed, fine

    bombed, fine = asyncio.run(both())
    assert bombed.error == "raised" and "BlockingIOError" in bombed.text
    assert fine.error is None and fine.text == "7\n"  # it forked: its own user, its own limit


def test_memory_past_the_limit_is_a_memory_error():
    [big, small] = calls(box(memory_mb=512), "blob = bytearray(4 * 2**30)", "len(bytearray(2**20))")
    assert big.error == "raised" and "MemoryError" in big.text
    assert small.text == "1048576\n"  # the interpreter lives on


def test_the_system_is_read_only_and_tmp_is_private(tmp_path):
    outside = calls(box(), "open('/usr/lib/evil', 'w')", f"open({str(tmp_path / 'evil')!r}, 'w')")
    assert "Read-only file system" in outside[0].text
    assert "No such file or directory" in outside[1].text and not (tmp_path / "evil").exists()
    [wrote] = calls(box(), "open('/tmp/notes.txt', 'w').write('kept')\nopen('/tmp/notes.txt').read()")
    assert wrote.text == "'kept'\n" and not Path("/tmp/notes.txt").exists()


def test_no_network_not_even_the_hosts_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(0.5)
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        [connect] = calls(box(), code)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody reached the host's listener
    assert connect.error == "raised" and "ConnectionRefusedError" in connect.text


def test_ten_megabytes_printed_are_cut_inside_the_sandbox():
    started = time.monotonic()
    [flood] = calls(box(max_output_chars=1000), "print('x' * 10_000_000)")
    assert time.monotonic() - started < 5
    assert flood.error is None and len(flood.text) < 2100 and "9999001 more characters cut" in flood.text


def test_the_run_folder_and_secrets_are_out_of_reach(tmp_path, monkeypatch):
    secret = tmp_path / "run" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("hunter2")
    monkeypatch.setenv("WANDB_API_KEY", "hunter2")
    code = (
        f"import os\nfound = os.path.exists({str(secret)!r}) or os.path.exists({os.getcwd()!r})\n"
        "found, os.environ.get('WANDB_API_KEY'), sorted(os.listdir('/'))"
    )
    [peek] = calls(box(), code)
    assert peek.text == "(False, None, ['bin', 'dev', 'lib', 'lib64', 'proc', 'tmp', 'usr'])\n"
    [read] = calls(box(), f"open({str(secret)!r}).read()")
    assert read.error == "raised" and "hunter2" not in read.text


def test_the_interpreter_ends_with_its_trajectory():
    async def trajectory() -> int:
        async with box().session() as session:
            await session.call("python", {"code": "1"})
            return session.instances["python"].session.process.pid

    pid = asyncio.run(trajectory())
    assert not Path(f"/proc/{pid}").exists()


def test_many_interpreters_at_once():
    tools = box(timeout_s=20.0)

    async def trajectories() -> list[ToolResult]:
        sessions = [tools.session() for _ in range(32)]
        try:
            return await asyncio.gather(
                *(s.call("python", {"code": f"sum(range({i}))"}) for i, s in enumerate(sessions))
            )
        finally:
            await asyncio.gather(*(s.close() for s in sessions))

    results = asyncio.run(trajectories())
    assert [r.text for r in results] == [f"{sum(range(i))}\n" for i in range(32)]


def test_without_the_sandbox_the_tools_are_refused_before_any_work(tmp_path, monkeypatch):
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n  - class: hybridflow.engine.agent.code_interpreter:PythonInterpreter\n")
    assert load_tools(config)[0].name == "python"
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without bwrap
    check_sandbox.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            load_tools(config)
    finally:
        check_sandbox.cache_clear()


PYTHON_LOOP = '''
from hybridflow.engine.agent.loop import AgentLoop, AgentLoopOutput


class Computes(AgentLoop):
    """Each turn of at most 4 tokens is followed by two interpreter calls: one sets a variable, one reads it."""

    async def run(self, sampling_params, **row):
        out = AgentLoopOutput(self.prompt_ids(row))
        budget, turn_no = sampling_params.max_tokens, 0
        while len(out.response_ids) < budget:
            turn = await self.engine.generate(out.prompt_ids + out.response_ids, min(4, budget - len(out.response_ids)))
            out.add_model_turn(turn)
            turn_no += 1
            first = await self.context.tools.call("python", {"code": f"seen = {turn_no} * 1000 + {len(turn.ids)}"})
            second = await self.context.tools.call("python", {"code": "print('computed', seen + 1)"})
            out.tool_calls["python"] += 2
            ids = self.context.chat_format.tool_turn_ids([first.text, second.text])
            if len(out.response_ids) + len(ids) >= budget:
                break
            out.add_tool_turns(ids, 2)
        return out
'''


def test_the_interpreter_runs_in_a_training_run_one_per_trajectory(prefect_api, tmp_path, tiny_model_dir):
    """A GRPO run of the Prefect flow on its worker group whose loop calls the sandboxed interpreter: the samples in
    the store show the interpreter's real output, its variables kept within each trajectory."""
    from tiny_runs import tiny_run_config

    from hybridflow.flows.rlhf import rlhf_flow
    from hybridflow.flows.store.run_store import RunStore

    (tmp_path / "computes.py").write_text(PYTHON_LOOP)
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class: hybridflow.engine.agent.code_interpreter:PythonInterpreter\n")
    extra = [
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={tools}",
        f"rollout.multi_turn.default_agent_loop={tmp_path / 'computes.py'}:Computes",
        "rollout.response_length=96",
        "data.max_prompt_length=1024",  # the tool's schema is in the system prompt
        "trainer.total_iterations=1",
        "trainer.log_train_generations=4",
    ]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", extra)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "sandbox")
    rlhf_flow(run_id=run_id, db_url=store.url)
    assert store.get_run(run_id).status == "completed"
    samples = [s for s in store.samples(run_id) if s.kind == "train"]
    assert samples
    for sample in samples:
        # the second call read what the first set (1000 x turn + the turn's tokens, + 1): real code, kept state
        assert re.search(r"\(no output\)<\|im_end\|>\n<\|im_start\|>tool\ncomputed 100[2-5]\n", sample.response)
        assert "Error" not in sample.response
