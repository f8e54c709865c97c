"""The test models' tokenizer: byte-level BPE learned from ``modelgen/data/corpus.txt``.

Ids 0..255 are the 256 single bytes (in byte order), then the learned merges in the order
they were learned, then the special tokens. The merges are learned here, in plain Python,
rather than with ``tokenizers``' trainer so that ids and merge order are fixed by this
code alone (ties broken by the pair's text), and the result is then handed to
``tokenizers`` to build and serialize an ordinary ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path

from collections import Counter
from typing import Any

from text.tokenizer import byte_to_unicode

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
PAD_TOKEN = "<|pad|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, START_HEADER, END_HEADER, EOT_TOKEN, PAD_TOKEN)

# 256 bytes + merges + specials = 512: a round vocabulary, so tiny/small models use it as is.
DEFAULT_VOCAB_SIZE = 512

# Llama-3 style chat template. `trim` on the content and the bos at the start follow
# Llama 3's own template; list-of-parts content (OpenAI's multi-part messages) keeps the
# text parts, and a missing content (an assistant turn with tool calls) renders empty.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- elif message['content'] is none %}\n"
    "        {%- set content = '' %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '" + START_HEADER + "' + message['role'] + '" + END_HEADER + "\\n\\n'"
    " + content | trim + '" + EOT_TOKEN + "' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '" + START_HEADER + "assistant" + END_HEADER + "\\n\\n' }}\n"
    "{%- endif %}\n"
)


class TokenizerBuildError(ValueError):
    """The corpus or the requested size cannot make a tokenizer."""


def load_corpus() -> str:
    """The text shipped in ``modelgen/data/corpus.txt``."""
    # Beside this file rather than importlib.resources: an editable install can make "engine"
    # resolve as a namespace package there, which resources cannot read from.
    return (Path(__file__).resolve().parent / "data" / "corpus.txt").read_text(encoding="utf-8")


def _pre_tokenizer() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``num_merges`` BPE merges over ``text``'s byte-level words.

    Each step merges the most frequent adjacent pair (ties: the smallest pair by text),
    and stops early when no pair occurs twice, so a short text yields fewer merges.
    """
    if num_merges < 0:
        raise TokenizerBuildError(f"num_merges must be >= 0, got {num_merges}")
    word_counts = Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(text))
    words: dict[tuple[str, ...], int] = {}
    for word, count in sorted(word_counts.items()):
        words[tuple(word)] = count
    pairs: Counter[tuple[str, str]] = Counter()
    for symbols, count in words.items():
        for pair in zip(symbols, symbols[1:]):
            pairs[pair] += count
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        live = [(pair, count) for pair, count in pairs.items() if count > 0]
        if not live:
            break
        best, best_count = min(live, key=lambda kv: (-kv[1], kv[0]))
        if best_count < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        # Only words holding the pair change; their pair counts are swapped out and in.
        for symbols in [w for w in words if best[0] in w and best[1] in w]:
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            new = tuple(out)
            if new == symbols:
                continue
            count = words.pop(symbols)
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] -= count
            for pair in zip(new, new[1:]):
                pairs[pair] += count
            words[new] = words.get(new, 0) + count
    return merges


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, text: str | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` of at most ``vocab_size`` tokens (bytes, merges, specials).

    Encoding adds ``<|begin_of_text|>`` in front (as Llama 3 does); decoding maps the
    byte-level symbols back to UTF-8.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    num_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if num_merges < 0:
        raise TokenizerBuildError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}"
        )
    merges = learn_merges(load_corpus() if text is None else text, num_merges)
    table = byte_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def special_ids(tok: Any) -> dict[str, int]:
    """Ids of the special tokens in a tokenizer made by :func:`build_tokenizer`."""
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def tokenizer_config(tok: Any, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``tok``: specials, the chat template, no extra bos."""
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in special_ids(tok).items()
    }
    return {
        "added_tokens_decoder": decoder,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": PAD_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
