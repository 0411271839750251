"""`ip` (iproute2) for the network-namespace hosts (tests/netns/hosts.py): running it,
picking a /24 nothing on this machine uses, and tying a child's life to ours."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import random
import signal
import subprocess

SUBNET_PREFIX = "10.213"
_PR_SET_PDEATHSIG = 1


class NetnsError(RuntimeError):
    """The harness could not build (or fully remove) its hosts; says what and why."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and cp.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {cp.stderr.strip() or cp.returncode}")
    return cp


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for cmd in (["-j", "-4", "addr", "show"], ["-j", "-4", "route", "show", "table", "all"]):
        for entry in json.loads(ip(*cmd).stdout or "[]"):
            for a in entry.get("addr_info", []):
                nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
            dst = entry.get("dst")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def pick_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    """A 10.213.X.0/24 that no address or route on this machine overlaps."""
    used = _used_networks()
    for x in rng.sample(range(256), 256):
        net = ipaddress.ip_network(f"{SUBNET_PREFIX}.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError(f"no free /24 left in {SUBNET_PREFIX}.0.0/16")


# Resolved here, not in a forked child; Linux only (tests/netns/hosts.py, and so this
# module, is imported on macOS too, for its topology constants).
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def die_with_parent() -> None:
    # In the child before exec: if the harness is killed outright (no atexit), its
    # sshds get SIGTERM instead of running on. Survives the exec of `ip` and of sshd.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def netns_pids(ns: str) -> list[int]:
    cp = ip("netns", "pids", ns, check=False)
    return [int(p) for p in cp.stdout.split() if p.isdigit()] if cp.returncode == 0 else []
