"""Everything the REPL draws, with rich: streamed replies (one, or forks side by side), the
radix tree, cache figures, branches, program output, call graphs, help.

Model text is always a ``rich.text.Text`` (never markup), so brackets in a reply print as
they are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from radixlang.repl.session import Conversation, Turn, Usage

EDGE_CHARS = 72  # an edge's text is cut in the middle past this many characters


# ---- replies ---------------------------------------------------------------------------------
def usage_line(usage: Usage | None, error: str | None = None) -> Text:
    """One generation's cost: prompt tokens from the cache vs computed, tokens generated."""
    if error is not None:
        return Text(f"error: {error}", style="bold red")
    if usage is None:
        return Text("")
    finish = "stopped (Ctrl-C)" if usage.finish_reason == "abort" else usage.finish_reason
    if not usage.prompt_tokens:  # a stream closed before the server sent its usage
        return Text(finish or "", style="dim")
    parts = [
        f"{usage.prompt_tokens} prompt tokens: {usage.cached_tokens} from the cache, "
        f"{usage.computed_tokens} computed",
        f"{usage.completion_tokens} generated",
    ]
    if finish:
        parts.append(finish)
    return Text(" · ".join(parts), style="dim")


class ReplyView:
    """One streamed reply: each piece is written as it comes, then its usage line."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._open = True
        console.print(Text("assistant", style="bold green"))

    def add(self, branch: int, text: str) -> None:
        self.console.out(text, end="", highlight=False)  # raw text, flushed now

    def done(self, branch: int, usage: Usage | None, error: str | None = None) -> None:
        self.console.out("")  # end the reply's line
        self.console.print(usage_line(usage, error))
        self._open = False

    def close(self) -> None:
        if self._open:
            self.console.out("")


def _tail(text: str, width: int, lines: int) -> Text:
    """The end of ``text`` that fits about ``lines`` lines of ``width`` cells: what a live
    view shows of a reply still growing (the whole text is printed when it ends)."""
    kept = text.split("\n")[-lines:]
    joined = "\n".join(kept)
    limit = max(width, 1) * lines
    return Text(("…" + joined[-limit:]) if len(joined) > limit else joined)


class ForkView:
    """``n`` streamed replies side by side, each column labelled with its branch number.
    While they grow, a live table shows each one's latest lines and its state; when they end,
    the table is printed whole, then one usage line per branch."""

    def __init__(self, console: Console, labels: Sequence[str]) -> None:
        self.console = console
        self.labels = list(labels)
        self.texts = [""] * len(labels)
        self.footers: list[Text] = [Text("…", style="dim")] * len(labels)
        self._live = Live(self._table(final=False), console=console, transient=True,
                          refresh_per_second=8)  # fmt: skip
        self._live.start()

    def _table(self, final: bool) -> Table:
        table = Table(expand=True, padding=(0, 1))
        for label in self.labels:
            table.add_column(label, ratio=1, overflow="fold", header_style="bold cyan")
        if final:
            table.add_row(*(Text(t) for t in self.texts))
            return table
        width = max(8, self.console.width // len(self.labels) - 3)
        lines = max(3, self.console.height - 8)
        table.add_row(*(_tail(t, width, lines) for t in self.texts))
        table.add_row(*self.footers)
        return table

    def add(self, branch: int, text: str) -> None:
        self.texts[branch] += text
        self._live.update(self._table(final=False))

    def done(self, branch: int, usage: Usage | None, error: str | None = None) -> None:
        self.footers[branch] = usage_line(usage, error)
        self._live.update(self._table(final=False))

    def close(self) -> None:
        self._live.stop()
        self.console.print(self._table(final=True))
        for label, footer in zip(self.labels, self.footers, strict=True):
            self.console.print(Text.assemble((label, "bold cyan"), " ", footer))


# ---- the cache -------------------------------------------------------------------------------
def edge_text(text: str, limit: int = EDGE_CHARS) -> str:
    """An edge's token text on one line: escaped newlines, cut in the middle if long."""
    shown = text.encode("unicode_escape").decode("ascii", "replace").replace('"', '\\"')
    if len(shown) > limit:
        half = (limit - 1) // 2
        shown = shown[:half] + "…" + shown[-(limit - 1 - half) :]
    return f'"{shown}"'


