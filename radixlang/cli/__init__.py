"""The command line (``radixlang``, ``python -m radixlang.cli``): ``commands.py`` parses and runs
the subcommands; ``program_file.py`` runs a program file (``radixlang run``),
``bench_catalog.py`` finds the checkout's benchmarks (``radixlang bench``), ``cache_report.py``
prints the cache's figures after a run."""

from radixlang.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
