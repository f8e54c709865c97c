"""Compile a request's grammar into a matcher over one model's vocabulary (llguidance).

Why llguidance (docs/perf.md, 2026-12-02, SmolLM2's 49k vocabulary on this project's CPU box): a
typical JSON schema compiles in 1.5-2.9 ms against xgrammar's 32-40 ms, masks take 19-24 µs a
token (xgrammar 9 µs; both far below a decode step), and it is one abi3 wheel with no
dependencies, where xgrammar pulls torch, triton and transformers of its own choosing.

One :class:`GrammarCompiler` per loaded model. The tokenizer (``LLTokenizer``: the vocabulary
as bytes, a trie over it) is built once, in the compiler's thread, on the first constrained
request (it costs 0.5-2 s and most models never see one; a restart does not pay it). Compiled
grammars are kept by their text, least recently used out: a hit is a ``deep_copy`` of the
compiled matcher (microseconds). Compiling runs on the compiler's own thread, never on the
engine loop: :meth:`compile` returns a future.

The grammar text is what the agent made (agent/http/structured.py, ``json_grammar``);
the worker trusts nothing in it: an error compiling it fails that request only.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from engine.grammar.matcher import RequestGrammar

CACHE_ENTRIES = 256
# What one grammar may cost the parser (llguidance's own limits, tightened): a schema that needs
# more is refused at compile, not allowed to stall steps later.
MAX_GRAMMAR_SIZE = 500_000
STEP_LEXER_FUEL = 1_000_000
MAX_TOKENIZER_BYTES = 64 << 20


class GrammarError(ValueError):
    """A grammar that cannot be compiled for this model."""


def parser_limits():
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE, step_lexer_fuel=STEP_LEXER_FUEL)


class GrammarCompiler:
    """``tokenizer_json``: the model's ``tokenizer.json``; ``vocab_size``: the model's logits width
    (ids the tokenizer lacks are never allowed); ``eos_token_ids``: what ends a finished grammar."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...]) -> None:
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._tokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses)
        self.hits = 0
        self.compile_seconds = 0.0
        self.tokenizer_seconds = 0.0

    def compile(self, grammar: str) -> Future[RequestGrammar]:
        """A fresh matcher for ``grammar``, on the compiler's thread; the future raises
        :class:`GrammarError` when the grammar (or this model's tokenizer) cannot be compiled."""
        return self._pool.submit(self._compile, grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, grammar: str) -> RequestGrammar:
        import llguidance

        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                self.hits += 1
                return RequestGrammar(template.deep_copy())
        tok = self._ensure_tokenizer()
        t0 = time.perf_counter()
        try:
            m = llguidance.LLMatcher(tok, grammar, limits=parser_limits())
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"grammar does not compile: {e}") from None
        if m.is_error():
            raise GrammarError(f"grammar does not compile: {m.get_error()}")
        with self._lock:
            self.compile_seconds += time.perf_counter() - t0
            self.compiled += 1
            self._cache[grammar] = m
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return RequestGrammar(m.deep_copy())

    def _ensure_tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            t0 = time.perf_counter()
            try:
                if self.tokenizer_json.stat().st_size > MAX_TOKENIZER_BYTES:
                    raise GrammarError(f"{self.tokenizer_json.name} is over {MAX_TOKENIZER_BYTES} bytes")
                text = self.tokenizer_json.read_text(encoding="utf-8")
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
            except GrammarError:
                raise
            except (OSError, UnicodeDecodeError, ValueError, RuntimeError) as e:
                raise GrammarError(f"this model's tokenizer cannot constrain decoding: {e}") from None
            self.tokenizer_seconds = time.perf_counter() - t0
        return self._tokenizer
