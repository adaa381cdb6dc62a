"""`exit_process`: an orderly exit's effects (threads joined, exit hooks run, output flushed, the status) without the
interpreter's teardown of modules."""

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from hybridflow.engine.fast_exit import exit_process

    class Teardown:
        def __del__(self):
            print("module teardown ran", flush=True)

    kept = Teardown()  # a module global: only the interpreter's teardown of modules deletes it
    atexit.register(lambda: print("atexit ran", flush=True))

    def late_writer():
        time.sleep(0.3)
        print("thread finished", flush=True)

    threading.Thread(target=late_writer).start()  # non-daemon: an exit waits for it
    sys.stdout.write("unflushed line\\n")  # still in the buffer when exit_process is called
    exit_process(CODE)
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    program = PROGRAM.replace("CODE", code)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)


def test_exit_process_joins_threads_runs_exit_hooks_flushes_and_skips_the_teardown():
    done = _run("3")
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert "unflushed line" in lines and "thread finished" in lines and "atexit ran" in lines, done.stdout
    assert lines.index("thread finished") < lines.index("atexit ran")  # the interpreter's order: threads, then hooks
    assert "module teardown ran" not in done.stdout  # the slow part, skipped


def test_exit_process_takes_sys_exit_codes():
    assert _run("None").returncode == 0
    message = _run("'no such run'")
    assert message.returncode == 1 and "no such run" in message.stderr
