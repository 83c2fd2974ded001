"""The engine core: scheduler, radix cache, block pool, KV cache, model runner and sampling.

It may import ``radixlang.kernels``, ``radixlang.constrain``, ``radixlang.model_files`` and
``radixlang.version``; never ``radixlang.lang`` or ``radixlang.server`` (pyproject's
import-linter contracts). The public types load on first use, so importing one module of the
package (the block pool, say) does not load the engine, the model code and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixlang.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from radixlang.config import EngineConfig
    from radixlang.runtime.block_pool import BlockPool, IntegrityError, OutOfBlocksError
    from radixlang.runtime.constraint import TokenConstraint
    from radixlang.runtime.engine import CacheBusyError, Engine, EngineClosedError
    from radixlang.runtime.handle import GenerationError, RequestHandle
    from radixlang.runtime.model_runner import ModelRunner, SequenceInput, resolve_dtype
    from radixlang.runtime.radix_cache import RadixCache
    from radixlang.runtime.radix_node import CacheHandle
    from radixlang.runtime.request import (
        FinishReason,
        GenerateRequest,
        GenerationResult,
        RequestError,
        StreamEvent,
    )
    from radixlang.runtime.sampling import SamplingParams
    from radixlang.runtime.scheduler import SchedulePolicy
    from radixlang.sampling_fields import SamplingParamsError

_EXPORTS = {
    "BlockPool": "radixlang.runtime.block_pool",
    "EngineConfig": "radixlang.config",
    "IntegrityError": "radixlang.runtime.block_pool",
    "OutOfBlocksError": "radixlang.runtime.block_pool",
    "TokenConstraint": "radixlang.runtime.constraint",
    "CacheBusyError": "radixlang.runtime.engine",
    "Engine": "radixlang.runtime.engine",
    "EngineClosedError": "radixlang.runtime.engine",
    "RequestError": "radixlang.runtime.request",
    "GenerationError": "radixlang.runtime.handle",
    "RequestHandle": "radixlang.runtime.handle",
    "ModelRunner": "radixlang.runtime.model_runner",
    "SequenceInput": "radixlang.runtime.model_runner",
    "resolve_dtype": "radixlang.runtime.model_runner",
    "CacheHandle": "radixlang.runtime.radix_node",
    "RadixCache": "radixlang.runtime.radix_cache",
    "FinishReason": "radixlang.runtime.request",
    "GenerateRequest": "radixlang.runtime.request",
    "GenerationResult": "radixlang.runtime.request",
    "StreamEvent": "radixlang.runtime.request",
    "SamplingParams": "radixlang.runtime.sampling",
    "SamplingParamsError": "radixlang.sampling_fields",
    "SchedulePolicy": "radixlang.runtime.scheduler",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "BlockPool",
    "CacheBusyError",
    "CacheHandle",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "FinishReason",
    "GenerateRequest",
    "GenerationError",
    "GenerationResult",
    "IntegrityError",
    "ModelRunner",
    "OutOfBlocksError",
    "RadixCache",
    "RequestError",
    "RequestHandle",
    "SamplingParams",
    "SamplingParamsError",
    "SchedulePolicy",
    "SequenceInput",
    "StreamEvent",
    "TokenConstraint",
    "resolve_dtype",
]