def cache_tree(tree: dict[str, Any], decode: Callable[[list[int]], str], width: int = 100) -> Tree:
    """The radix tree (``RadixCache.describe()``): token text on each edge; per node its
    tokens, blocks, hits, lock count, the largest reference count of its blocks and its LRU
    age (cache operations since it was last used). A shared prefix is one node with its
    branches below. Each node is one line of at most ``width`` cells."""
    nodes, shown = tree["num_nodes"], tree["shown_nodes"]
    title = Text.assemble(
        ("radix cache", "bold"),
        f": {nodes} nodes, {tree['tree_blocks']} blocks held by the tree",
    )
    root = Tree(title, guide_style="dim")

    def add(parent: Tree, node: dict[str, Any], depth: int) -> None:
        refs = max(node["block_refs"], default=0)
        figures = (
            f"  {len(node['token_ids'])} tok · {len(node['blocks'])} blk · hits {node['hits']}"
            f" · lock {node['lock_ref']} · refs {refs} · age {node['age']}"
        )
        room = width - 4 * depth - len(figures) - 2
        text = edge_text(decode(node["token_ids"]), max(16, min(EDGE_CHARS, room)))
        label = Text.assemble((text, "green"), (figures, "dim"))
        label.no_wrap, label.overflow = True, "ellipsis"
        branch = parent.add(label)
        for child in node["children"]:
            add(branch, child, depth + 1)

    for child in tree["children"]:
        add(root, child, 1)
    salted = tree.get("salted_roots", [])
    if not tree["children"] and not salted:
        root.add(Text("(empty)", style="dim"))
    for salted_root in salted:  # other cache salts' trees: prefixes they never share
        branch = root.add(
            Text.assemble(("cache salt ", "bold"), (repr(salted_root["salt"]), "cyan"))
        )
        for child in salted_root["children"]:
            add(branch, child, 2)
    if shown < nodes:
        root.add(Text(f"… {nodes - shown} more nodes", style="dim"))
    return root


def stats_table(stats: dict[str, Any]) -> Table:
    """The cache's and scheduler's figures from ``Engine.stats()`` names."""
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()

    def row(name: str, value: Any) -> None:
        table.add_row(name, str(value))

    if "model" in stats:
        row("model", stats["model"])
    row("cache hit rate", f"{stats.get('cache_hit_rate', 0.0):.1%}")
    row(
        "prompt tokens",
        f"{stats.get('prompt_tokens', 0)} ({stats.get('prompt_tokens_reused', 0)} from the "
        f"cache, {stats.get('prompt_tokens_computed', 0)} computed)",
    )
    row("cached tokens", stats.get("cached_tokens", 0))
    row(
        "blocks",
        f"{stats.get('blocks_used', 0)} used, {stats.get('blocks_free', 0)} free, "
        f"{stats.get('blocks_evictable', 0)} evictable (of {stats.get('blocks_total', 0)})",
    )
    if "blocks_held_by_requests" in stats:
        row("blocks held by requests", stats["blocks_held_by_requests"])
    row(
        "requests",
        f"{stats.get('running_requests', 0)} running, {stats.get('waiting_requests', 0)} waiting",
    )
    row("generated tokens", stats.get("generated_tokens", 0))
    if "integrity" in stats:
        row("integrity", stats["integrity"])
    return table


