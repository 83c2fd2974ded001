"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against
``radixlang serve`` (a subprocess) on the tiny chat model.

A forked program (reported by ``RuntimeEndpoint(report_programs=True)``) and chats from the
``openai`` client go through the API while the page is open; the page must draw the shared
prefix with its branches and the program's graph, list a running request and let it be aborted,
empty the list when everything has finished, show the same counters as /metrics, and stream a
playground answer forked two ways. With ``--api-key`` the page asks for the key and refuses
without it.

Marked ``browser``: skipped where Chromium or Playwright is missing (the README's test command
installs both where it can). ``RADIXLANG_DASHBOARD_SHOTS=folder`` keeps the screenshots.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from radixlang.server import metrics

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed"),
]
# Chromium on a machine with no network and no display (the flags Debian's package needs as
# root, and none of its background calls home, which this network refuses).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic", "--disable-dev-shm-usage"]  # fmt: skip
TIMEOUT_MS = 30_000
# The aborted request's model: the tiny chat model with a context long enough for a request
# that runs for minutes (LONG_TOKENS at a few ms a token), far past every wait of the test
# before its abort; the KV pool holds it whole (512 bytes a token in float32).
LONG_CONTEXT = 131_072
LONG_TOKENS = LONG_CONTEXT - 1024
LONG_KV_MEMORY = "96MiB"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from radixlang.testing import write_tiny_chat_model

    folder = tmp_path_factory.mktemp("tiny-long-context-model")
    return write_tiny_chat_model(folder, max_positions=LONG_CONTEXT)


