"""The parser behind the docs' code-block convention (tests/docs/code_blocks.py)."""

import textwrap

import pytest
from code_blocks import MarkerError, normalize_output, pages, pair_outputs, parse, unmarked


def md(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def test_blocks_their_languages_lines_and_code():
    blocks = parse(
        md("""
        # A page

        ```python
        x = 1
        ```

        ~~~bash
        echo hi
        ~~~

        ```
        plain
        ```
        """),
        "page.md",
    )
    assert [(b.lang, b.line, b.code) for b in blocks] == [
        ("python", 3, "x = 1"),
        ("bash", 7, "echo hi"),
        ("", 11, "plain"),
    ]
    assert [b.runs for b in blocks] == [True, True, False]
    assert unmarked(blocks) == [blocks[2]]
    assert blocks[2].where == "page.md:11 (``` block starting 'plain')"


def test_a_not_run_marker_with_a_reason_skips_the_block_even_across_a_blank_line():
    blocks = parse(
        md("""
        <!-- not run: needs a GPU -->

        ```python
        import cuda_only
        ```

        <!-- not run: a config file -->
        ```toml
        [engine]
        ```
        """)
    )
    assert [b.not_run for b in blocks] == ["needs a GPU", "a config file"]
    assert not any(b.runs for b in blocks) and unmarked(blocks) == []


@pytest.mark.parametrize(
    "marker", ["<!-- not run: -->", "<!-- not run -->", "<!-- not run:    -->", "<!-- NOT RUN -->"]
)
def test_a_not_run_marker_without_a_reason_is_refused(marker):
    with pytest.raises(MarkerError, match="needs a reason"):
        parse(f"{marker}\n```python\npass\n```\n", "page.md")


def test_a_marker_reaches_only_the_block_right_below_it():
    blocks = parse(
        md("""
        <!-- not run: first -->
        ```text
        a
        ```
        ```text
        b
        ```
        <!-- not run: third -->

        Some prose between.

        ```text
        c
        ```
        """)
    )
    assert [b.not_run for b in blocks] == ["first", None, None]
    assert [b.code for b in unmarked(blocks)] == ["b", "c"]


def test_an_output_block_pairs_with_the_block_before_it():
    blocks = parse(
        md("""
        ```python
        print("hi")
        ```

        <!-- output -->
        ```
        hi
        ```

        ```bash
        true
        ```
        """)
    )
    assert blocks[1].output and not blocks[1].runs
    pairs = pair_outputs(blocks)
    assert [(run.code, out.code if out else None) for run, out in pairs] == [
        ('print("hi")', "hi"),
        ("true", None),
    ]
    assert unmarked(blocks) == []


@pytest.mark.parametrize(
    "before",
    [
        "",  # nothing before it
        '<!-- not run: skipped -->\n```python\nprint("x")\n```\n',  # a block that does not run
        "```python\nprint(1)\n```\n<!-- output -->\n```\n1\n```\n",  # a second output block
    ],
)
def test_an_output_block_must_follow_a_block_that_runs(before):
    blocks = parse(before + "<!-- output -->\n```\nx\n```\n", "page.md")
    with pytest.raises(MarkerError, match="must follow a block that runs"):
        pair_outputs(blocks)


def test_indented_blocks_in_list_items_are_found_and_dedented():
    blocks = parse(
        md("""
        1. First install:

           ```bash
           pip install radixlang
           ```

        2. Then, in a list in a list:

           - run it:

             <!-- not run: an example -->
             ```python
             def f():
                 return 1
             ```
        """)
    )
    assert [(b.lang, b.code, b.not_run) for b in blocks] == [
        ("bash", "pip install radixlang", None),
        ("python", "def f():\n    return 1", "an example"),
    ]


def test_longer_fences_hold_shorter_ones_and_info_strings_are_read():
    blocks = parse(
        md("""
        ````markdown
        ```python
        not a block of its own
        ```
        ````

        ```{.python title="x.py"}
        y = 2
        ```

        ``` Python linenums="1"
        z = 3
        ```
        """)
    )
    assert [b.lang for b in blocks] == ["markdown", "python", "python"]
    assert blocks[0].code.splitlines()[1] == "not a block of its own"


def test_outputs_compare_without_trailing_spaces_and_outer_blank_lines():
    assert normalize_output("\n\na  \nb\t\n\n") == normalize_output("a\nb")
    assert normalize_output("a\n\nb") != normalize_output("a\nb")


def test_the_pages_are_the_readme_and_the_docs_but_not_the_generators(tmp_path):
    for path in ("README.md", "docs/index.md", "docs/reference/api/x.md", "docs/gen/notes.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("# x\n")
    found = [p.relative_to(tmp_path).as_posix() for p in pages(tmp_path)]
    assert found == ["README.md", "docs/index.md", "docs/reference/api/x.md"]
