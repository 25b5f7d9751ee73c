"""Random prompts of an exact length in the served model's tokens (no Django).

Words are costed once per sweep: how many tokens each common word takes at the start of a prompt and
after a space, and how many tokens the endpoint adds around the text (the chat template, a BOS).
Tokenizers split text at spaces before merging (byte-level BPE, SentencePiece, tiktoken-style
pre-tokenizers alike), so a prompt's length is the sum of its words' costs plus that overhead.
Costs come from the server's POST /tokenize; without it, from the model's tokenizer.json; without
either, one token per word (the old approximation, labelled as such).
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from deployments.host import vllm

from .spec import CHAT, LoadSpec

log = logging.getLogger(__name__)

# Common short words: about one token each in most vocabularies.
WORDS = tuple((
    "the of and to in is was for on that with as by at from it his an were are which this be "
    "or has had not but one new first also after who two its they have more her been other when "
    "time would there all she into some year can out over only may most about up so world many "
    "then where these used such between state city part through during well three around made "
    "under work water long large high place house group people light early number small"
).split())
PROBE = "hello"
ANCHOR = "hello"  # the word before each one costed "after a space"
SERVER, FILES, WORDS_ONLY = "server /tokenize", "tokenizer files", "words (about 1 token each)"


class _ServerCounter:
    def __init__(self, spec: LoadSpec, root_url: str):
        self.url, self.model, self.chat, self.key = root_url, spec.model, spec.endpoint == CHAT, spec.api_key

    def count(self, text: str) -> int:
        return len(vllm.tokenize(self.url, self.model, prompt=text, add_special_tokens=False, key=self.key))

    def full(self, text: str) -> int:
        """Tokens the endpoint sees for `text` (template and special tokens included)."""
        if self.chat:
            return len(vllm.tokenize(self.url, self.model, messages=[{"role": "user", "content": text}], key=self.key))
        return len(vllm.tokenize(self.url, self.model, prompt=text, key=self.key))


class _FileCounter:
    """The model's tokenizer.json; a chat template is not rendered here, so chat overhead counts only
    the special tokens the tokenizer adds (labelled)."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer  # optional: only this fallback needs it

        self.tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def full(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)


@dataclass
class PromptLengths:
    """Word costs in the model's tokens and the endpoint's overhead; builds prompts of an exact length."""

    source: str = WORDS_ONLY
    overhead: int = 0
    first: dict = field(default_factory=dict)  # word -> tokens at the start of a prompt
    after: dict = field(default_factory=dict)  # word -> tokens after a space
    counter: object = None
    anchor_tokens: int | None = None

    def _cost(self, word: str, first: bool) -> int:
        table = self.first if first else self.after
        if word not in table:
            if not self.counter:
                table[word] = 1
            elif first:
                table[word] = max(1, self.counter.count(word))
            else:
                # After an anchor word rather than alone: SentencePiece writes a lone " the" with an extra
                # space piece that "a the" does not have.
                anchor = self._anchor()
                table[word] = max(1, self.counter.count(f"{ANCHOR} {word}") - anchor)
        return table[word]

    def _anchor(self) -> int:
        if self.anchor_tokens is None:
            self.anchor_tokens = self.counter.count(ANCHOR)
        return self.anchor_tokens

    def _cost_all(self) -> None:
        if len(self.first) < len(WORDS) or len(self.after) < len(WORDS):
            for word in WORDS:
                self._cost(word, True)
                self._cost(word, False)

    def costed(self) -> PromptLengths:
        """A copy with every word's cost known and no counter: what a measuring process takes with it
        (small and picklable; it never asks the server again)."""
        self._cost_all()
        return PromptLengths(self.source, self.overhead, dict(self.first), dict(self.after))

    def prompt(self, rng: random.Random, tokens: int) -> str:
        """A random prompt the endpoint will count as `tokens` tokens (at least one word)."""
        self._cost_all()  # first, so that a prompt depends on the seed only, never on what was costed before
        left = max(1, tokens - self.overhead)
        word = rng.choice(WORDS)
        words, left = [word], left - self._cost(word, True)
        # Bulk draws while far from the end (a 200,000-token prompt in ~20 ms, not ~120): `left // most`
        # words never cost more than what is left, so the exact word-by-word end below still applies.
        most = max(self.after.values())
        while left > 4 * most:
            batch = rng.choices(WORDS, k=left // most)
            words += batch
            left -= sum(map(self.after.__getitem__, batch))
        while left > 0:
            word = rng.choice(WORDS)
            cost = self._cost(word, False)
            if cost > left:  # near the end: only words that fit
                fitting = [w for w in WORDS if self._cost(w, False) <= left]
                if not fitting:
                    break
                word = rng.choice(fitting)
                cost = self._cost(word, False)
            words.append(word)
            left -= cost
        return " ".join(words)

    def measure(self, text: str) -> int | None:
        """What the endpoint counts for `text`, when a tokenizer is known."""
        return self.counter.full(text) if self.counter else None


def prompt_lengths(spec: LoadSpec, root_url: str) -> PromptLengths:
    """Costs from the server's /tokenize, else the tokenizer files at spec.tokenizer_path, else words."""
    try:
        counter = _ServerCounter(spec, root_url)
        lengths = PromptLengths(SERVER, counter=counter)
        lengths.overhead = counter.full(PROBE) - counter.count(PROBE)
        for word in WORDS:  # one pass now, so no request waits on a tokenization later
            lengths._cost(word, False)
        return lengths
    except vllm.VllmError as exc:
        log.info("no /tokenize at %s (%s): trying the model's tokenizer files", root_url, exc)
    if spec.tokenizer_path:
        try:
            counter = _FileCounter(spec.tokenizer_path)
            chat = spec.endpoint == CHAT and _has_chat_template(spec.tokenizer_path)
            source = FILES + (" (chat template not counted)" if chat else "")
            return PromptLengths(source, overhead=counter.full(PROBE) - counter.count(PROBE), counter=counter)
        except Exception as exc:  # noqa: BLE001 - a missing library or a bad file falls back to words
            log.info("tokenizer files at %s unusable (%s): prompt lengths in words", spec.tokenizer_path, exc)
    return PromptLengths()


def _has_chat_template(folder: str) -> bool:
    path = Path(folder)
    if (path / "chat_template.jinja").exists():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False
