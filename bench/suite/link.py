"""The limited link: the embedding servers in a network namespace behind a veth pair that ``tc tbf``
limits (sections network and torchrec)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator

from suite.common import log

NETNS, HOST_IF, NS_IF = "bagpipe-bench", "bpb-host", "bpb-ns"
HOST_IP, NS_IP = "10.231.0.1", "10.231.0.2"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def limited_link(rate: str) -> Iterator[str | None]:
    """A network namespace joined by a veth pair whose both directions ``tc tbf`` limits to ``rate``.
    Yields the namespace's name, or None (with the reason logged) where it cannot be set up here: it
    needs root, iproute2, and a kernel with network namespaces, veth pairs and the tbf qdisc."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        log(f"network-bound regime skipped: {' and '.join(missing)} not found (iproute2 is not installed)")
        yield None
        return
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    try:
        set_up_link(rate)
    except (subprocess.CalledProcessError, OSError) as e:
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
        reason = getattr(e, "stderr", "") or str(e)
        log(f"network-bound regime skipped: cannot set up the limited link ({reason.strip()})")
        yield None
        return
    try:
        yield NETNS
    finally:
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


def set_up_link(rate: str) -> None:
    sh("ip", "netns", "add", NETNS)
    sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
    sh("ip", "link", "set", NS_IF, "netns", NETNS)
    sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
    sh("ip", "link", "set", HOST_IF, "up")
    for cmd in (
        ["ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF],
        ["ip", "link", "set", NS_IF, "up"],
        ["ip", "link", "set", "lo", "up"],
    ):
        sh("ip", "netns", "exec", NETNS, *cmd)
    burst = {"10gbit": "4mb", "1gbit": "1mb"}.get(rate, "256kb")  # (about 3 ms of the rate, at least)
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", "20ms"]
    sh("tc", "qdisc", "add", "dev", HOST_IF, *tbf)
    sh("ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", NS_IF, *tbf)
