"""Key files fail closed; derived launch keys are deterministic and separated."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.envelope import Key, RejectCounter, Verifier
from common.keys import (
    CHANNELS,
    KeyFileError,
    LaunchKeys,
    derive_key,
    ensure_cluster_key,
    generate_key_file,
    load_cluster_key,
    new_launch_secret,
    read_secret_file,
)
from common.messages import ADMIN_IN

REPO = Path(__file__).resolve().parents[2]
SECRET = bytes(range(32))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask():
    """Prove 0600 comes from the code, not from a friendly umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_keygen_writes_0600(tmp_path, open_umask):
    path = tmp_path / "keys" / "cluster.key"
    generate_key_file(path)
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    text = path.read_text()
    assert text.endswith("\n") and len(bytes.fromhex(text.strip())) == 32
    assert [p.name for p in path.parent.iterdir()] == ["cluster.key"]  # no temp file left
    assert load_cluster_key(path) == Key.from_secret(bytes.fromhex(text.strip()))


def test_keygen_refuses_to_overwrite(tmp_path):
    path = tmp_path / "cluster.key"
    generate_key_file(path)
    before = path.read_bytes()
    with pytest.raises(KeyFileError, match="--force"):
        generate_key_file(path)
    assert path.read_bytes() == before
    generate_key_file(path, overwrite=True)
    assert path.read_bytes() != before and mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.key"]


@pytest.mark.parametrize("perm", [0o644, 0o640, 0o604, 0o660, 0o666, 0o601])
def test_permissive_key_file_is_refused(tmp_path, perm):
    path = tmp_path / "cluster.key"
    generate_key_file(path)
    path.chmod(perm)
    with pytest.raises(KeyFileError, match=r"chmod 600") as info:
        load_cluster_key(path)
    assert str(path) in str(info.value) and f"{perm:o}" in str(info.value)
    path.chmod(0o600)
    assert isinstance(load_cluster_key(path), Key)


def test_missing_key_fails_closed(tmp_path):
    with pytest.raises(KeyFileError, match="lockstep keygen"):
        load_cluster_key(tmp_path / "nope.key")
    with pytest.raises(KeyFileError):
        read_secret_file(tmp_path / "nope.key")


def test_directory_is_not_a_key(tmp_path):
    d = tmp_path / "cluster.key"
    d.mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_cluster_key(d)


@pytest.mark.parametrize(("content", "needle"), [("not hex at all\n", "not a hex secret"),
                                                 ("", "only 0 bytes"),
                                                 ("00ff\n", "only 2 bytes")])
def test_malformed_key_is_refused(tmp_path, content, needle):
    path = tmp_path / "cluster.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content.encode())
    os.close(fd)
    with pytest.raises(KeyFileError, match=needle):
        load_cluster_key(path)


def test_verifier_with_no_keys_raises():
    with pytest.raises(ValueError, match="fail closed"):
        Verifier([], ADMIN_IN, RejectCounter("test", "keys"))


def test_ensure_cluster_key_creates_once(tmp_path):
    path = tmp_path / "home" / "keys" / "cluster.key"
    first = ensure_cluster_key(path)
    assert mode(path) == 0o600
    assert ensure_cluster_key(path) == first


