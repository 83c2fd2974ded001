"""The package's layout: each layer's public names resolve, the light imports stay light, and the
import-linter contracts in pyproject.toml catch an import that runs the wrong way."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
LAZY_PACKAGES = ("radixlang.runtime", "radixlang.server", "radixlang.lang.backends")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_exported_name_resolves_to_its_module(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._EXPORTS)
    for name in module.__all__:
        value = getattr(module, name)
        assert value.__module__ == module._EXPORTS[name], name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = module.nothing_here


# Python run in a fresh interpreter, each asserting what importing part of the package loads.
IMPORT_CHECKS = {
    # The runtime's public names resolve lazily: importing the package loads neither torch nor
    # the engine.
    "runtime_loads_no_engine": (
        "import sys\n"
        "import radixlang.runtime, radixlang.server\n"
        "assert 'torch' not in sys.modules, 'loaded torch'\n"
        "assert 'radixlang.runtime.engine' not in sys.modules, 'loaded the engine'\n"
        "from radixlang.runtime import Engine, GenerateRequest, SamplingParams\n"
        "assert Engine.__module__ == 'radixlang.runtime.engine'\n"
    ),
    # Ray is the replica set's alone (the ``ray`` extra): a single server and the router
    # never import it.
    "single_server_imports_no_ray": (
        "import sys\n"
        "import radixlang.cli, radixlang.server.app, radixlang.runtime.engine\n"
        "import radixlang.cluster.router, radixlang.cluster.prefix_index\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    ),
}


@pytest.mark.parametrize("name", sorted(IMPORT_CHECKS))
def test_imports_load_only_what_they_need(name):
    check = IMPORT_CHECKS[name]
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    # The copy comes first on the path, so grimp reads it instead of the installed package.
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.fixture()
def package_copy(tmp_path) -> Path:
    shutil.copytree(ROOT / "radixlang", tmp_path / "radixlang",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold_on_the_package(package_copy):
    result = lint_imports(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "wrong_import", "broken"),
    [
        # the engine core reaching up into the language
        ("runtime/scheduler.py", "from radixlang.lang import ir", "server and lang above runtime"),
        # a kernel reaching up into the engine
        ("kernels/layout.py", "import radixlang.runtime.block_pool", "server and lang above"),
        # the server reaching across into the language
        ("server/metrics.py", "import radixlang.lang.choices", "server and lang above runtime"),
        # the language reaching the engine other than through backends/local.py
        ("lang/tracer.py", "import radixlang.runtime.request", "only through lang/backends"),
        # the model registry importing a layer
        ("model_files.py", "import radixlang.kernels", "the top-level helpers"),
        # a circle inside a package: the request importing what imports it
        ("runtime/request.py", "import radixlang.runtime.scheduler", "no import circles"),
        ("repl/backends.py", "import radixlang.repl.local", "no import circles"),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(package_copy, module, wrong_import, broken):
    path = package_copy / "radixlang" / module
    path.write_text(path.read_text() + f"\n{wrong_import}  # deliberately wrong\n")
    result = lint_imports(package_copy)
    assert result.returncode != 0, result.stdout
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout
