"""Run an SGLang 0.5.23 client module without SGLang's GPU stack installed.

    .venv/bin/python benchmarks/sglang_client.py [--module sglang.bench_serving] ARGS...

Runs the module (default ``sglang.bench_serving``) as ``python -m MODULE ARGS...`` would, after
installing stand-ins for the few packages that its imports reach but its client path never
uses. ``scripts/setup.sh`` installs SGLang with ``--no-deps`` (its dependencies are several GB
of CUDA packages) plus the handful its client really uses; ``bench_serving`` still imports,
at module level, code from SGLang's server side:

- ``datasets``: ``sglang.benchmark.datasets.mmmu`` does ``from datasets import load_dataset``
  at the top; only the ``mmmu`` and ``longbench_v2`` datasets call it, which download from the
  Hugging Face Hub, and these benchmarks use ``random``, ``random-ids`` and
  ``generated-shared-prefix``.
- ``torchvision``, ``sentencepiece``, ``compressed_tensors``: ``bench_serving`` imports the
  constant ``FAKE_BOOTSTRAP_HOST`` from ``sglang.srt.disaggregation.utils``, which imports the
  server's model configs (``sglang.srt.configs``): image transforms of vision models
  (``internvl_utils``), InternVL's sentencepiece tokenizer and quantized-weight formats. None
  of it runs for an HTTP client.

A stand-in is installed only for a package that is missing here (an installed package is
always used), and only imports get it: ``importlib.util.find_spec``, which transformers calls
to decide which optional packages are present, still finds nothing, so transformers takes its
code paths for a missing package instead of trying to use the stand-in. A stand-in
module hands out a placeholder class for any attribute, and a placeholder's attributes are
placeholders too (module-level code reads enum members such as
``QuantizationStrategy.TENSOR``), so that class definitions and constants at import time work.
Calling a placeholder (or a class derived from one) raises ``StandInUsed``, and the launcher
then exits with status 3 even if the client caught the exception: if the client ever reached
code of a stood-in package, the run fails rather than computes with a stand-in.

``dill`` is imported by the same chain and *used* at import time (a module constant is a
``dill.dumps``), so it is a real dependency: ``scripts/setup.sh`` installs it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
import types
from collections.abc import Sequence

DEFAULT_MODULE = "sglang.bench_serving"

# Packages the client's imports reach but its code never runs (the reasons are above).
STAND_INS = ("datasets", "torchvision", "sentencepiece", "compressed_tensors")


# Every placeholder called, in order: the client may catch StandInUsed (it catches broad
# exceptions in places), so main() checks this list after the run as well.
CALLED: list[str] = []


class StandInUsed(RuntimeError):
    """Code of a package that was stood in for ran: the client needs the real package."""


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}", cls._stand_in_package)

    def __call__(cls, *args: object, **kwargs: object) -> object:
        CALLED.append(f"{cls._stand_in_package}.{cls.__qualname__}")
        raise StandInUsed(
            f"{cls._stand_in_package}.{cls.__qualname__} was called, but "
            f"{cls._stand_in_package.partition('.')[0]!r} is not installed "
            f"(benchmarks/sglang_client.py stands in for it): install it"
        )


def _placeholder(qualname: str, package: str) -> type:
    cls = _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"_stand_in_package": package})
    cls.__qualname__ = qualname
    return cls


class _StandInModule(types.ModuleType):
    """A module whose every public attribute is a placeholder class, made on first access."""

    def __init__(self, name: str) -> None:
        super().__init__(name, f"stand-in for the missing package {name.split('.')[0]!r}")
        self.__path__: list[str] = []  # a package: its submodules are stand-ins too

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(name, self.__name__)
        setattr(self, name, value)
        return value


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of ``packages`` (and of their submodules) with stand-in modules."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = frozenset(packages)
        self.imported: list[str] = []

    def stands_in_for(self, name: str) -> bool:
        return name.partition(".")[0] in self.packages

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if not self.stands_in_for(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        self.imported.append(spec.name)
        return _StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_stand_ins(packages: Sequence[str] = STAND_INS) -> StandInFinder:
    """Stand in for those of ``packages`` that are not installed; returns the finder.

    Imports get the stand-ins; ``importlib.util.find_spec``, which transformers calls to ask
    whether an optional package is installed, keeps answering None for them, before and after
    a stand-in is imported (it would otherwise find the stand-in, or its entry in
    ``sys.modules``, and transformers would then try to use the package)."""
    find_spec = importlib.util.find_spec
    finder = StandInFinder([name for name in packages if find_spec(name) is None])

    def probe(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
        if finder.stands_in_for(importlib.util.resolve_name(name, package)):
            return None
        return find_spec(name, package)

    importlib.util.find_spec = probe
    sys.meta_path.insert(0, finder)
    return finder


def main(argv: Sequence[str]) -> None:
    argv = list(argv)
    module = DEFAULT_MODULE
    if argv[:1] == ["--module"]:
        module, argv = argv[1], argv[2:]
    install_stand_ins()
    sys.argv = [module, *argv]
    code: int | str | None = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    if CALLED:
        print(f"sglang_client: code of a stood-in package ran: {sorted(set(CALLED))}",
              file=sys.stderr)  # fmt: skip
        code = 3
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
