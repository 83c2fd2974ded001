"""A traced program's call graph: what each state appends, and what depends on what.

Nodes are the program's steps (text, role boundaries, gen, select, fork, join, nested calls);
each belongs to a *chain* — the root state or one forked branch. Edges say why one step waits
for another:

- ``prefix``: the next step of the same chain (its prompt extends the previous one's text);
- ``fork``: a branch starts from its parent's text (the shared prefix, computed once);
- ``join``: the parent waits for a branch;
- ``data``: a step uses a value another step generated (or a program argument).

It renders as Graphviz DOT and as Mermaid flowchart text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Node:
    id: int
    kind: str  # text | role | gen | select | tool | fork | join | call | return | argument | scope
    label: str
    chain: int


@dataclass
class Edge:
    src: int
    dst: int
    kind: str  # prefix | fork | join | data


@dataclass
class CallGraph:
    name: str
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    arguments: dict[str, int] = field(default_factory=dict)  # argument name -> its node

    def add_node(self, kind: str, label: str, chain: int) -> Node:
        node = Node(len(self.nodes), kind, label, chain)
        self.nodes.append(node)
        return node

    def add_edge(self, src: int, dst: int, kind: str) -> None:
        edge = Edge(src, dst, kind)
        if edge not in self.edges:
            self.edges.append(edge)

    def nodes_of(self, kind: str) -> list[Node]:
        return [n for n in self.nodes if n.kind == kind]

    def edges_of(self, kind: str) -> list[Edge]:
        return [e for e in self.edges if e.kind == kind]

    @property
    def num_chains(self) -> int:
        return len({n.chain for n in self.nodes})

    def __str__(self) -> str:
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        parts = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
        return f"CallGraph({self.name}: {parts}; {len(self.edges)} edges)"

    # ---- rendering ---------------------------------------------------------------------------
    def to_dot(self) -> str:
        shapes = {"gen": "box", "select": "diamond", "fork": "triangle", "join": "invtriangle"}
        styles = {"prefix": "solid", "fork": "bold", "join": "bold", "data": "dashed"}
        lines = [f"digraph {_dot_id(self.name)} {{", "  rankdir=TB;", "  node [fontsize=10];"]
        for chain in sorted({n.chain for n in self.nodes}):
            lines.append(f"  subgraph cluster_{chain} {{")
            lines.append(f'    label="{"root" if chain == 0 else f"branch {chain}"}";')
            for n in self.nodes:
                if n.chain == chain:
                    shape = shapes.get(n.kind, "ellipse" if n.kind != "text" else "note")
                    label = _dot_escape(f"{n.kind}: {n.label}" if n.kind != "text" else n.label)
                    lines.append(f'    n{n.id} [shape={shape}, label="{label}"];')
            lines.append("  }")
        for e in self.edges:
            lines.append(f'  n{e.src} -> n{e.dst} [style={styles[e.kind]}, label="{e.kind}"];')
        lines.append("}")
        return "\n".join(lines)

    def to_mermaid(self) -> str:
        shapes = {"gen": ("[", "]"), "select": ("{", "}"), "fork": ("[/", "\\]")}
        arrows = {"prefix": "-->", "fork": "==>", "join": "==>", "data": "-.->"}
        lines = ["flowchart TD"]
        for n in self.nodes:
            left, right = shapes.get(n.kind, ("(", ")"))
            label = _mermaid_escape(f"{n.kind}: {n.label}" if n.kind != "text" else n.label)
            lines.append(f'  n{n.id}{left}"{label}"{right}')
        for e in self.edges:
            lines.append(f"  n{e.src} {arrows[e.kind]}|{e.kind}| n{e.dst}")
        return "\n".join(lines)


def _short(text: str, limit: int = 40) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dot_id(name: str) -> str:
    return '"' + name.replace('"', "'") + '"'


def _dot_escape(text: str) -> str:
    return _short(text).replace("\\", "\\\\").replace('"', '\\"')


def _mermaid_escape(text: str) -> str:
    return _short(text).replace('"', "#quot;")
