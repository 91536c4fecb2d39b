"""Section ``network``: ideal, bagpipe and no-cache with the embedding servers in a network namespace
behind a veth link that ``tc tbf`` limits to each of the profile's ``rates`` (``--rates``); skipped,
saying why, where namespaces are not permitted. Its figures share section systems' table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from suite.compare import compare
from suite.link import HOST_IP, NS_IP, limited_link
from suite.report import Target


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """The three systems behind each link, or why there is no limited link here."""
    results: dict[str, Any] = {}
    for rate in profile["rates"]:
        with limited_link(rate) as ns:
            if ns is None:
                return {
                    "skipped": "no limited link here: it needs root, iproute2, and network namespaces, veth "
                    "and tbf in the kernel (the log says which was missing)"
                }
            results[rate] = compare(
                f"link-{rate}",
                profile,
                out,
                "--embedding-server-netns",
                ns,
                "--netns-addresses",
                f"{HOST_IP},{NS_IP}",
                repeats=profile.get("link_repeats", profile["repeats"]),
            )
    return results


def table(results: dict[str, Any]) -> list[str]:
    """Why the links were not measured, where they were not (their figures are in section systems')."""
    if results.get("network", {}).get("skipped"):
        return ["", f"Network-bound regime skipped: {results['network']['skipped']}"]
    return []


def targets(results: dict[str, Any]) -> tuple[list[Target], list[str]]:
    """bagpipe/ideal at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s, and no-cache/bagpipe at 1 Gbit/s."""
    rows: list[Target] = []
    notes: list[str] = []
    net = results.get("network", {})
    for rate in ("10gbit", "1gbit"):
        if rate in net:
            r = net[rate]["bagpipe_over_ideal"]
            rows.append((f"bagpipe/ideal at {rate} (median)", r, "<= 1.05", r <= 1.05))
    if "1gbit" in net:
        r = net["1gbit"]["no_cache_over_bagpipe"]
        rows.append(("no-cache/bagpipe at 1gbit (median)", r, ">= 2.5", r >= 2.5))
    if "bagpipe_over_ideal" in net.get("100mbit", {}):
        r = net["100mbit"]["bagpipe_over_ideal"]
        rows.append(("bagpipe/ideal at 100mbit (median)", r, "<= 1.10", r <= 1.10))
        notes.append(f"  (no-cache/bagpipe at 100mbit: {net['100mbit']['no_cache_over_bagpipe']:.2f}x)")
    return rows, notes
