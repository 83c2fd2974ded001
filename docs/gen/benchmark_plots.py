"""Copies the committed benchmark plots (benchmarks/results/*.png) into the site as
``results/NAME.png`` (virtual files), so the benchmarks page shows each plot beside the table
and the JSON it came from. Run by mkdocs-gen-files at build time (mkdocs.yml)."""

from __future__ import annotations

from pathlib import Path

import mkdocs_gen_files

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

for plot in sorted(RESULTS.glob("*.png")):
    with mkdocs_gen_files.open(f"results/{plot.name}", "wb") as out:
        out.write(plot.read_bytes())
