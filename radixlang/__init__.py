"""radixlang: a Python language and local runtime for LLM programs.

The frontend follows SGLang's names, so its programs run with ``import radixlang as sgl``.
Three layers lie below: ``radixlang.lang`` (the language and its backends), ``radixlang.runtime``
(the engine) and ``radixlang.server`` (HTTP); this module re-exports the language's public names
and loads the backends on first use, so ``import radixlang`` loads no torch.
"""

from typing import Any

from radixlang.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    run_tools,
    select,
    system,
    system_begin,
    system_end,
    tool,
    user,
    user_begin,
    user_end,
)
from radixlang.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    sum_of_logprobs,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlang.lang.function import Function, function
from radixlang.lang.run_options import get_default_backend, set_default_backend
from radixlang.lang.state import ProgramState, ProgramStateGroup
from radixlang.lang.structured import StructuredOutputError
from radixlang.lang.tools import Tool, ToolCall, ToolResult, as_tool
from radixlang.version import __version__


def __getattr__(name: str) -> Any:
    # Backends load on first use: the local runtime imports torch and the engine, the HTTP
    # backends httpx; ``import radixlang`` itself stays light.
    if name in ("Runtime", "RuntimeEndpoint", "OpenAI"):
        import radixlang.lang.backends

        return getattr(radixlang.lang.backends, name)
    raise AttributeError(f"module 'radixlang' has no attribute {name!r}")


__all__ = [
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Function",
    "OpenAI",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "StructuredOutputError",
    "Tool",
    "ToolCall",
    "ToolResult",
    "__version__",
    "as_tool",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "greedy_token_selection",
    "run_tools",
    "select",
    "set_default_backend",
    "sum_of_logprobs",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "tool",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
