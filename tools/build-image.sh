#!/usr/bin/env bash
# Build the bagpipe image with ENGINE (docker, podman or buildah): tools/build-image.sh ENGINE VARIANT TAG
#   VARIANT: cpu or a CUDA build of torch (cu128, ...)
# Environment (the Makefile passes its variables of the same names):
#   BASE_IMAGE    the base (default: the official python image). When it is the default and cannot be
#                 pulled (no image registry reachable), the base is made from Debian's packages instead
#                 (tools/debian-base-image.sh, as DEBIAN_BASE), once.
#   TORCH_SOURCE  a package index with torch, or `wheels`; empty: the wheels in TORCH_WHEELS when one is
#                 torch 2.13.0 of this variant, else PyTorch's index for the variant
#   TORCH_WHEELS  a folder of wheel files (default: pip's find-links here, when it is a folder)
# pip inside the build uses this host's pip configuration: its index (index-url) and the certificates it
# trusts (cert: a proxy's own authority, say), so that an image builds where this host's pip installs.
set -euo pipefail
engine=${1:?usage: $0 ENGINE VARIANT TAG}
variant=${2:?usage: $0 ENGINE VARIANT TAG}
tag=${3:?usage: $0 ENGINE VARIANT TAG}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
default_base=docker.io/library/python:3.11.14-slim-bookworm
base=${BASE_IMAGE:-$default_base}
debian_base=${DEBIAN_BASE:-localhost/bagpipe-base:bookworm}
build=("$engine" build)
[ "$(basename "$engine")" = buildah ] && build=("$engine" bud)

has_image() {
  if [ "$(basename "$engine")" = buildah ]; then "$engine" inspect --type image "$1" >/dev/null 2>&1
  else "$engine" image inspect "$1" >/dev/null 2>&1; fi
}
if ! has_image "$base" && ! "$engine" pull -q "$base" >/dev/null 2>&1; then
  if [ "$base" != "$default_base" ]; then
    echo "$0: cannot pull the base image $base (BASE_IMAGE)" >&2
    exit 1
  fi
  echo "cannot pull $base: the base image is $debian_base, made from Debian's packages (make base-image)"
  has_image "$debian_base" || tools/debian-base-image.sh "$engine" "$debian_base"
  base=$debian_base
fi

# a value of this host's pip configuration: its environment first, then its files
pip_config() { python3 -m pip config list 2>/dev/null | sed -n "s/^\(:env:\|global\)\.$1='\(.*\)'$/\2/p" | head -n 1; }
mkdir -p docker/pip
rm -f docker/pip/*.pem
cert=$(pip_config cert)
[ -n "$cert" ] && [ -f "$cert" ] && cp "$cert" docker/pip/cert.pem
index=$(pip_config index-url)

wheels=${TORCH_WHEELS:-$(pip_config find-links)}
source=${TORCH_SOURCE:-}
rm -f docker/wheels/*.whl
if [ -z "$source" ] || [ "$source" = wheels ]; then
  found=()
  if [ -n "$wheels" ] && [ -d "$wheels" ]; then
    shopt -s nullglob
    found=("$wheels"/torch-2.13.0+"$variant"-*.whl)
    shopt -u nullglob
  fi
  if [ ${#found[@]} -gt 0 ]; then
    ln "${found[@]}" docker/wheels/ 2>/dev/null || cp "${found[@]}" docker/wheels/
    source=wheels
    echo "torch from ${found[*]}"
  elif [ "$source" = wheels ]; then
    echo "$0: TORCH_SOURCE=wheels but no torch-2.13.0+$variant wheel in '${wheels}' (TORCH_WHEELS)" >&2
    exit 1
  else
    source=https://download.pytorch.org/whl/$variant
  fi
fi
trap 'rm -f docker/wheels/*.whl docker/pip/*.pem' EXIT
# the image TAG named before this build: once TAG names the new one, the old one is removed, so that
# rebuilds (every `make cluster-test`) do not pile up untagged images; one a container still uses stays
previous=$("$engine" images -q "$tag" 2>/dev/null | head -n 1)
"${build[@]}" -f docker/Dockerfile --build-arg BASE_IMAGE="$base" --build-arg TORCH_VARIANT="$variant" \
  --build-arg TORCH_SOURCE="$source" --build-arg PIP_INDEX_URL="${index:-https://pypi.org/simple}" -t "$tag" .
now=$("$engine" images -q "$tag" 2>/dev/null | head -n 1)
if [ -n "$previous" ] && [ "$previous" != "$now" ]; then
  if "$engine" rmi "$previous" >/dev/null 2>&1; then echo "removed the previous $tag ($previous)"
  else echo "kept the previous $tag ($previous): in use or tagged again"; fi
fi
