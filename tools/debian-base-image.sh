#!/usr/bin/env bash
# Make the image's base from Debian's packages alone, for a build host that reaches no image registry:
# a minimal bookworm root (Python 3.11, venv, certificates, OpenMP for torch and numba), imported into the container engine as NAME.
#   tools/debian-base-image.sh ENGINE NAME [MIRROR]
# MIRROR defaults to the first Debian mirror apt is configured with here, else deb.debian.org. Needs root
# (debootstrap) and debootstrap itself (apt-get install debootstrap).
set -euo pipefail
engine=${1:?usage: $0 ENGINE NAME [MIRROR]}
name=${2:?usage: $0 ENGINE NAME [MIRROR]}
mirror=${3:-}
if [ -z "$mirror" ]; then
  mirror=$( (grep -hsE '^URIs:.*/debian/?$' /etc/apt/sources.list.d/*.sources
             grep -hsE '^deb .*/debian/? ' /etc/apt/sources.list || true) |
            awk '{for (i = 1; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' | head -n 1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
command -v debootstrap >/dev/null || { echo "$0: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
root=$(mktemp -d "${TMPDIR:-/tmp}/bagpipe-base.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm from $mirror into $root"
debootstrap --variant=minbase \
  --include=python3,python3-venv,python-is-python3,ca-certificates,libgomp1 \
  bookworm "$root" "$mirror" >/dev/null
# an image, not a system: no package lists, docs or caches, and a package installed later starts no
# service (what Debian's own images do)
chroot "$root" apt-get clean
printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/var/cache/*/*
tar -C "$root" -c . | "$engine" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$name"
echo "base image $name made from Debian bookworm ($mirror)"
