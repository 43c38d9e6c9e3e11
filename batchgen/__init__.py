"""batchgen: offline batch inference on a paged-attention engine with copy-on-write KV sharing."""

from batchgen.engine.engine import LLMEngine
from batchgen.llm import LLM
from batchgen.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from batchgen.params import BeamSearchParams, LoRARequest, SamplingParams, StructuredOutputsParams
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
    "LLMEngine",
    "EngineArgs",
    "FlexibleArgumentParser",
]
__version__ = "0.1.0"
