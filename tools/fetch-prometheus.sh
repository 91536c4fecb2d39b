#!/usr/bin/env bash
# Unpacks Debian's prometheus package (prometheus and promtool binaries) into .tools/prometheus.
# No root needed: `apt-get download` fetches the .deb and `dpkg-deb -x` unpacks it.
set -euo pipefail
dest=${1:-.tools/prometheus}
if [[ -x $dest/usr/bin/promtool && -x $dest/usr/bin/prometheus ]]; then exit 0; fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "fetch-prometheus: needs apt-get and dpkg-deb (Debian/Ubuntu); otherwise put prometheus and promtool" \
         "on PATH or set BAGPIPE_PROMETHEUS and BAGPIPE_PROMTOOL" >&2
    exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download prometheus 2>/dev/null) || {
    # the package lists may be missing on a fresh machine; refreshing them needs root
    if [[ $(id -u) == 0 ]]; then apt-get update -qq && (cd "$tmp" && apt-get download prometheus); else
        echo "fetch-prometheus: 'apt-get download prometheus' failed; run 'apt-get update' as root first" >&2; exit 1
    fi
}
mkdir -p "$dest"
dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
mkdir -p "$dest/usr/bin"
cp "$tmp/root/usr/bin/prometheus" "$tmp/root/usr/bin/promtool" "$dest/usr/bin/"
"$dest/usr/bin/promtool" --version | head -1
