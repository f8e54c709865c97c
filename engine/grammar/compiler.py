"""Compile a request's grammar into a matcher over one model's vocabulary (llguidance).

Why llguidance (docs/perf.md, 2026-12-02, SmolLM2's 49k vocabulary on this project's CPU box): a
typical JSON schema compiles in 1.5-2.9 ms against xgrammar's 32-40 ms, masks take 19-24 µs a
token (xgrammar 9 µs; both far below a decode step), and it is one abi3 wheel with no
dependencies, where xgrammar pulls torch, triton and transformers of its own choosing.

One :class:`GrammarCompiler` per loaded model. The tokenizer (``LLTokenizer``: the vocabulary
as bytes, a trie over it) is built once, in the compiler's thread, on the first constrained
request (it costs 0.5-2 s and most models never see one; a restart does not pay it). Compiled
grammars are kept by their text, least recently used out, up to ``CACHE_BYTES`` of estimated size
(:func:`estimated_bytes`: a matcher's memory follows its compile time, 1.3 MB for a 35 ms
compile, 17 KB for a 1 ms one); a hit is a ``deep_copy`` of the compiled matcher (microseconds).
Compiling runs on the compiler's own thread, never on the engine loop: :meth:`compile` returns a
future, which the worker cancels when its request is aborted before the compile starts.

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

# What the compiled grammars kept per model may add up to (estimated_bytes), and the most one
# may be to be kept at all.
CACHE_BYTES = 64 << 20
CACHE_ENTRY_MAX_BYTES = 8 << 20
# Memory a compile leaves in its matcher, per second of compiling (measured: 38 MB/s on
# multipleOf lexers, the costliest), and per character of grammar text.
BYTES_PER_COMPILE_SECOND = 40_000_000
BYTES_PER_GRAMMAR_CHAR = 8
# What one grammar may cost the parser (llguidance's own limits, tightened): a schema that needs
# more is refused at compile, not allowed to stall steps later.
MAX_GRAMMAR_SIZE = 500_000
STEP_LEXER_FUEL = 1_000_000
MAX_TOKENIZER_BYTES = 64 << 20


def estimated_bytes(grammar: str, compile_seconds: float) -> int:
    """What a compiled matcher of ``grammar`` likely holds (llguidance does not say)."""
    return 4096 + len(grammar) * BYTES_PER_GRAMMAR_CHAR + int(compile_seconds * BYTES_PER_COMPILE_SECOND)


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
        self._cache: OrderedDict[str, tuple[object, int]] = OrderedDict()  # text -> (matcher, estimated bytes)
        self.cache_bytes = 0
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
            entry = self._cache.get(grammar)
            if entry is not None:
                self._cache.move_to_end(grammar)
                self.hits += 1
                return RequestGrammar(entry[0].deep_copy())
        tok = self._ensure_tokenizer()
        t0 = time.perf_counter()
        try:
            m = llguidance.LLMatcher(tok, grammar, limits=parser_limits())
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"grammar does not compile: {e}") from None
        if m.is_error():
            raise GrammarError(f"grammar does not compile: {m.get_error()}")
        dt = time.perf_counter() - t0
        size = estimated_bytes(grammar, dt)
        with self._lock:
            self.compile_seconds += dt
            self.compiled += 1
            if size <= CACHE_ENTRY_MAX_BYTES:
                self._cache[grammar] = (m, size)
                self.cache_bytes += size
                while self.cache_bytes > CACHE_BYTES:
                    self.cache_bytes -= self._cache.popitem(last=False)[1][1]
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
