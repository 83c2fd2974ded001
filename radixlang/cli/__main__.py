"""``python -m radixlang.cli``: the ``radixlang`` command."""

import sys

from radixlang.cli.commands import main

sys.exit(main())
