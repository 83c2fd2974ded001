"""Structured extraction: a pydantic record filled from each of 16 short documents, as JSON that
is valid by construction, with ``gen(json_schema=Model)`` and ``run_batch``.

Every program shares one instruction prefix and differs only in its document, so the runtime
computes the prefix once and serves the other programs from its radix cache. The schema's long
key names and punctuation are text the grammar forces: the engine appends such tokens at once
(jump-forward) instead of running one decode step per token. ``s[name]`` is the JSON text and
``s.parsed(name)`` the validated pydantic instance; the program prints each record, then the
cache's work (prompt tokens computed vs reused) and the tokens the jump-forward appended.

    .venv/bin/python examples/json_extract.py [--num-docs N] [--max-tokens N] [--model NAME]
"""

from __future__ import annotations

import argparse
import time
from typing import Literal

from pydantic import BaseModel, Field

import radixlang as sgl
from radixlang.lang.structured import StructuredOutputError


class CompanyRecord(BaseModel):
    """What to extract from one document; the field names are the JSON keys."""

    company_legal_name: str = Field(max_length=40)
    headquarters_city_name: str = Field(max_length=30)
    year_the_company_was_founded: int = Field(ge=1800, le=2030)
    number_of_full_time_employees: int = Field(ge=0, le=10_000_000)
    company_is_publicly_traded: bool
    primary_industry_sector: Literal["technology", "food", "energy", "transport", "health"]


INSTRUCTIONS = (
    "You extract facts from short company descriptions. Read the document and fill in a JSON "
    "record with the company's legal name, the city of its headquarters, the year it was "
    "founded, its number of full-time employees, whether its shares trade on a stock exchange, "
    "and its industry sector (technology, food, energy, transport or health). Copy names "
    "exactly as written in the document."
)
# Made-up companies: every name, place and number here is invented.
DOCUMENTS = [
    "Lumenfield Robotics Inc. was founded in 2011 in Tampere. The privately held firm builds "
    "warehouse robots and employs 420 people full time.",
    "Harbor & Vine Foods, based in Porto since 1962, makes canned sardines. Its shares trade on "
    "the Lisbon exchange; it has 2,300 full-time staff.",
    "Northgale Wind Power started in 1998 in Aarhus. The listed company runs offshore wind farms "
    "with 5,100 employees.",
    "Quillstone Medical Devices Ltd. opened in 2016 in Galway and is still private. It makes "
    "insulin pumps and has 85 full-time workers.",
    "Copperline Rail Freight was founded in 1921 in Winnipeg. The publicly traded railway "
    "employs 14,000 people.",
    "Bramblewick Bakeries, a family-owned bakery chain from Leeds, opened its first shop in "
    "1934 and now has 960 full-time bakers and staff.",
    "Solvane Energy Storage AG, founded in 2019 in Graz, develops home batteries. It is not "
    "listed and has 150 employees.",
    "Tidewater Ferries Co. has carried passengers since 1887 from its base in Halifax. Its "
    "shares are listed; it employs 1,200 people.",
    "Arclight Software Group was set up in 2004 in Tallinn. The listed company sells accounting "
    "software and has 3,400 full-time employees.",
    "Pinecrest Family Clinics, founded in 1979 in Boise, runs 40 clinics with 2,050 staff. It "
    "is privately owned.",
    "Meridian Orchard Juices began in 1990 in Nelson. The private company presses apple juice "
    "and has 310 full-time employees.",
    "Kestrel Aviation Services was founded in 2008 in Cork. Its shares trade publicly and it "
    "employs 6,700 people.",
    "Oakhaven Biolabs S.A., based in Lyon since 2013, develops vaccines. It is listed on the "
    "Paris exchange and has 890 employees.",
    "Glassbrook Solar Cooperative formed in 2021 in Freiburg. The member-owned cooperative has "
    "38 full-time employees.",
    "Redfern Data Systems was founded in 1985 in Adelaide and went public in 1999. It has "
    "7,800 full-time staff.",
    "Little Fjord Seafood AS, founded in 1951 in Bergen, is a private fish processor with 540 "
    "full-time workers.",
]


@sgl.function
def extract(s, document: str, max_tokens: int):
    s += sgl.system(INSTRUCTIONS)
    s += sgl.user("Document:\n" + document)
    s += sgl.assistant(
        sgl.gen("record", json_schema=CompanyRecord, max_tokens=max_tokens, temperature=0)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-docs", type=int, default=len(DOCUMENTS))
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per JSON record")
    parser.add_argument("--model", default=None, help="model name or path (default model)")
    args = parser.parse_args()

    rt = sgl.Runtime(model_path=args.model) if args.model else sgl.Runtime()
    sgl.set_default_backend(rt)
    try:
        docs = [DOCUMENTS[i % len(DOCUMENTS)] for i in range(args.num_docs)]
        start = time.perf_counter()
        states = extract.run_batch(
            [{"document": d, "max_tokens": args.max_tokens} for d in docs], progress_bar=True
        )
        seconds = time.perf_counter() - start
        parsed = 0
        for i, state in enumerate(states, 1):
            try:
                record = state.parsed("record")
            except StructuredOutputError as e:  # e.g. cut off by --max-tokens
                print(f"doc {i:2d}: not parsed: {e}")
                continue
            parsed += 1
            print(f"doc {i:2d}: {record!r}")
        stats = rt.stats()
        print(
            f"\n{parsed} of {len(states)} records parsed as {CompanyRecord.__name__} in "
            f"{seconds:.1f} s"
        )
        print(
            f"jump-forward: {stats['jump_forward_tokens']} of {stats['generated_tokens']} "
            f"generated tokens were forced by the schema and appended without a decode step "
            f"({stats['jump_forward_jumps']} jumps)"
        )
        print(rt.cache_summary())
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
