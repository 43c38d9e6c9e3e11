"""batchgen: offline batch inference on a paged-attention engine with copy-on-write KV sharing."""

from batchgen.llm import LLM
from batchgen.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from batchgen.params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = "0.1.0"
