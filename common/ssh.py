"""Running commands on another host over ssh, never waiting on a prompt or forever.

Every ssh here runs in batch mode (a missing key or an unknown host key fails at once
instead of asking), with a connect timeout and keep-alives (a host that vanishes
mid-command is noticed within ServerAliveInterval x ServerAliveCountMax seconds), and
under a deadline that kills it. ssh joins the remote argv with spaces and hands the
string to the remote user's login shell, so each argument is quoted here.

Secrets and environment never travel on a command line (anyone on either host can read
argv in /proc): send them as `input` (stdin), e.g. to `services.hostagent`.

A target whose host is 127.0.0.1, localhost or ::1 is this machine: `run` executes the
argv directly, without ssh or a shell.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
from dataclasses import KW_ONLY, dataclass
from typing import Any

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
# ssh exits 255 for its own errors (connect, auth, host key); otherwise with the
# remote command's status.
SSH_ERROR_STATUS = 255
_KILL_GRACE = 2.0  # after a kill, how long to wait for ssh to be reaped


class SshError(Exception):
    """A remote command that could not run or did not answer; names the target."""

    def __init__(self, target: str, what: str, *, returncode: int | None = None,
                 stderr: str = "") -> None:
        super().__init__(target, what)
        self.target = target
        self.what = what
        self.returncode = returncode
        self.stderr = stderr

    def __str__(self) -> str:
        tail = f": {self.stderr.strip()[-400:]}" if self.stderr.strip() else ""
        return f"ssh {self.target}: {self.what}{tail}"


class SshTimeout(SshError):
    """The command did not finish before its deadline; ssh was killed."""


@dataclass(frozen=True)
class SshTarget:
    """Where to run: `target` as ssh takes it (`[user@]host` or a config alias), and how.

    `options` are extra `-o Key=Value` strings, applied before the defaults here, so they
    win (ssh takes the first value it sees for an option)."""

    target: str
    _: KW_ONLY
    config_file: str | None = None
    connect_timeout: float = 5.0
    server_alive_interval: int = 5
    server_alive_count_max: int = 3
    options: tuple[str, ...] = ()
    ssh_binary: str = "ssh"

    def __post_init__(self) -> None:
        # A target starting with "-" would be read by ssh as an option
        # (e.g. -oProxyCommand=...): refuse it rather than quote it.
        if not self.target or self.target.startswith("-") or any(c.isspace() for c in self.target):
            raise ValueError(f"invalid ssh target {self.target!r}")
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0, not {self.connect_timeout!r}")
        object.__setattr__(self, "options", tuple(self.options))
        for opt in self.options:
            if "=" not in opt or opt.startswith("-"):
                raise ValueError(f"ssh option {opt!r}: expected Key=Value")

    @property
    def host(self) -> str:
        """The host part: `target` without `user@`, and without [] around an IPv6 address."""
        host = self.target.rpartition("@")[2]
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host

    def __str__(self) -> str:
        return self.target


def _as_target(target: SshTarget | str) -> SshTarget:
    return target if isinstance(target, SshTarget) else SshTarget(target)


def is_local(target: SshTarget | str) -> bool:
    """True for 127.0.0.1, localhost and ::1 (with or without `user@`): run without ssh.
    The user part is not compared: a local launch runs as the supervisor's own user."""
    return _as_target(target).host in LOCAL_HOSTS


def ssh_argv(target: SshTarget | str, remote_argv: list[str]) -> list[str]:
    """The ssh command line that runs `remote_argv` on `target`.

    Each remote argument is shell-quoted: ssh sends one string that the remote login
    shell splits again, so an unquoted argument with a space or `;` would be re-split
    or run as a command."""
    t = _as_target(target)
    if not remote_argv:
        raise ValueError("remote_argv is empty: an ssh without a command opens a shell")
    argv = [t.ssh_binary]
    if t.config_file is not None:
        argv += ["-F", os.fspath(t.config_file)]
    for opt in t.options:
        argv += ["-o", opt]
    argv += [
        "-o", "BatchMode=yes",  # never prompt for a password or passphrase
        "-o", f"ConnectTimeout={max(1, math.ceil(t.connect_timeout))}",  # whole seconds
        "-o", f"ServerAliveInterval={t.server_alive_interval}",
        "-o", f"ServerAliveCountMax={t.server_alive_count_max}",
        "-T",  # no pty: the remote command sees EOF on stdin, no terminal signals
        t.target,
        "--",  # ssh re-parses options after the host; this ends them
        *(shlex.quote(str(a)) for a in remote_argv),
    ]
    return argv


def command_argv(target: SshTarget | str, argv: list[str]) -> list[str]:
    """`argv` itself for a local target, else the ssh command line that runs it."""
    return list(argv) if is_local(target) else ssh_argv(target, argv)


def run(target: SshTarget | str, remote_argv: list[str], *, input: bytes | None = None,
        timeout: float) -> subprocess.CompletedProcess[bytes]:
    """Run `remote_argv` on `target` (locally if `is_local`), feeding `input` on stdin,
    and return its status and output. ssh's own failures (unreachable, refused key)
    come back as returncode 255, not as an exception; SshError if ssh cannot even be
    started (callers catch SshError, never a stray OSError). SshTimeout if the command has not
    finished within `timeout` seconds: ssh (its whole process group) is killed first.

    Killing ssh ends the connection; a remote command that ignores the lost connection
    may go on running on the remote host: a caller that needs it gone signals it there."""
    t = _as_target(target)
    argv = command_argv(t, remote_argv)
    # A new session: ssh cannot open our terminal to ask anything (BatchMode already
    # forbids it), and the kill below reaches a ProxyCommand child too.
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if input is None
                                else subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:  # no ssh binary, no fork (EAGAIN), no fds: a failed call too
        raise SshError(t.target, f"cannot start {argv[0]}: {exc}") from None
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=_KILL_GRACE)
        except subprocess.TimeoutExpired:  # a descendant holds the pipes open
            out, err = b"", b""
        raise SshTimeout(t.target, f"{_show(remote_argv)} did not finish within {timeout}s",
                         stderr=err.decode(errors="replace")) from None
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own group: start_new_session above
    except ProcessLookupError:
        pass


def _show(argv: list[str]) -> str:
    text = shlex.join(argv)
    return text if len(text) <= 120 else text[:117] + "..."


def run_json(target: SshTarget | str, remote_argv: list[str], *, input: bytes | None = None,
             timeout: float) -> Any:
    """Run a command that answers with one JSON document as the last line of its stdout
    (e.g. `services.hostagent`), and return it parsed. SshError if ssh failed, the
    command exited non-zero, or the answer is not JSON. Only the last line is parsed, so
    a login script that prints something on the remote host does not break the answer."""
    t = _as_target(target)
    cp = run(t, remote_argv, input=input, timeout=timeout)
    stdout = cp.stdout.decode(errors="replace")
    stderr = cp.stderr.decode(errors="replace")
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if cp.returncode != 0:
        what = ("ssh failed (unreachable, refused or host key mismatch)"
                if cp.returncode == SSH_ERROR_STATUS and not is_local(t)
                else f"{_show(remote_argv)} exited with status {cp.returncode}")
        detail = lines[-1] if lines else ""
        raise SshError(t.target, what, returncode=cp.returncode,
                       stderr="\n".join(s for s in (detail, stderr) if s))
    if not lines:
        raise SshError(t.target, f"{_show(remote_argv)} printed no answer", stderr=stderr)
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise SshError(t.target, f"{_show(remote_argv)} answered with something not JSON: "
                       f"{lines[-1][:200]!r}", stderr=stderr) from None
