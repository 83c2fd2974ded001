"""``import radixlang`` and the HTTP backends load no torch and no engine: a client machine
talking to a server needs neither."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import radixlang
assert "torch" not in sys.modules, "import radixlang loaded torch"
assert "httpx" not in sys.modules, "import radixlang loaded httpx"
from radixlang import OpenAI, RuntimeEndpoint
from radixlang.lang.backends import EndpointError, OpenAIError
assert RuntimeEndpoint.__module__ == "radixlang.lang.backends.endpoint"
assert OpenAI.__module__ == "radixlang.lang.backends.openai"
assert issubclass(EndpointError, RuntimeError) and issubclass(OpenAIError, RuntimeError)
assert "torch" not in sys.modules, "the HTTP backends loaded torch"
assert not any(m.startswith("radixlang.runtime") for m in sys.modules), "they loaded the engine"
assert {"OpenAI", "Runtime", "RuntimeEndpoint"} <= set(radixlang.__all__)

# Reading a server's jinja chat template (transformers' renderer) loads no torch either.
import httpx
info = {"model_path": "m", "chat_template": "{% for m in messages %}{{ m['content'] }}\\n"
        "{% endfor %}"}
answer = httpx.MockTransport(lambda request: httpx.Response(200, json=info))
backend = RuntimeEndpoint("http://server", transport=answer)
assert backend.get_chat_template().suffix["user"] == "\\n"
assert "torch" not in sys.modules, "reading the chat template loaded torch"
"""


def test_import_radixlang_and_its_http_backends_load_no_torch():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
