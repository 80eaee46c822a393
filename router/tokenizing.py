"""The router's tokenizer threads, split by the text's size, so one huge prompt never delays small ones.

A fast tokenizer releases the GIL, but a text of megabytes (the HTTP body limit
allows 4 MiB; /tokenize takes any length) holds its thread for a second or more.
With one shared pool, a few such texts (through /tokenize, Tokenize or a prompt
that will be refused as too long once counted) would hold every thread and every
small request would queue behind them. Texts over LONG_TEXT_CHARS run on a pool of
their own: long texts wait for each other, never take the small ones' threads.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor

# About 16k tokens of English: a prompt up to this is tokenized in milliseconds.
LONG_TEXT_CHARS = 64 * 1024


class TokenizerThreads:
    def __init__(self, test_long_gate: str | None = None):
        """test_long_gate: tests only (DISAGG_TEST_LONG_TOKENIZE_GATE): a long text's tokenization first
        writes `<gate>.entered`, then waits until the file `<gate>` exists, so a test can hold the long
        pool busy for as long as it needs and show that small requests still pass. None: no hook."""
        self._short = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenizer")
        self._long = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-long")
        self._gate = pathlib.Path(test_long_gate) if test_long_gate else None

    async def run(self, chars: int, fn, *args):
        """fn(*args) on a tokenizer thread; chars: the length of the text it tokenizes."""
        loop = asyncio.get_running_loop()
        if chars <= LONG_TEXT_CHARS:
            return await loop.run_in_executor(self._short, fn, *args)
        if self._gate is not None:
            return await loop.run_in_executor(self._long, self._held, fn, *args)
        return await loop.run_in_executor(self._long, fn, *args)

    def _held(self, fn, *args):
        self._gate.with_name(self._gate.name + ".entered").touch()
        while not self._gate.exists():
            time.sleep(0.02)
        return fn(*args)


def text_chars(params) -> int:
    """The characters a GenerateParams' prompt puts through the tokenizer (token ids: none)."""
    if params.prompt is not None:
        return len(params.prompt)
    if params.messages is not None:
        return sum(len(message[1]) for message in params.messages)
    return 0
