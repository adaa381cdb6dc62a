"""The sandbox that model-written code runs in: Debian's ``bubblewrap`` (``bwrap``), with kernel resource limits.

A sandboxed process sees a read-only system (``/usr`` and its links ``/bin``, ``/lib``, ``/lib64``, plus the
interpreter's own installation when it lives elsewhere), a private writable ``/tmp`` (a tmpfs of
`SandboxLimits.tmp_mb`), a fresh ``/proc`` and a minimal ``/dev``; nothing else of the host's files (no home, no
checkout, no run folder, no ``/etc``), none of its environment variables (``--clearenv``: no tokens or keys), and
no network (a network namespace of its own with only its own loopback). Its processes are in their own PID, IPC,
UTS and user namespaces and die with their parent (``--die-with-parent``).

Limits (``prlimit``, per process of the sandbox): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS) and the
number of processes (RLIMIT_NPROC). The kernel counts processes per user, and never limits root's, so a sandbox
started by root runs as a user id of its own (a random unprivileged uid, drawn per sandbox): a fork bomb in one
sandbox meets its own limit and nobody else's. Started by another user, the sandbox runs as that user, and the
process limit is the user's processes at start plus `SandboxLimits.max_processes` (the kernel counts the user's
processes across the machine).

There is no unsandboxed fallback: where ``bwrap`` is missing or cannot make its namespaces, `check_sandbox`
refuses before any work, naming the fix.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INSTALL = (
    "install Debian's bubblewrap (`apt-get install bubblewrap`; it needs user namespaces: "
    "sysctl kernel.unprivileged_userns_clone=1 where the kernel has that switch), or take the sandboxed tool out of "
    "rollout.multi_turn.tool_config_path"
)
_FIRST_UID = 100_000
"""The sandboxes' user ids (when started by root) are drawn from [_FIRST_UID, 2**31): above any real account's."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox (no ``bwrap``, or it cannot create its namespaces); the message names
    the cause and the fix. Raised before any work: never replaced by running the code unsandboxed."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandbox may use.

    Attributes:
        cpu_s: CPU seconds each of its processes may use over its life (RLIMIT_CPU; then the kernel kills it).
        memory_mb: address space of each process, MiB (RLIMIT_AS: a larger allocation fails with MemoryError).
        max_processes: processes and threads its user may have (RLIMIT_NPROC), the sandbox's own included.
        tmp_mb: size of its private ``/tmp`` (a tmpfs), MiB.

    Raises:
        ValueError: a limit is < 1 (names the limit).
    """

    cpu_s: int = 60
    memory_mb: int = 1024
    max_processes: int = 16
    tmp_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "max_processes", "tmp_mb"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"sandbox limit {name} must be >= 1, got {getattr(self, name)!r}")


def bwrap_path() -> str:
    """The ``bwrap`` binary on ``PATH``.

    Raises:
        SandboxUnavailable: there is none (names the fix)."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(f"the sandbox needs bubblewrap, and `bwrap` is not on PATH: {INSTALL}")
    return path


def sandbox_python() -> str:
    """The Python interpreter code runs with inside the sandbox: the system's ``/usr/bin/python3`` where there is
    one (standard library only), else the interpreter HybridFlow runs on (its installation bound read-only)."""
    if Path("/usr/bin/python3").exists():
        return "/usr/bin/python3"
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def _read_only_roots(python: str) -> list[str]:
    """The host folders bound read-only: ``/usr``, and the interpreter's installation when it is elsewhere."""
    roots = ["/usr"]
    prefix = Path(python).resolve().parent.parent
    if not str(prefix).startswith("/usr/") and str(prefix) != "/usr":
        roots.append(str(prefix))
    return roots


def _user_processes(uid: int) -> int:
    """Tasks (processes and threads) of user `uid` now, as RLIMIT_NPROC counts them."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue  # the process ended while we looked
    return count


@dataclass(frozen=True)
class SandboxCommand:
    """How to start one sandboxed command: `argv` for `subprocess.Popen`, and the user and group to start it as
    (root only; None: as the caller)."""

    argv: list[str]
    user: int | None
    group: int | None

    def popen_kwargs(self) -> dict:
        """The `subprocess.Popen` keyword arguments that drop to the sandbox's user (none for a non-root caller)."""
        if self.user is None:
            return {}
        return {"user": self.user, "group": self.group, "extra_groups": []}


def sandbox_command(command: list[str], limits: SandboxLimits, python: str | None = None) -> SandboxCommand:
    """`command` (its first word a path inside the sandbox) wrapped in ``prlimit`` and ``bwrap`` (module docstring).

    Args:
        command: the program and its arguments, as run inside the sandbox.
        limits: the resource limits.
        python: the interpreter whose installation must be visible (default `sandbox_python`).

    Raises:
        SandboxUnavailable: no ``bwrap`` or ``prlimit`` on PATH.
    """
    bwrap = bwrap_path()
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxUnavailable("the sandbox's limits need `prlimit` (Debian's util-linux), not on PATH")
    user = group = None
    if os.geteuid() == 0:
        user = group = _FIRST_UID + secrets.randbelow(2**31 - _FIRST_UID)
        processes = limits.max_processes
    else:
        processes = _user_processes(os.geteuid()) + limits.max_processes
    argv = [
        prlimit,
        f"--cpu={limits.cpu_s}",
        f"--as={limits.memory_mb * 2**20}",
        f"--nproc={processes}",
        "--",
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    for root in _read_only_roots(python or sandbox_python()):
        argv += ["--ro-bind", root, root]
    argv += ["--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb * 2**20), "--tmpfs", "/tmp"]
    argv += ["--chdir", "/tmp", *command]
    return SandboxCommand(argv, user, group)


@functools.cache
def check_sandbox() -> None:
    """Start one sandbox and check what it must refuse: no host files beyond the system, a read-only system, no
    network interface but its own loopback. Cached: once per process.

    Raises:
        SandboxUnavailable: ``bwrap`` is missing, cannot create its namespaces (its own error quoted), or the
            sandbox it made is not isolated; each names the fix.
    """
    python = sandbox_python()
    host = os.getcwd() if os.getcwd() != "/" and not os.getcwd().startswith("/usr") else "/root"
    probe = (
        "import os, socket\n"
        "assert not os.path.exists('/etc/passwd'), 'host /etc visible'\n"
        f"assert not os.path.exists({host!r}), 'the host folder {host} is visible'\n"
        "try:\n    open('/usr/x', 'w')\nexcept OSError:\n    pass\nelse:\n    raise AssertionError('/usr writable')\n"
        "names = sorted(n for _, n in socket.if_nameindex())\n"
        "assert names == ['lo'], f'network interfaces {names}'\n"
        "print('isolated')\n"
    )
    cmd = sandbox_command([python, "-I", "-S", "-c", probe], SandboxLimits())
    try:
        done = subprocess.run(
            cmd.argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, **cmd.popen_kwargs()
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"the sandbox did not start: {e}; {INSTALL}") from None
    if done.returncode != 0 or done.stdout.strip() != "isolated":
        said = " ".join((done.stderr or done.stdout).split())[-400:]
        raise SandboxUnavailable(f"the sandbox could not be set up here (bwrap said: {said}); {INSTALL}")
