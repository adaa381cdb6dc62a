"""The Python interpreter's loop inside the sandbox (`hybridflow.engine.agent.code_interpreter`): standard library
only, run as ``python -I -S -c <this file's text> MAX_OUTPUT_CHARS``.

Protocol: one JSON line per request on stdin, ``{"code": "..."}``; one JSON line per reply on stdout,
``{"output": "...", "error": bool, "cut": int}``. The code runs in one namespace that persists across requests (as
a notebook's cells do); when its last statement is an expression, its ``repr`` is printed (unless None). What the
code prints (stdout and stderr together, and the traceback of an exception) is kept up to MAX_OUTPUT_CHARS
characters; ``cut`` counts the characters dropped. The code's own writes to file descriptors 0-2 go to /dev/null, so
only this loop speaks on the protocol's pipes; processes the code forks leave them at the fork.
"""

import ast
import io
import json
import os
import sys
import traceback


class Capped(io.TextIOBase):
    """A text stream that keeps the first `limit` characters written and counts the rest."""

    def __init__(self, limit):
        self.limit, self.parts, self.size, self.cut = limit, [], 0, 0

    def writable(self):
        return True

    def write(self, text):
        text = str(text)
        room = max(self.limit - self.size, 0)
        self.parts.append(text[:room])
        self.size += min(len(text), room)
        self.cut += len(text) - min(len(text), room)
        return len(text)


def run(code, namespace, out):
    """Run `code` in `namespace`, its prints and traceback into `out`; whether it raised."""
    sys.stdout = sys.stderr = out
    try:
        tree = ast.parse(code, "<code>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
        return False
    except BaseException:  # SystemExit and KeyboardInterrupt too: the code ends, the interpreter does not
        kind, error, frames = sys.exc_info()
        while frames is not None and frames.tb_frame.f_code.co_filename != "<code>":
            frames = frames.tb_next  # the code's own frames only
        traceback.print_exception(kind, error, frames, file=out)
        return True
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def main(limit):
    """Serve requests until stdin closes (module docstring)."""
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    driver = os.getpid()

    def leave_the_protocol():  # a process the code forks never speaks on the protocol's pipes
        for stream in (requests, replies):
            os.dup2(null, stream.fileno())

    os.register_at_fork(after_in_child=leave_the_protocol)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for line in requests:
        out = Capped(limit)
        failed = run(json.loads(line)["code"], namespace, out)
        if os.getpid() != driver:
            os._exit(0)  # a forked child's copy of the code has ended
        replies.write(json.dumps({"output": "".join(out.parts), "error": failed, "cut": out.cut}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]))
