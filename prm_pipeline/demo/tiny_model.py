"""A tiny real causal LM for the demo and the alignment tests: no download, seconds to build.

Nothing here is a good language model; everything here is a *real* one: a seeded
``transformers`` Llama (2 layers, hidden 64, float32, CPU) over a byte-level BPE
tokenizer trained in code (``tokenizers``) on a corpus generated below, with a
ChatML-style chat template. Token ids, sampled outputs and per-token log-probs are
computed by the model, so off-by-one alignment bugs between the rollout, the scorers
and the trainer show up as numbers, not as hypotheses.

The chat template works on token ids, message by message
(``<|im_start|>`` + ``role\\ncontent`` + ``<|im_end|>`` + ``\\n``), so a rollout can
extend a turn's input with the model's own output ids and the next message's ids —
concat export — without ever re-tokenising text.

Weights travel as safetensors files through :class:`WeightStore` (never pickle): the
trainer publishes ``policy-v<N>.safetensors`` and the rollout proxy reloads when the
store's version moves on.

Needs the ``demo`` extra (``transformers``, ``tokenizers``); the workers and the
shaper never import this module.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prm_pipeline.demo.policy_update import next_token_logprobs

__all__ = [
    "EOS_ID",
    "IM_START_ID",
    "PAD_ID",
    "ChatTemplate",
    "Sample",
    "TinyLMConfig",
    "TinyPolicy",
    "WeightStore",
    "build_tokenizer",
]

SPECIAL_TOKENS = ("<|pad|>", "<|im_start|>", "<|im_end|>")
PAD_ID, IM_START_ID, EOS_ID = 0, 1, 2

_WORDS = (
    "add sum total plus minus times result answer check value number compute calculator tool user "
    "assistant please thanks ok wrong error again try step first then next final is the of to and a "
    "carry digit zero one two three four five six seven eight nine ten hint instruction done"
).split()


def corpus(seed: int = 0, lines: int = 600) -> list[str]:
    """A small generated corpus: arithmetic, calculator calls and chatty filler."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
        out.append(
            rng.choice(
                [
                    f"compute {a} {op} {b}",
                    f"calc({a}{op}{b})",
                    f"result: {a * b}",
                    f"{words} {a} {op} {b}",
                    f"{words}.",
                    f"the answer is {a + b}",
                    f"error: {words}",
                    f"ok thanks {words}",
                ]
            )
        )
    return out


@functools.lru_cache(maxsize=4)
def build_tokenizer(vocab_size: int = 384, seed: int = 0) -> Any:
    """A byte-level BPE trained on :func:`corpus` (deterministic; bytes outside ASCII are dropped)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The alphabet is printable ASCII + newline (as byte-level symbols), so a random model
    # samples readable nonsense rather than broken UTF-8; the demo's texts are ASCII.
    ascii_bytes = [*range(0x20, 0x7F), 0x0A]
    alphabet = [pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(chr(b))[0][0] for b in ascii_bytes]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, IM_START_ID, EOS_ID]
    return tok


class ChatTemplate:
    """ChatML on token ids: each message is ``<|im_start|>role\\ncontent<|im_end|>\\n``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._newline = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def message(self, message: Mapping[str, Any]) -> list[int]:
        role, content = str(message.get("role", "user")), str(message.get("content") or "")
        return [IM_START_ID, *self.encode(f"{role}\n{content}"), EOS_ID, *self._newline]

    def generation_prompt(self) -> list[int]:
        return [IM_START_ID, *self.encode("assistant\n")]

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        ids = [t for m in messages for t in self.message(m)]
        return ids + self.generation_prompt() if add_generation_prompt else ids

    def continuation(self, output_ended: bool, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids that follow an assistant output (concat export): close it, add ``messages``, prompt again."""
        close = self._newline if output_ended else [EOS_ID, *self._newline]
        return [*close, *self.render(messages)]


@dataclass(frozen=True, slots=True)
class TinyLMConfig:
    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 2048
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled continuation: ids, their log-probs under the sampling policy, why it stopped."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (EOS sampled) | "length"


class TinyPolicy:
    """The model + tokenizer + template, with sampling and a version number."""

    def __init__(self, model: Any, tokenizer: Any, version: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.version = version

    @classmethod
    def create(cls, config: TinyLMConfig | None = None) -> TinyPolicy:
        """A freshly initialised policy; the same ``seed`` gives the same weights."""
        from transformers import LlamaConfig, LlamaForCausalLM

        c = config or TinyLMConfig()
        tokenizer = build_tokenizer(c.vocab_size)
        torch.manual_seed(c.seed)
        llama = LlamaConfig(
            vocab_size=tokenizer.get_vocab_size(),
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_heads,
            max_position_embeddings=c.max_positions,
            tie_word_embeddings=False,
            pad_token_id=PAD_ID,
            bos_token_id=IM_START_ID,
            eos_token_id=EOS_ID,
        )
        model = LlamaForCausalLM(llama).float().eval()
        return cls(model, tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _cache_kwarg(self) -> str:
        """``cache`` (transformers 5) or ``past_key_values`` (4.x): the KV-cache argument's name."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def sample(self, prompt: Sequence[int], max_new_tokens: int, generator: torch.Generator) -> Sample:
        """Sample at temperature 1 with the KV cache, as an inference server would."""
        device = self.device
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        out = self.model(input_ids=ids, use_cache=True)
        key = self._cache_kwarg()
        tokens: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu()  # the generator lives on the CPU
            token = int(torch.multinomial(logp.exp(), 1, generator=generator).item())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            if token == EOS_ID:
                return Sample(tokens, logprobs, "stop")
            past = out.cache if key == "cache" else out.past_key_values
            out = self.model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{key: past})
        return Sample(tokens, logprobs, "length")

    @torch.no_grad()
    def prompt_logprobs(self, input_ids: Sequence[int]) -> list[float | None]:
        """SGLang's ``input_token_logprobs``: entry ``i`` is ``log p(ids[i] | ids[:i])``; ``None`` at 0."""
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        if ids.shape[1] == 0:
            return []
        lp = next_token_logprobs(self.model, ids)[0, :-1].tolist()
        return [None, *lp]

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(dict(state))
        self.version = version


class WeightStore:
    """Published policy weights in a directory: ``policy-v<N>.safetensors`` plus ``LATEST``.

    Writes are atomic (temp file + rename, the weights before the pointer), so a reader
    sees either the previous version or the complete new one.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"policy-v{version}.safetensors"

    def publish(self, model: Any, version: int) -> Path:
        from safetensors.torch import save_file

        target = self.path(version)
        tmp = target.with_suffix(".tmp")
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp))
        os.replace(tmp, target)
        pointer = self.root / "LATEST.tmp"
        pointer.write_text(json.dumps({"version": version, "file": target.name}))
        os.replace(pointer, self.root / "LATEST")
        return target

    def latest(self) -> int | None:
        try:
            return int(json.loads((self.root / "LATEST").read_text())["version"])
        except FileNotFoundError:
            return None

    def reload(self, policy: TinyPolicy) -> bool:
        """Load the latest published weights into ``policy`` if they are newer; True if it did."""
        from safetensors.torch import load_file

        version = self.latest()
        if version is None or version <= policy.version:
            return False
        policy.load_state(load_file(str(self.path(version))), version)
        return True