def test_ensure_cluster_key_concurrent_first_use_agrees(tmp_path):
    """Services started together (`lockstep up`) must all end up with the same key."""
    for round_ in range(20):
        path = tmp_path / f"r{round_}" / "cluster.key"
        barrier = threading.Barrier(6)
        keys: list[Key] = []

        def worker(path=path, barrier=barrier, keys=keys):
            barrier.wait()
            keys.append(ensure_cluster_key(path))

        threads = [threading.Thread(target=worker) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(keys) == 6
        assert len({k.key_id for k in keys}) == 1, f"round {round_}: keys differ"
        assert load_cluster_key(path) == keys[0]
        assert sorted(p.name for p in path.parent.iterdir()) == ["cluster.key"]


def test_launch_secret_file(tmp_path, open_umask):
    path = tmp_path / "runtime" / "secrets" / "job-1.key"
    secret = new_launch_secret(path)
    assert len(secret) == 32 and mode(path) == 0o600
    assert read_secret_file(path) == secret
    with pytest.raises(KeyFileError):
        new_launch_secret(path)
    assert read_secret_file(path) == secret


def test_derived_keys_are_deterministic():
    a = derive_key(SECRET, "plan", deployment_id="dep-1", job_id="job-1")
    b = derive_key(SECRET, "plan", deployment_id="dep-1", job_id="job-1")
    assert a == b and len(a.secret) == 32
    assert LaunchKeys(SECRET, "dep-1", "job-1").plan == a


def test_derived_keys_differ_per_channel_deployment_job_and_secret():
    base = {"deployment_id": "dep-1", "job_id": "job-1"}
    keys = {
        ("channel", ch): derive_key(SECRET, ch, **base) for ch in (*CHANNELS, "session")
    }
    keys["deployment"] = derive_key(SECRET, "plan", deployment_id="dep-2", job_id="job-1")
    keys["job"] = derive_key(SECRET, "plan", deployment_id="dep-1", job_id="job-2")
    keys["secret"] = derive_key(bytes(32), "plan", **base)
    keys["extra"] = derive_key(SECRET, "plan", **base, extra="0/up")
    # No field-boundary ambiguity: the ids are separated, not just concatenated.
    keys["shift"] = derive_key(SECRET, "plan", deployment_id="dep-1/job-1", job_id="")
    keys["shift2"] = derive_key(SECRET, "plan", deployment_id="dep-1", job_id="job-1/")
    secrets_ = [k.secret for k in keys.values()]
    ids = [k.key_id for k in keys.values()]
    assert len(set(secrets_)) == len(secrets_)
    assert len(set(ids)) == len(ids)
    assert SECRET not in secrets_


def test_launch_keys_channels_and_sessions():
    lk = LaunchKeys(SECRET, "dep-1", "job-1")
    channel_keys = [getattr(lk, ch) for ch in CHANNELS]
    sessions = [lk.session(r, d) for r in (0, 1, 2) for d in ("up", "down")]
    all_ids = {k.key_id for k in channel_keys + sessions}
    assert len(all_ids) == len(CHANNELS) + 6
    assert lk.session(1, "up") == LaunchKeys(SECRET, "dep-1", "job-1").session(1, "up")
    other_launch = LaunchKeys(SECRET, "dep-1", "job-2")
    assert not {getattr(other_launch, ch).key_id for ch in CHANNELS} & all_ids
    assert SECRET.hex() not in repr(lk) and "dep-1" in repr(lk)


def run_cli(*args: str, env: dict[str, str] | None = None, console: bool = False):
    exe = ([str(REPO / ".venv" / "bin" / "lockstep")] if console
           else [sys.executable, "-m", "services"])
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([*exe, *args], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("console", [False, True], ids=["python-m", "console-script"])
def test_lockstep_keygen_command(tmp_path, console):
    if console and not (REPO / ".venv" / "bin" / "lockstep").exists():
        pytest.skip("console script not installed")
    home = tmp_path / "home"
    key = home / "keys" / "cluster.key"
    r = run_cli("keygen", "--home", str(home), console=console)
    assert r.returncode == 0, r.stderr
    assert str(key) in r.stdout and mode(key) == 0o600
    first = key.read_bytes()
    assert isinstance(load_cluster_key(key), Key)

    r = run_cli("keygen", "--home", str(home), console=console)
    assert r.returncode != 0
    assert "already exists" in r.stdout + r.stderr and "--force" in r.stdout + r.stderr
    assert key.read_bytes() == first

    r = run_cli("keygen", "--home", str(home), "--force", console=console)
    assert r.returncode == 0, r.stderr
    assert key.read_bytes() != first and mode(key) == 0o600


@pytest.mark.timeout(60)
def test_lockstep_keygen_uses_lockstep_home(tmp_path):
    home = tmp_path / "envhome"
    r = run_cli("keygen", env={"LOCKSTEP_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert mode(home / "keys" / "cluster.key") == 0o600
