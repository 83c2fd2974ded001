"""Loading a benchmark script (benchmarks/ is not a package) as a module, for its smoke tests."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
# A benchmark imports its sibling modules (regex_automaton) as it does when run as a script.
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
