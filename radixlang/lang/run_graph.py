"""The call graph of a program *as it ran*, for backends that report programs to a viewer.

:func:`~radixlang.lang.tracer.trace_program` draws a program without running it, so it cannot
follow Python that branches on generated values (agents, loops until an answer). This records
the steps each state actually executed, in the same node and edge kinds as the trace
(``graph.py``), and gives each ``gen`` and ``select`` node the cache figures of its call:
``prompt_tokens``, ``cached_tokens`` (reused from the radix cache) and ``completion_tokens``.

A recorder is shared by a program's root state and every state forked from it; each state is
one chain. Nodes are added on the states' workers, in the order each state runs its steps.
"""

from __future__ import annotations

import threading
from typing import Any

from radixlang.lang.graph import CallGraph, _short

_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens")


class RunRecorder:
    def __init__(self, name: str) -> None:
        self.graph = CallGraph(name)
        self._lock = threading.Lock()
        self._chains = 0
        self._last: dict[int, tuple[int, str]] = {}  # chain -> (its latest node, next edge kind)
        self._counts: dict[int, dict[str, Any]] = {}  # a node -> its cache figures, latency

    def new_chain(self) -> int:
        with self._lock:
            chain = self._chains
            self._chains += 1
            return chain

    def step(self, chain: int, kind: str, label: str) -> int:
        """Add a step to ``chain``; consecutive text steps merge into one node."""
        with self._lock:
            last = self._last.get(chain)
            if kind == "text" and last is not None and last[1] == "prefix":
                node = self.graph.nodes[last[0]]
                if node.kind == "text":
                    node.label = _short(node.label + label, 60)
                    return node.id
            node = self.graph.add_node(kind, _short(label, 60), chain)
            if last is not None:
                self.graph.add_edge(last[0], node.id, last[1])
            self._last[chain] = (node.id, "prefix")
            return node.id

    def fork(self, chain: int, size: int, children: list[int]) -> None:
        """``chain`` forks into ``children`` (chains from :meth:`new_chain`)."""
        node = self.step(chain, "fork", f"{size} branches")
        with self._lock:
            for child in children:
                self._last[child] = (node, "fork")

    def join(self, chain: int, children: list[int], mode: str) -> None:
        node = self.step(chain, "join", mode)
        with self._lock:
            for child in children:
                last = self._last.get(child)
                if last is not None and last[1] != "fork":  # a branch that did something
                    self.graph.add_edge(last[0], node, "join")

    def counts(self, node: int, meta: Any) -> None:
        """Attach a call's cache figures (its meta_info, or a list of them for ``n`` > 1)."""
        metas = meta if isinstance(meta, list) else [meta]
        totals: dict[str, int] = {}
        for m in metas:
            if isinstance(m, dict):
                for key in _COUNTS:
                    if isinstance(m.get(key), int):
                        totals[key] = totals.get(key, 0) + m[key]
        with self._lock:
            self._counts[node] = totals

    def latency(self, node: int, seconds: float) -> None:
        """Attach how long a step took (a tool node's calls, run at once)."""
        with self._lock:
            self._counts.setdefault(node, {})["latency_ms"] = round(seconds * 1000, 1)

    def to_dict(self) -> dict[str, Any]:
        """The graph as ``POST /dashboard/api/programs`` takes it."""
        with self._lock:
            nodes = [
                {"id": n.id, "kind": n.kind, "label": n.label, "chain": n.chain,
                 **self._counts.get(n.id, {})}
                for n in self.graph.nodes
            ]  # fmt: skip
            edges = [{"src": e.src, "dst": e.dst, "kind": e.kind} for e in self.graph.edges]
        return {"nodes": nodes, "edges": edges}


def start_recording(executor: Any, name: str) -> None:
    """Record ``executor``'s run (a program's root state) if its backend reports programs."""
    if getattr(executor.backend, "report_programs", False):
        executor.recorder = RunRecorder(name)
        executor.chain = executor.recorder.new_chain()


def report_run(executor: Any, failure: BaseException | None = None) -> None:
    """Send the recorded graph to the backend once every state of the run has finished (a
    streamed run's last step). ``failure``: what the program body raised, if anything."""
    recorder = executor.recorder
    if recorder is None:
        return
    states = executor._tree()
    for state in states:
        state.sync()
    failure = failure or next((s.error for s in states if s.error is not None), None)
    status = "finished" if failure is None else f"failed: {type(failure).__name__}: {failure}"
    executor.backend.report_program(recorder.graph.name, recorder.to_dict(), status[:500])
