"""Tokenizer: encode, decode, chat templates, incremental detokenization and stop strings.

``Tokenizer.from_dir(model_dir)`` reads a Hugging Face folder: ``tokenizer.json`` (through
the ``tokenizers`` library), ``tokenizer_config.json`` (special tokens, chat template),
``chat_template.jinja`` when present, and ``generation_config.json`` / ``config.json`` for
the end-of-sequence ids.

Ids the tokenizer does not know decode to U+FFFD, one per id. A model's vocabulary may be
larger than its tokenizer's (padded embeddings, or the ``llama-3.1-8b`` test model whose
512-token tokenizer sits under a 128256-row embedding); sampling such an id is legal, and a
visible replacement character keeps one id = some text, so streams and token counts stay
honest. Negative or non-integer ids are a :class:`TokenizerError`.

For byte-level BPE tokenizers (Llama 3, Qwen, Mistral's newer ones) every id maps to a
fixed byte string, so decoding is joining bytes and UTF-8 decoding them; the incremental
detokenizer then emits exactly the complete characters (see ``text/detokenizer.py``).

Long texts: :meth:`Tokenizer.min_tokens` bounds a text's token count from below without
tokenizing it (a token stands for at most ``L`` bytes of input, ``L`` the longest token's length,
so ``B`` bytes need at least ``B / L`` tokens), which lets a caller refuse a prompt that cannot fit
its context before paying for it. :meth:`Tokenizer.encode` runs the Rust tokenizer through
``encode_batch_fast``, which releases the GIL while it works (plain ``encode`` holds it: 8 s for
4 MB with every other Python thread stopped), and with ``limit`` refuses an over-long result
before its ids become a Python list.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from text.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateLimits

__all__ = ["REPLACEMENT", "TokenLimitExceeded", "Tokenizer", "TokenizerError", "byte_to_unicode"]

REPLACEMENT = "\ufffd"
_REPLACEMENT_BYTES = REPLACEMENT.encode()
# Real tokenizer.json files are up to ~20 MB (Llama 3: 9 MB, Qwen 2.5: 7 MB).
_MAX_TOKENIZER_JSON_BYTES = 64 * 1024 * 1024
_MAX_CONFIG_JSON_BYTES = 16 * 1024 * 1024
# Texts at least this long give their encoding's memory back to the OS once done: the Rust side
# allocates hundreds of bytes per token in its worker threads' malloc arenas, which glibc keeps.
_TRIM_AFTER_CHARS = 1 << 20
# Normalizers that map each character to one or more characters (never to none): a character
# is at most 4 UTF-8 bytes and its image at least 1, so they shrink the input at most 4 times.
_NORMALIZERS_PER_CHAR = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
# Pre-tokenizers that split or map the input without dropping any of it.
_PRE_TOKENIZERS_KEEPING = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                                     "Punctuation"})


class TokenizerError(ValueError):
    """A tokenizer folder cannot be read, or ids/text given to it are invalid."""


class TokenLimitExceeded(TokenizerError):
    """A text has ``tokens`` tokens (``exact``) or at least that many (not ``exact``), which is
    not under ``limit``."""

    def __init__(self, tokens: int, limit: int, *, exact: bool) -> None:
        self.tokens, self.limit, self.exact = tokens, limit, exact
        super().__init__(f"the text has {'' if exact else 'at least '}{tokens} tokens; at most {limit - 1} fit")


def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte value to the printable character standing for it.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, a few others)
    are shifted to code points from 256 up, in byte order, so no symbol is whitespace.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    kept = set(keep)
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _read_text(path: Path, limit: int) -> str:
    try:
        size = path.stat().st_size
        if size > limit:
            raise TokenizerError(f"{path} is {size} bytes (at most {limit})")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None


def _read_json(path: Path, limit: int, text: str | None = None) -> Any:
    try:
        return json.loads(_read_text(path, limit) if text is None else text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any, what: str) -> list[int]:
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TokenizerError(f"{what} must be a non-negative integer or a list of them")
        out.append(v)
    return out


def _is_byte_level(spec: Mapping[str, Any]) -> bool:
    decoder = spec.get("decoder") or {}
    model = spec.get("model") or {}
    if decoder.get("type") == "Sequence":
        parts = decoder.get("decoders") or []
        byte_level = bool(parts) and all(p.get("type") == "ByteLevel" for p in parts)
    else:
        byte_level = decoder.get("type") == "ByteLevel"
    return byte_level and model.get("type") == "BPE"


def _shrink_factor(spec: Mapping[str, Any]) -> int | None:
    """How many input bytes one byte of the model's input can stand for after normalization and
    pre-tokenization, when that is bounded; None when a step may drop input (stripping, replacing,
    whitespace splitting), an unknown token may swallow a run of characters, or the result is
    truncated: then no lower bound on the token count can be promised."""
    if spec.get("truncation"):
        return None

    def parts(node: Any, key: str) -> list[Mapping[str, Any]] | None:
        if node is None:
            return []
        if not isinstance(node, Mapping):
            return None
        if node.get("type") == "Sequence":
            out: list[Mapping[str, Any]] = []
            for sub in node.get(key) or []:
                found = parts(sub, key)
                if found is None:
                    return None
                out.extend(found)
            return out
        return [node]

    factor = 1
    normalizers = parts(spec.get("normalizer"), "normalizers")
    if normalizers is None:
        return None
    for n in normalizers:
        kind = n.get("type")
        if kind in _NORMALIZERS_PER_CHAR:
            factor *= 4
        elif kind == "Prepend":
            continue
        elif kind == "Replace":
            pattern, content = n.get("pattern") or {}, n.get("content")
            find = pattern.get("String") if isinstance(pattern, Mapping) else None
            # A fixed string replaced by one at least as long never shrinks the input.
            if not (isinstance(find, str) and isinstance(content, str) and len(content.encode()) >= len(find.encode())):
                return None
        else:
            return None
    pre = parts(spec.get("pre_tokenizer"), "pretokenizers")
    if pre is None:
        return None
    for p in pre:
        if p.get("type") not in _PRE_TOKENIZERS_KEEPING or p.get("behavior") == "Removed":
            return None
    model = spec.get("model") or {}
    vocab = model.get("vocab") if isinstance(model.get("vocab"), Mapping) else {}
    if model.get("type") == "BPE":
        if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return factor  # an unknown character becomes its bytes, one token each
        if any(p.get("type") == "ByteLevel" for p in pre) and all(ch in vocab for ch in byte_to_unicode().values()):
            return factor  # every input byte is a symbol of the vocabulary
        if model.get("unk_token") is not None and not model.get("fuse_unk"):
            return factor  # one unknown token per unknown character
        return None  # unknown characters dropped, or a run of them fused into one token
    if model.get("type") == "Unigram" and model.get("byte_fallback"):
        pieces = {p[0] for p in model.get("vocab") or [] if isinstance(p, list) and p}
        if all(f"<0x{b:02X}>" in pieces for b in range(256)):
            return factor
    return None  # WordPiece, WordLevel, Unigram without byte fallback: an unknown word is one token


def _trim_heap() -> None:
    """Give freed heap back to the OS (glibc keeps it in its arenas otherwise); a no-op elsewhere."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