@contextlib.contextmanager
def _serve(model_dir: Path, *extra: str, kv_memory: str = "32MiB") -> Iterator[str]:
    """``radixlang serve`` on the tiny model until the block ends; yields its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixlang.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--dtype", "float32", "--kv-memory", kv_memory,
           "--dashboard-interval", "0.25", "--log-level", "warning",
           "--served-model-name", "tiny", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture
def browser_page(tmp_path: Path) -> Iterator[Page]:
    with sync_playwright() as p:  # type: ignore[misc]
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.errors = errors  # type: ignore[attr-defined]
            yield page
        finally:
            browser.close()


def _shot(page: Page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("RADIXLANG_DASHBOARD_SHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)


def _wait(condition, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _run_forked_program(url: str) -> None:
    import radixlang as rl
    from radixlang.lang.backends.endpoint import RuntimeEndpoint

    @rl.function
    def three_ideas(s, topic):  # type: ignore[no-untyped-def]
        s += "Give three ideas about " + topic + ". Think about each one carefully.\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Idea {i + 1}:" + rl.gen("idea", max_tokens=6, temperature=0)
        forks.join()
        s += "Best:" + rl.select("best", choices=["1", "2", "3"])

    backend = RuntimeEndpoint(url, report_programs=True)
    try:
        three_ideas.run(topic="gardens", backend=backend)
    finally:
        backend.shutdown()


def test_the_dashboard_shows_the_tree_requests_counters_programs_and_playground(
    long_context_model_dir, browser_page, tmp_path
):
    page = browser_page
    with _serve(long_context_model_dir, kv_memory=LONG_KV_MEMORY) as url:
        page.goto(url + "/dashboard")
        page.wait_for_selector("#status:has-text('live')")

        # A forked program and a few chats through the API, with the page open.
        _run_forked_program(url)
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="none")
        for question in ("What is a radix tree?", "Why share a prefix?", "Name a colour."):
            client.chat.completions.create(
                model="tiny", max_tokens=8, temperature=0,
                messages=[{"role": "system", "content": "You answer in one line."},
                          {"role": "user", "content": question}],
            )  # fmt: skip

        # The tree: the program's shared prefix is one node with its three branches under it.
        snapshot = httpx.get(url + "/dashboard/api/snapshot").json()
        nodes = snapshot["tree"]["nodes"]
        children: dict[int, list[int]] = {}
        for n in nodes:
            if n["parent"] is not None:
                children.setdefault(n["parent"], []).append(n["id"])
        ideas = [n for n in nodes if "Think about each one" in n["text"]]
        assert ideas, [n["text"] for n in nodes]
        # Below it the branches part where their texts differ ("Idea 1:", "Idea 2:", ...).
        below = [ideas[0]["id"]]
        while below and len(children.get(below[0], [])) < 3:
            below = below[1:] + children.get(below[0], [])
        assert below, snapshot["tree"]
        fork_node = below[0]
        branches = children[fork_node]
        for node_id in [fork_node, *branches]:
            page.wait_for_selector(f"#tree g.tree-node[data-node-id='{node_id}']")
        tree_text = page.locator(f"#tree g.tree-node[data-node-id='{ideas[0]['id']}'] title")
        assert "Think about each one" in tree_text.text_content()

        # The program's graph: a fork into three branches, each gen with its cache figures.
        page.wait_for_selector("#program-graph g.program-node[data-kind='fork']")
        assert page.locator("#program-graph g.program-node[data-kind='gen']").count() == 3
        assert page.locator("#program-graph g.program-node[data-kind='join']").count() == 1
        hits = page.locator("#program-graph g.program-node[data-kind='gen'] text.hits")
        assert all("cached" in t for t in hits.all_text_contents()), hits.all_text_contents()
        _shot(page, tmp_path, "dashboard-after-program")

        # A long request shows in the list while it runs, and the page's abort stops it. It
        # cannot finish before the abort (minutes of tokens): the abort is what ends it.
        outcome: list[dict] = []

        def long_request() -> None:
            body = {"text": "Count slowly:", "sampling_params": {
                "max_new_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}}  # fmt: skip
            outcome.append(httpx.post(url + "/generate", json=body, timeout=300).json())

        runner = threading.Thread(target=long_request)
        runner.start()
        row = page.locator("#requests tbody tr[data-rid]")
        row.first.wait_for()
        # (A snapshot may catch it queued, "waiting", between its submission and admission.)
        expect(page.locator("#requests tbody td.state").first).to_have_text(
            re.compile(r"^(prefill|decode)$"), timeout=15_000
        )
        row.first.locator("button.abort").click()
        _shot(page, tmp_path, "dashboard-aborted-request")
        runner.join(120)
        assert outcome and outcome[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert outcome[0]["meta_info"]["completion_tokens"] < LONG_TOKENS
        page.wait_for_selector("#requests-empty", state="visible")
        assert page.locator("#requests tbody tr").count() == 0

        # The playground streams an answer forked two ways; the tree grows by its prompt.
        nodes_before = httpx.get(url + "/dashboard/api/snapshot").json()["tree"]["num_nodes"]
        page.select_option("#pg-mode", "text")
        page.fill("#pg-prompt", "Once upon a time in a quiet village,")
        page.fill("#pg-max-tokens", "12")
        page.fill("#pg-n", "2")
        page.click("#pg-send")
        page.wait_for_selector("#pg-status:text-is('done')")
        outputs = page.locator("#pg-outputs .pg-output").all_text_contents()
        assert len(outputs) == 2 and all(o.strip() for o in outputs), outputs
        _wait(lambda: httpx.get(url + "/dashboard/api/snapshot").json()["tree"]["num_nodes"]
              > nodes_before, "the playground's prompt in the tree")  # fmt: skip

        # Idle: the page's counters are /metrics' figures (the live rate aside, which moves).
        def counters_match() -> bool:
            shown = {
                el.get_attribute("data-metric"): float(el.text_content())
                for el in page.locator("#counters [data-metric]").all()
            }
            scraped = metrics.parse(httpx.get(url + "/metrics").text)
            names = [k for k in shown if k != metrics.PREFIX + "generation_tokens_per_second"]
            return len(names) >= 15 and all(
                abs(shown[k] - scraped[k]) <= 1e-4 * max(1.0, abs(scraped[k])) for k in names
            )

        _wait(counters_match, "the page's counters to equal /metrics")
        assert page.locator("#requests tbody tr").count() == 0
        _shot(page, tmp_path, "dashboard-idle")
        assert not page.errors  # type: ignore[attr-defined]


def test_the_dashboard_asks_for_the_api_key_and_refuses_without_it(
    chat_model_dir, browser_page, tmp_path
):
    page = browser_page
    with _serve(chat_model_dir, "--api-key", "s3cret") as url:
        assert httpx.get(url + "/dashboard").status_code == 200  # the page: static code only
        assert httpx.get(url + "/dashboard/api/snapshot").status_code == 401
        page.goto(url + "/dashboard")
        page.wait_for_selector("#key-dialog", state="visible")
        page.wait_for_selector("#status:has-text('refused')")
        assert page.locator("#counters [data-metric]").count() == 0  # no data without the key
        _shot(page, tmp_path, "dashboard-asks-for-key")
        page.fill("#api-key", "wrong")
        page.click("#api-key-submit")
        page.wait_for_selector("#status:has-text('refused')")
        page.fill("#api-key", "s3cret")
        page.click("#api-key-submit")
        page.wait_for_selector("#status:has-text('live')")
        page.wait_for_selector("#key-dialog", state="hidden")
        # The counters render after the status turns live: wait for them (a count taken at
        # once raced the page's first snapshot and found none in a CI run).
        page.wait_for_selector("#counters [data-metric]")
        assert page.locator("#counters [data-metric]").count() > 0
        # The playground sends the key too.
        page.select_option("#pg-mode", "chat")
        page.fill("#pg-prompt", "Hello!")
        page.fill("#pg-max-tokens", "6")
        page.click("#pg-send")
        page.wait_for_selector("#pg-status:text-is('done')")
        assert not page.errors  # type: ignore[attr-defined]
