"""batchgen: offline batch inference on a paged-attention engine with copy-on-write KV sharing."""

from batchgen.engine.engine import LLMEngine
from batchgen.llm import LLM
from batchgen.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    ContinuationScore,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    ScoreOutput,
    TokenLogprobs,
)
from batchgen.params import (
    BeamSearchParams,
    LoRARequest,
    SamplingParams,
    ScoreParams,
    StructuredOutputsParams,
)
from batchgen.utils import FlexibleArgumentParser
from batchgen.vllm_compat import EngineArgs

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "ScoreParams",
    "ScoreOutput",
    "ContinuationScore",
    "TokenLogprobs",
    "PromptLogprobs",
    "LLMEngine",
    "EngineArgs",
    "FlexibleArgumentParser",
]
__version__ = "0.1.0"