# ---- the conversation ------------------------------------------------------------------------
def _preview(text: str, limit: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def branches_view(conversation: Conversation) -> Table | Text:
    """The replies of the last user turn, numbered for /pick, the active one marked."""
    user, replies = conversation.branches()
    if user is None or not replies:
        return Text("no branches yet: send a message, then /fork N", style="yellow")
    active = set(map(id, conversation.path()))
    table = Table(title=f"replies to: {_preview(user.content, 50)}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("")
    table.add_column("reply")
    table.add_column("tokens", justify="right")
    for i, reply in enumerate(replies, 1):
        mark = "*" if id(reply) in active else ""
        tokens = str(reply.usage.completion_tokens) if reply.usage else ""
        table.add_row(str(i), mark, Text(_preview(reply.content)), tokens)
    return table


def turn_label(turn: Turn) -> str:
    return f"{turn.role}: {_preview(turn.content, 60)}"


# ---- programs --------------------------------------------------------------------------------
class ProgramView:
    """A program's gens as they happen: one row per gen (its branch label and variable),
    growing live; when the run ends, the rows are printed whole."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rows: dict[tuple[str, str], str] = {}
        self._live = Live(self._table(final=False), console=console, transient=True,
                          refresh_per_second=8)  # fmt: skip
        self._live.start()

    def _table(self, final: bool) -> Table:
        table = Table(show_header=False, box=None, padding=(0, 1), expand=True)
        table.add_column(no_wrap=True, style="bold cyan")
        table.add_column(ratio=1, overflow="fold")
        width = max(8, self.console.width - 24)
        lines = max(1, min(3, (self.console.height - 2) // max(1, len(self.rows))))
        rows = sorted(self.rows.items(), key=lambda row: _label_order(row[0][0]))
        for (label, var), text in rows:
            shown = Text(text.strip("\n")) if final else _tail(text, width, lines)
            table.add_row(Text(f"[{label}] {var}"), shown)
        return table

    def add(self, label: str, var: str, text: str) -> None:
        self.rows[(label, var)] = self.rows.get((label, var), "") + text
        self._live.update(self._table(final=False))

    def close(self) -> None:
        self._live.stop()
        if self.rows:
            self.console.print(self._table(final=True))


def _label_order(label: str) -> tuple[int, ...]:
    """``main`` first, then forks in tree order (``fork 2`` before ``fork 10``)."""
    if label == "main":
        return ()
    return tuple(int(part) for part in label.removeprefix("fork ").split("."))


def variables_table(variables: dict[Any, Any]) -> Table:
    table = Table(title="variables", title_justify="left", show_lines=False)
    table.add_column("name", style="bold")
    table.add_column("value")
    for name, value in variables.items():
        if isinstance(value, list):
            shown = "\n".join(f"[{i}] {_preview(str(v))}" for i, v in enumerate(value))
        else:
            shown = _preview(str(value))
        table.add_row(str(name), Text(shown))
    return table


def graph_tree(graph: Any) -> Tree:
    """A traced ``CallGraph``: each chain's steps in order, a fork's branches below it, and
    where a step uses a generated value, the step it comes from."""
    root = Tree(Text.assemble((f"call graph of {graph.name}", "bold"), f"  ({graph})"))
    chains: dict[int, list[Any]] = defaultdict(list)
    for node in graph.nodes:
        chains[node.chain].append(node)
    forks: dict[int, list[int]] = defaultdict(list)
    for edge in graph.edges_of("fork"):
        forks[edge.src].append(graph.nodes[edge.dst].chain)
    uses: dict[int, list[int]] = defaultdict(list)
    for edge in graph.edges_of("data"):
        uses[edge.dst].append(edge.src)

    def add_chain(parent: Tree, chain: int) -> None:
        for node in chains[chain]:
            label = Text.assemble((f"{node.kind} ", _KIND_STYLE.get(node.kind, "")), node.label)
            if uses[node.id]:
                label.append(f"  ← uses {', '.join(f'#{s}' for s in uses[node.id])}", "dim")
            label.append(f"  #{node.id}", "dim")
            branch = parent.add(label)
            for child in forks[node.id]:
                add_chain(branch.add(Text(f"branch {child}", style="bold magenta")), child)

    add_chain(root, 0)
    return root


_KIND_STYLE = {"gen": "bold green", "select": "bold yellow", "fork": "bold magenta",
               "join": "bold magenta", "role": "blue", "argument": "cyan"}  # fmt: skip


def help_table(commands: Sequence[Any]) -> Group:
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for spec in commands:
        table.add_row(spec.usage, spec.summary)
    notes = Text(
        "Type a message to chat. Multi-line: Esc then Enter inserts a new line, and so does "
        "a line ending in a backslash. Ctrl-C stops a reply (the session goes on); Ctrl-D or "
        "/exit leaves.",
        style="dim",
    )
    return Group(table, notes)
