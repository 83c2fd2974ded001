"""Ray stays out of a single server: it is imported only by the replica set."""

from __future__ import annotations

import subprocess
import sys


def test_a_single_server_and_the_router_import_no_ray():
    code = (
        "import sys\n"
        "import radixlang.cli, radixlang.server.app, radixlang.runtime.engine\n"
        "import radixlang.cluster.router, radixlang.cluster.prefix_index\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
