"""transformers continuous batching in this process, behind the load generator's client interface.

The baseline a user would otherwise run: transformers' own continuous-batching
manager (`init_continuous_batching`, the engine behind `generate_batch` and
`transformers serve`), streaming each request's tokens. It runs in the bench's
process with no network in between, which favours it slightly.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass


@dataclass
class TokenChunk:
    token_ids: list[int]


class TransformersStreams:
    def __init__(self, model_path: str, max_batch_tokens: int = 512, threads: int = 2):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_batch_tokens=max_batch_tokens)
        self._manager = model.init_continuous_batching(generation_config=config)
        self._manager.start()
        self._ids = itertools.count()

    async def generate(self, prompt_token_ids: list[int], max_new_tokens: int, ignore_eos: bool = True):
        """Yields each new token as it is generated (EOS is ignored: lengths are exact)."""
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = f"bench-{next(self._ids)}"
        self._manager.register_result_handler(request_id, outputs.put_nowait)
        self._manager.add_request(list(prompt_token_ids), request_id=request_id, max_new_tokens=max_new_tokens, streaming=True)
        seen, finished = 0, False
        try:
            while not finished:
                output = await outputs.get()
                if output.error:
                    raise RuntimeError(f"transformers request {request_id}: {output.error}")
                finished = output.is_finished()
                new, seen = output.generated_tokens[seen:], len(output.generated_tokens)
                if new:
                    yield TokenChunk(list(new))
        finally:
            if not finished:  # the caller stopped reading: free its place in the batch
                self._manager.cancel_request(request_id)

    def close(self) -> None:
        self._manager.stop(block=True)
