"""The wheel and the sdist: ``python -m build`` makes both from this checkout (the wheel from the
sdist, so the sdist is complete enough to build it), and the wheel installed in a fresh
virtualenv runs there, nothing imported from the checkout: ``radixlang --version``, the native
kernels compiled from the installed package's sources into a fresh cache, and an example program
shipped in the sdist (``examples/tree_of_thought.py``) under the installed ``radixlang run``, on
a tiny random chat model.

The fresh venv gets the dependencies already present without reinstalling them: after the wheel
is installed (``--no-deps --no-index``, offline), a ``.pth`` file lists this venv's
site-packages after the fresh one's. Nothing of this venv's editable radixlang leaks in: its
finder is installed by a ``.pth`` of this venv's own, which Python never processes in a folder
that a ``.pth`` added, and its dist-info comes after the wheel's; the test asserts both.

``pytest -s tests/packaging/test_wheel.py`` prints every command run in the fresh venv and its
output.
"""

from __future__ import annotations

import os
import re
import shlex
import site
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from radixlang.kernels import native_build
from radixlang.version import __version__

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "radixlang"
WHEEL = f"radixlang-{__version__}-py3-none-any.whl"
SDIST = f"radixlang-{__version__}.tar.gz"
EXAMPLE = "examples/tree_of_thought.py"


def run(cmd: list[str], *, timeout: float = 300, check: bool = True, **kwargs):
    """Run ``cmd``, print it, its time and its output (pytest -s shows them), and return it."""
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    seconds = time.perf_counter() - start
    print(f"\n$ {shlex.join(cmd)}    # exit {done.returncode}, {seconds:.1f} s")
    for name, text in (("stdout", done.stdout), ("stderr", done.stderr)):
        if text.strip():
            print(f"[{name}]\n{text.rstrip()}")
    if check:
        assert done.returncode == 0, f"{shlex.join(cmd)} failed:\n{done.stderr[-4000:]}"
    return done


def package_files() -> set[str]:
    """The checkout's package files as wheel paths: modules and data, no caches or builds."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.suffix not in (".pyc", ".so", ".o", ".tmp")
    }


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> Path:
    """The sdist and the wheel (built from the sdist), in a folder of their own."""
    pytest.importorskip("build", reason="build is not installed (pip install 'radixlang[dev]')")
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the venv's setuptools, nothing fetched. Output only on failure (long).
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(f"\n$ {shlex.join(cmd)}    # in {ROOT}, {time.perf_counter() - start:.1f} s")
    print(done.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in out.iterdir()) == sorted([SDIST, WHEEL])
    return out


def test_the_wheel_holds_the_package_and_nothing_else_and_the_sdist_the_examples(dists):
    info = f"radixlang-{__version__}.dist-info/"
    with zipfile.ZipFile(dists / WHEEL) as wheel:
        names = wheel.namelist()
        entry_points = wheel.read(info + "entry_points.txt").decode()
    # Every module and data file of the package (native sources, the dashboard's page) ...
    assert {n for n in names if not n.startswith(info)} == package_files()
    for wanted in ("kernels/native/paged_attention.cpp", "kernels/native/floats.h",
                   "server/dashboard_static/index.html", "cli/__main__.py"):  # fmt: skip
        assert f"radixlang/{wanted}" in names
    # ... and besides them only the metadata and the license: no tests, benchmarks, examples.
    metadata = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt", "RECORD")
    assert {n for n in names if n.startswith(info)} == {
        info + f for f in (*metadata, "licenses/LICENSE")
    }
    assert "radixlang = radixlang.cli:main" in entry_points

    top = f"radixlang-{__version__}/"
    with tarfile.open(dists / SDIST) as sdist:
        members = [m.removeprefix(top) for m in sdist.getnames()]
    assert {"README.md", "LICENSE", "pyproject.toml", "MANIFEST.in", EXAMPLE} <= set(members)
    assert package_files() <= set(members)
    assert {m for m in members if m.startswith("examples/")} >= {
        path.relative_to(ROOT).as_posix() for path in (ROOT / "examples").glob("*.py")
    }
    assert not [m for m in members if m.startswith(("tests/", "benchmarks/", ".venv/"))]
    assert not [m for m in members if "__pycache__" in m or m.endswith((".pyc", ".so"))]


def fresh_env(cache: Path) -> dict[str, str]:
    """The environment of the fresh venv's commands: nothing from the checkout on the path, no
    venv of the test's own, and a native-kernel cache of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("RADIXLANG_NATIVE", None)  # the kernels are tried here
    env.update(
        RADIXLANG_CACHE=str(cache),
        PYTHONNOUSERSITE="1",
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        HF_HUB_OFFLINE="1",
    )
    return env


