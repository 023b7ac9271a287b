"""aserve: an LLM inference server in one process."""

from __future__ import annotations

from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "PoolingParams", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # `LLM` pulls in torch; import it only when asked for.
    if name == "LLM":
        from aserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