_LIBC = _libc()


class Tokenizer:
    """A model's tokenizer. Immutable after construction; safe to share between threads."""

    def __init__(
        self,
        backend: Any,
        *,
        byte_level: bool,
        special_tokens: Mapping[str, str],
        eos_token_ids: Iterable[int],
        bos_token_id: int | None,
        chat_template: str | None,
        chat_limits: ChatTemplateLimits | None = None,
        shrink_factor: int | None = None,
    ) -> None:
        """``shrink_factor``: how many input bytes a byte after normalization may stand for, or
        None when the token count has no lower bound from the length (see :meth:`min_tokens`)."""
        self._backend = backend
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        # Compiled once here; a broken template fails chat requests, not the whole model.
        self._compiled: ChatTemplate | None = None
        self._compile_error: ChatTemplateError | None = None
        if chat_template is not None:
            try:
                self._compiled = ChatTemplate(chat_template, chat_limits)
            except ChatTemplateError as e:
                self._compile_error = e
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._bytes: list[bytes | None] | None = None
        if byte_level:
            table: list[bytes | None] = [None] * self.vocab_size
            # Symbol → the Latin-1 character of its byte, so a whole token converts with one
            # translate + encode (a 128k vocabulary in well under a second).
            to_latin1 = {ord(ch): b for b, ch in byte_to_unicode().items()}
            for token, i in backend.get_vocab(with_added_tokens=False).items():
                try:
                    table[i] = token.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:  # a symbol outside the byte alphabet: keep as text
                    table[i] = b"".join(
                        bytes([to_latin1[ord(c)]]) if ord(c) in to_latin1 else c.encode()
                        for c in token
                    )
            for i, t in added.items():
                table[i] = t.content.encode()
            self._bytes = table
        # The longest token in bytes of input: added tokens match their content in the raw text;
        # a vocabulary token's string is at least as long as the input it stands for (byte-level
        # symbols and SentencePiece's "\u2581" are longer than the byte they stand for).
        longest = max((len(t.content.encode()) for t in added.values()), default=1)
        if self._bytes is not None:
            longest = max(longest, max((len(b) for b in self._bytes if b), default=1))
        else:
            longest = max(longest, max((len(t.encode()) for t in vocab), default=1))
        # An added token that strips the whitespace beside it stands for any run of it: no bound.
        if any(t.lstrip or t.rstrip for t in added.values()):
            shrink_factor = None
        self._bytes_per_token: int | None = None if shrink_factor is None else max(1, longest) * shrink_factor

    @classmethod
    def from_dir(
        cls, model_dir: str | os.PathLike[str], *, chat_limits: ChatTemplateLimits | None = None
    ) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder (``tokenizer.json`` required)."""
        from tokenizers import Tokenizer as Backend

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{d} has no tokenizer.json (only fast tokenizers are supported)")
        raw = _read_text(path, _MAX_TOKENIZER_JSON_BYTES)
        spec = _read_json(path, _MAX_TOKENIZER_JSON_BYTES, raw)
        if not isinstance(spec, dict):
            raise TokenizerError(f"{path} must hold a JSON object")
        try:
            backend = Backend.from_str(raw)
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{path} is not a valid tokenizer: {e}") from None

        def optional(name: str) -> dict[str, Any]:
            p = d / name
            data = _read_json(p, _MAX_CONFIG_JSON_BYTES) if p.is_file() else {}
            if not isinstance(data, dict):
                raise TokenizerError(f"{p} must hold a JSON object")
            return data

        config = optional("tokenizer_config.json")
        generation = optional("generation_config.json")
        model_config = optional("config.json")

        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(key))
            if text is not None:
                special[key] = text

        def token_id(key: str) -> int | None:
            return backend.token_to_id(special[key]) if key in special else None

        eos = _id_list(
            generation.get("eos_token_id", model_config.get("eos_token_id")), "eos_token_id"
        )
        if token_id("eos_token") is not None:
            eos.append(token_id("eos_token"))
        bos = token_id("bos_token")
        if bos is None:
            found = _id_list(
                generation.get("bos_token_id", model_config.get("bos_token_id")), "bos_token_id"
            )
            bos = found[0] if found else None

        template_file = d / "chat_template.jinja"
        if template_file.is_file():
            template: Any = _read_text(template_file, _MAX_CONFIG_JSON_BYTES)
        else:
            template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{d}: chat_template must be a string")
        return cls(
            backend,
            byte_level=_is_byte_level(spec),
            special_tokens=special,
            eos_token_ids=eos,
            bos_token_id=bos,
            chat_template=template,
            chat_limits=chat_limits,
            shrink_factor=_shrink_factor(spec),
        )

    # -- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, *, limit: int | None = None) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (bos).

        Text produced by :meth:`apply_chat_template` already holds the bos token: encode it
        with ``add_special_tokens=False``. With ``limit``, a text of ``limit`` tokens or more
        raises :class:`TokenLimitExceeded`: at once when :meth:`min_tokens` already says so,
        else after tokenizing, before the ids are built. The GIL is released while the Rust side
        works, so a long text tokenized in a thread does not stop the others.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode needs a str, got {type(text).__name__}")
        if limit is not None and (at_least := self.min_tokens(text)) >= limit:
            raise TokenLimitExceeded(at_least, limit, exact=False)
        try:
            enc = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
            if limit is not None and len(enc) >= limit:
                raise TokenLimitExceeded(len(enc), limit, exact=True)
            return enc.ids
        finally:
            enc = None
            if len(text) >= _TRIM_AFTER_CHARS:
                _trim_heap()

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text`` (0 when none can be promised).

        A token stands for at most ``L`` bytes of input (the longest token, times how much the
        tokenizer's normalizer may shrink its input), so ``B`` bytes need at least ``B / L``
        tokens. O(1) for ASCII text; one UTF-8 pass otherwise.
        """
        if self._bytes_per_token is None:
            return 0
        n = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return -(-n // self._bytes_per_token)

    def validate_ids(self, ids: Iterable[int]) -> None:
        """Raise :class:`TokenizerError` unless every id is a non-negative int."""
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise TokenizerError(f"token ids must be non-negative integers, got {i!r}")

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes | None:
        """The UTF-8 bytes ``token_id`` stands for; None unless the tokenizer is byte-level."""
        if self._bytes is None:
            return None
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        found = self._bytes[token_id] if token_id < len(self._bytes) else None
        return _REPLACEMENT_BYTES if found is None else found

    @property
    def is_byte_level(self) -> bool:
        return self._bytes is not None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; unknown ids give U+FFFD, invalid UTF-8 gives U+FFFD per maximal
        invalid sequence (as ``bytes.decode(errors="replace")``)."""
        ids = list(ids)
        self.validate_ids(ids)
        if self._bytes is not None:
            raw = b"".join(self.token_bytes(i, skip_special_tokens) or b"" for i in ids)
            return raw.decode("utf-8", errors="replace")
        return self._decode_runs(ids, skip_special_tokens)

    def _decode_runs(self, ids: list[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._backend.id_to_token(i) is None:
                if run:
                    out.append(self._backend.decode(run, skip_special_tokens=skip_special_tokens))
                    run = []
                out.append(REPLACEMENT)
            else:
                run.append(i)
        if run:
            out.append(self._backend.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(out)

    def token_name(self, token_id: int) -> str | None:
        """The vocabulary's string for ``token_id`` (e.g. ``"<0xE2>"``, ``"\u2581the"``); None if unknown."""
        return self._backend.id_to_token(token_id)

    def knows(self, token_id: int) -> bool:
        """Whether the tokenizer has a token for ``token_id``."""
        return self._backend.id_to_token(token_id) is not None

    # -- chat ------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template (bounded sandbox).

        The template sees ``messages``, ``add_generation_prompt``, the special tokens
        (``bos_token``, ``eos_token``, ...) and ``variables`` (e.g. ``tools``), as in
        transformers. Raises :class:`ChatTemplateError` for a missing, invalid or runaway
        template and for messages past the limits.
        """
        if self._compile_error is not None:
            raise ChatTemplateError(str(self._compile_error))
        if self._compiled is None:
            raise ChatTemplateError("this model has no chat template")
        merged = {**self.special_tokens, **variables}
        merged["add_generation_prompt"] = bool(add_generation_prompt)
        return self._compiled.render(messages, **merged)
