"""A prompt refused before it is rendered: its text alone cannot fit the context.

Templating and tokenizing a 10 MB prompt cost the proxy 10-27 s of CPU and a gigabyte
of memory, only for the engine to answer "prompt has 2097161 tokens; the context limit is
32768" (issue 33). A token stands for at most so many bytes of text
(``services.common.tokenization.bounds``), so the text the prompt must hold (every
system, developer, user and tool message's) gives the fewest tokens it can have without
tokenizing it; over the context, the call is refused with the 400 the engine would give
(``PromptTooLong``: kind ``context_length``, in the caller's protocol).

Assistant turns are not counted: a template may drop an earlier turn's reasoning, and
token mode sends the history as it was sampled, not as the harness echoes it. Tool
definitions are not either (a template writes them its own way). Both only make the
floor lower, never wrong.

``max_body_bytes`` is the other limit: a body over it is refused (413) before it is
read. It must stay above this bound to let it act, and well above it where requests
carry images (base64 bytes that are no text); with the defaults (16 MiB, a 32k-token
model of a byte-level vocabulary: 4 MiB of text) both do.
"""

from __future__ import annotations

from proxy.conversation import Conversation, TextPart
from proxy.errors import PromptTooLong
from services.common.tokenization import ChatTokenizer
from services.common.tokenization.bounds import TokenFloor

# the messages whose text every chat template renders as it is
PROMPT_ROLES = frozenset({"system", "developer", "user", "tool"})
UTF8_MAX_BYTES = 4  # a character's most bytes: a request with fewer chars needs no count


class PromptBound:
    def __init__(self, context_tokens: int, floor: TokenFloor) -> None:
        self.context_tokens, self.floor = context_tokens, floor
        self.refused_bytes = floor.refused_bytes(context_tokens)
        self._quick_chars = self.refused_bytes // UTF8_MAX_BYTES

    @classmethod
    def of(cls, tok: ChatTokenizer | None, context_tokens: int | None) -> PromptBound | None:
        """The bound of ``tok``'s vocabulary at ``context_tokens`` (None: no tokenizer,
        no known context, or a vocabulary with no floor)."""
        if tok is None or not context_tokens or context_tokens <= 0:
            return None
        floor = tok.token_floor
        return cls(context_tokens, floor) if floor is not None else None

    def refusal(self, conv: Conversation) -> PromptTooLong | None:
        """The error for a conversation that cannot fit, else None. Asked before the
        request is converted for its record: a refused one never is. A short request
        costs a sum of lengths (~1 µs for a few messages)."""
        texts = prompt_texts(conv)
        if sum(map(len, texts)) < self._quick_chars:
            return None
        tokens = self.floor.tokens(texts)  # ASCII: its length; else its bytes, counted
        if tokens <= self.context_tokens:
            return None
        return PromptTooLong(
            f"prompt has at least {tokens} tokens; the context limit is {self.context_tokens}"
        )

    def describe(self) -> str:
        return (
            f"prompts over {self.context_tokens} tokens ({self.refused_bytes} bytes of ASCII "
            f"text at {self.floor.max_token_bytes} bytes a token) refused before templating"
        )


def prompt_texts(conv: Conversation) -> list[str]:
    """The texts of ``conv`` that its prompt holds whatever the template."""
    texts = [conv.system]
    for m in conv.messages:
        if m.role in PROMPT_ROLES:
            for p in m.content:
                if type(p) is TextPart:
                    texts.append(p.text)
    return texts