# Run by the fresh venv's python: where the package, its metadata and its native sources are.
WHERE = """
import importlib.metadata, sys
from pathlib import Path
import radixlang
from radixlang.kernels import native_build
dist = importlib.metadata.distribution("radixlang")
print("radixlang.__file__", radixlang.__file__)
print("metadata", dist.version, dist._path)
print("native sources", native_build.SOURCE_DIR)
print("native cache", native_build.cache_root())
prefix = Path(sys.prefix).resolve()
for path in (radixlang.__file__, dist._path, native_build.SOURCE_DIR):
    assert Path(path).resolve().is_relative_to(prefix), (path, prefix)
assert dist.version == radixlang.__version__
"""

# After the example: the kernel it used was built from the installed sources and loads.
NATIVE = """
from radixlang.kernels import native, native_build
path = native_build.library_path("paged_attention", native_build.find_compiler())
print("library", path, "exists" if path.exists() else "MISSING")
assert path.exists()
print("native attention available:", native.available())
assert native.available()
"""


def test_the_wheel_installs_in_a_fresh_venv_and_runs_an_example(dists, chat_model_dir, tmp_path):
    start = time.perf_counter()
    venv, work, cache = tmp_path / "venv", tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    env = fresh_env(cache)
    python, radixlang = str(venv / "bin" / "python"), str(venv / "bin" / "radixlang")

    run([sys.executable, "-m", "venv", str(venv)], env=env)
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", str(dists / WHEEL)], env=env)
    # The dependencies already present: this venv's site-packages, after the fresh one's.
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                  env=env).stdout.strip()  # fmt: skip
    here = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "_radixlang_test_deps.pth").write_text("".join(f"{p}\n" for p in here))
    print(f"\n{purelib}/_radixlang_test_deps.pth lists {here}")

    # The console script, and where the package it imports lies.
    version = run([radixlang, "--version"], env=env, cwd=work).stdout.strip()
    assert version == f"radixlang {__version__}"
    where = run([python, "-c", WHERE], env=env, cwd=work).stdout
    assert f"metadata {__version__} " in where

    # The example from the sdist, under the installed `radixlang run`, on the tiny model. The
    # native cache is empty: the kernels it uses are compiled from the installed sources.
    with tarfile.open(dists / SDIST) as sdist:
        member = sdist.extractfile(f"radixlang-{__version__}/{EXAMPLE}")
        (work / "tree_of_thought.py").write_bytes(member.read())
    assert not cache.exists()
    cmd = [radixlang, "run", "tree_of_thought.py", "--model", str(chat_model_dir), "--"]
    cmd += ["--branching", "2", "--depth", "2", "--max-tokens", "8"]
    done = run(cmd, env=env, cwd=work)
    assert "4 leaves" in done.stdout and "the vote's winner" in done.stdout
    assert len(re.findall(r"Step 2: .*\[(yes|no), P\(yes\)=[\d.]+\]", done.stdout)) == 4
    m = re.search(r"prompt tokens \d+: (\d+) reused from the cache, (\d+) computed", done.stderr)
    assert m and int(m[1]) > int(m[2]) > 0  # the tree's prompts share their prefixes
    assert "unavailable, using torch" not in done.stderr

    built = sorted(p.name for p in (cache / "native").glob("*.so")) if cache.exists() else []
    print(f"\nnative libraries built into {cache / 'native'}: {built}")
    try:
        native_build.find_compiler()
    except native_build.NativeBuildError as exc:  # no compiler: the torch path ran (honestly)
        print(f"no native build here: {exc}")
        assert not built
    else:
        assert any(name.startswith("paged_attention-") for name in built)
        run([python, "-c", NATIVE], env=env, cwd=work)
    print(f"\nfresh venv: {time.perf_counter() - start:.1f} s")
