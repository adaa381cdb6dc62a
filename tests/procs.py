"""What the tests read of other processes, from /proc (Linux): alive or not, parent, children, command line."""

from pathlib import Path


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [state, ppid, ...]."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def parent(pid: int) -> int:
    """The parent pid of `pid`. Raises OSError when `pid` is gone."""
    return int(_stat(pid)[1])


def children(pid: int) -> list[int]:
    """The pids of the processes whose parent is `pid` (those that end meanwhile left out)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if parent(int(proc.name)) == pid:
                found.append(int(proc.name))
        except (OSError, IndexError):
            continue
    return found


def cmdline(pid: int) -> bytes:
    """The NUL-separated command line of `pid`. Raises OSError when `pid` is gone."""
    return Path(f"/proc/{pid}/cmdline").read_bytes()
