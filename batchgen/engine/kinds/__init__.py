"""Request kinds: each module owns one kind of request (``base.RequestKind``). The engine builds one
of each kind in ``KINDS`` and picks a request's by the type of its parameters."""

from __future__ import annotations

from batchgen.engine.kinds.base import CompletionKind, EngineParts, RequestKind
from batchgen.engine.kinds.beam import BeamKind
from batchgen.engine.kinds.sampling import SamplingKind
from batchgen.engine.kinds.scoring import ScoreKind

KINDS: tuple[type[RequestKind], ...] = (SamplingKind, BeamKind, ScoreKind)

__all__ = ["KINDS", "BeamKind", "CompletionKind", "EngineParts", "RequestKind", "SamplingKind", "ScoreKind"]
