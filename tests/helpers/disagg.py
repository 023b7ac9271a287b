"""A KV producer in a process of its own (`ProducerProcess`), for tests whose producer and
consumer both run several ranks: one process holds only one default process group, so a
tensor-parallel producer and consumer cannot share the test's process."""

from __future__ import annotations

import multiprocessing
import queue

from aserve import LLM, SamplingParams


def _produce(model_dir: str, llm_kwargs: dict, prompts: list[list[int]],
             out: multiprocessing.Queue) -> None:
    with LLM(model_dir, **llm_kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=1,
                                              kv_transfer_params={"do_remote_decode": True}))
        out.put([o.kv_transfer_params for o in outputs])
        done = llm.wait_for_kv_transfers(timeout=120)
        out.put((done, llm.stats().kv_cache_usage))


class ProducerProcess:
    """Starts an `LLM(model_dir, **llm_kwargs)` in a spawned process that prefills `prompts`
    (one token each, do_remote_decode); `params()` are its kv_transfer_params; `finish()`
    waits until it has seen every block pulled (or given up) and returns (all transferred,
    its KV cache usage then)."""

    def __init__(self, model_dir, llm_kwargs: dict, prompts: list[list[int]]) -> None:
        context = multiprocessing.get_context("spawn")
        self.queue = context.Queue()
        self.process = context.Process(target=_produce, name="kv-producer",
                                       args=(str(model_dir), llm_kwargs, prompts, self.queue))
        self.process.start()

    def _get(self, timeout: float):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the producer process said nothing within {timeout} s "
                                 f"(exit code {self.process.exitcode})") from None

    def params(self, timeout: float = 180) -> list[dict]:
        return self._get(timeout)

    def finish(self, timeout: float = 180) -> tuple[bool, float]:
        result = self._get(timeout)
        self.process.join(60)
        return result

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
