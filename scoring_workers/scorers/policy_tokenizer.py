"""The policy's tokenizer, for OpenClaw-RL's view of a judged turn.

OpenClaw-RL shows its judge each turn as the policy's chat template renders it: the
thinking block, the content, tool calls in the template's own syntax and the end-of-turn
marker. A turn's output tokens *are* that rendering as the policy generated it, so
decoding them with the policy's tokenizer (special tokens kept) gives the judge the
same text without rendering any template. The ``tokenizers`` package loads a
``tokenizer.json`` on its own, without ``transformers`` or any model download
(install it with the ``tokenizer`` extra).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

from infra.config import ConfigError

__all__ = ["load_policy_decoder"]


@functools.lru_cache(maxsize=8)
def load_policy_decoder(path: str) -> Callable[[Sequence[int]], str]:
    """``token ids -> text`` with the tokenizer in ``path`` (a ``tokenizer.json`` file or a
    directory holding one), special tokens kept. Loaded once per path and process.

    Raises:
        ValueError: no such file, or it is not a tokenizer the package can read.
        ImportError: the ``tokenizers`` package is not installed.
    """
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(f"policy_tokenizer {path!r}: no tokenizer.json there")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        exc.add_note("policy_tokenizer needs the 'tokenizers' package: pip install 'prm-pipeline[tokenizer]'")
        raise
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises a bare Exception
        raise ConfigError(f"policy_tokenizer {path!r}: cannot load {file}: {exc}") from None

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)

    return decode
