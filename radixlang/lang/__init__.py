"""The language: prompt constructors, the IR, ``@function``, program state, the interpreter and
tracer, the call graph, choices, chat templates, run options, and the backends programs run on.

It may import ``radixlang.constrain`` (dtype regexes, the torch-free source checks) and the
leaf modules at the top; it reaches the engine only through ``lang/backends/local.py``, and never
imports the server.
The public names are re-exported by ``radixlang`` itself (``import radixlang as sgl``).
"""
