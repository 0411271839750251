"""Key files and key derivation. Fail closed: no key, no service.

- The cluster key (`keys/cluster.key`) signs admin and events traffic.
- Each launch gets a 32-byte control secret in a 0600 file; per-channel keys are
  derived from it with HKDF-SHA256, bound to deployment, job and channel, so a rank
  of an old launch cannot talk to a new one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from common.deployment_info import DeploymentInfo, read_deployment_info
from common.envelope import Key

KEY_BYTES = 32
CHANNELS = ("requests", "plan", "control", "report")


class KeyFileError(Exception):
    """A key file is missing, unreadable, malformed or too permissive."""


def _write_secret_file(path: Path, data: bytes, *, overwrite: bool) -> None:
    """Write `data` to a 0600 file atomically. Without `overwrite` the final step is
    `os.link`, which fails if the file exists: two processes creating the same key at
    once (first `lockstep up`) end up sharing one key instead of the last one silently
    replacing a key the other already loaded."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    exists = KeyFileError(f"{path} already exists (use --force to replace it)")
    if path.exists() and not overwrite:
        raise exists
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise exists from None
        except OSError:  # filesystem without hard links: best effort
            if path.exists():
                raise exists from None
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def generate_key_file(path: Path, *, overwrite: bool = False) -> None:
    _write_secret_file(Path(path), secrets.token_hex(KEY_BYTES).encode() + b"\n", overwrite=overwrite)


def read_secret_file(path: Path) -> bytes:
    """Read a hex secret from a 0600 file; refuse anything else."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise KeyFileError(f"key file {path} does not exist (run `lockstep keygen`)") from None
    except OSError as exc:
        raise KeyFileError(f"key file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"key file {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be 0600 (chmod 600 {path})"
        )
    try:
        text = path.read_text().strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError):
        raise KeyFileError(f"key file {path} is not a hex secret") from None
    if len(secret) < 16:
        raise KeyFileError(f"key file {path} holds only {len(secret)} bytes (need >= 16)")
    return secret


def load_cluster_key(path: Path) -> Key:
    return Key.from_secret(read_secret_file(path))


def ensure_cluster_key(path: Path) -> Key:
    """Create the cluster key on first use (`lockstep up`), then load it strictly."""
    path = Path(path)
    if not path.exists():
        try:
            generate_key_file(path)
        except KeyFileError:
            if not path.exists():
                raise
            # another process created it first: use theirs
    return load_cluster_key(path)


def new_launch_secret(path: Path) -> bytes:
    secret = secrets.token_bytes(KEY_BYTES)
    _write_secret_file(Path(path), secret.hex().encode() + b"\n", overwrite=False)
    return secret


def derive_key(secret: bytes, channel: str, *, deployment_id: str, job_id: str, extra: str = "") -> Key:
    """Per-channel key from the launch secret; `extra` binds rank and direction."""
    # Each part length-prefixed: ("a/b", "c") and ("a", "b/c") must not derive one key.
    parts = [p.encode() for p in (channel, deployment_id, job_id, extra)]
    info = b"lockstep/v1" + b"".join(len(p).to_bytes(2, "big") + p for p in parts)
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"lockstep-launch", info=info)
    return Key.from_secret(hkdf.derive(secret))


class LaunchKeys:
    """All channel keys of one launch."""

    def __init__(self, secret: bytes, deployment_id: str, job_id: str) -> None:
        self.deployment_id = deployment_id
        self.job_id = job_id
        self._secret = secret
        for ch in CHANNELS:
            setattr(self, ch, derive_key(secret, ch, deployment_id=deployment_id, job_id=job_id))

    def session(self, rank: int, direction: str) -> Key:
        """Handshake key bound to one rank and one direction ("up" / "down")."""
        return derive_key(self._secret, "session", deployment_id=self.deployment_id,
                          job_id=self.job_id, extra=f"{rank}/{direction}")

    def __repr__(self) -> str:
        return f"LaunchKeys({self.deployment_id}/{self.job_id})"


def kv_cache_key(cluster_key: Key) -> bytes:
    """The key the prefix cache's disk files are MACed with (services/rank/disk_tier.py):
    derived from the cluster key, so it outlives launches; ranks never hold the cluster
    key itself, and each file's MAC also binds model, placement, rank and entry."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"lockstep-kvcache",
                info=b"lockstep/v1 prefix cache on disk")
    return hkdf.derive(cluster_key.secret)


# --- keys handed out over the admin channel ------------------------------------------
# The admin channel is authenticated (HMAC with the cluster key) but not encrypted. A key
# it carries (the requests key the gateway needs) is sealed with AES-GCM under a key
# derived from the cluster key and bound to the launch, so it never appears in clear in
# a reply, in `lockstep admin status --json`, or to anyone watching the admin link.


def _seal_aead(cluster_key: Key) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"lockstep-seal",
                info=b"lockstep/v1 sealed launch key")
    return AESGCM(hkdf.derive(cluster_key.secret))


def seal_key(cluster_key: Key, key: Key, *, context: str) -> str:
    """Hex of nonce ‖ AES-GCM(key.secret), `context` (e.g. "dep/job") as associated data."""
    nonce = secrets.token_bytes(12)
    return (nonce + _seal_aead(cluster_key).encrypt(nonce, key.secret, context.encode())).hex()


def unseal_key(cluster_key: Key, sealed: str, *, context: str) -> Key:
    """The sealed key; KeyFileError if it was not sealed by this cluster key for `context`."""
    try:
        raw = bytes.fromhex(sealed)
        secret = _seal_aead(cluster_key).decrypt(raw[:12], raw[12:], context.encode())
    except (ValueError, InvalidTag):
        raise KeyFileError(f"sealed key for {context} does not open with this cluster key") \
            from None
    return Key.from_secret(secret)


def requests_key_of(info: DeploymentInfo | dict, cluster_key: Key) -> Key:
    """The requests key of a DeploymentInfo (admin `status` / `deployments`), as the
    supervisor sealed it (`requests_key_sealed`); a dict is read strictly first. Raises
    DeploymentInfoError (a ValueError) for a malformed info, KeyFileError if no key is
    sealed in it or it does not open with `cluster_key`."""
    if not isinstance(info, DeploymentInfo):
        info = read_deployment_info(info)
    context = f"{info.deployment_id}/{info.job_id}"
    if not info.requests_key_sealed:
        raise KeyFileError(f"deployment {context} has no requests key yet")
    return unseal_key(cluster_key, info.requests_key_sealed, context=context)
