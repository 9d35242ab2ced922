"""The built-in instance's engine: continuous batching over parallel slots.

One decode loop (:mod:`.loop`: :class:`Engine`) over slot records
(:mod:`.slots`), one batch per step (:mod:`.batch`), its named steps
(:mod:`.generate_steps`, :mod:`.sample_steps`, :mod:`.embedding`), the
tenants' admission order (:mod:`.fairness`), the requests and their events
(:mod:`.jobs`), stop strings (:mod:`.stops`), the samplers
(:mod:`.sampling`), the KV tiers' and context checkpoints' steps
(:mod:`.cache_steps`, :mod:`.checkpoints`), a prompt's images and audio
(:mod:`.media_steps`), the vocabulary calls (:mod:`.token_calls`) and the
llama context (:mod:`.model`). No HTTP in it:
``instance/server.py`` and ``instance/llama.py`` map requests to engine
calls.
"""

from .loop import (
    Embedding,
    Engine,
    EngineAsleep,
    EngineConfig,
    EngineError,
    EngineStopped,
    Generation,
    InvalidRequest,
    Job,
    Sampling,
)

__all__ = ["Embedding", "Engine", "EngineAsleep", "EngineConfig", "EngineError",
           "EngineStopped", "Generation", "InvalidRequest", "Job", "Sampling"]
