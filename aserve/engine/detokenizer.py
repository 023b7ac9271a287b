"""`IncrementalDetokenizer`: one request's output token ids → text, a few tokens at a time, plus
its stop strings.

It decodes a small window of ids rather than the whole output each step (the prefix/read offset
scheme):

    ids:   ... p p p | a b c | d e
                     ^prefix ^read  (end)
    text = decode(a b c d e); prefix_text = decode(a b c); new text = text[len(prefix_text):]

`a b c` are the tokens whose text came out last time, kept as context so that decoders that
look at neighbouring tokens (a SentencePiece leading space, a UTF-8 character split over byte
tokens) decode `d e` as they would inside the full output. New text is held back while it ends
in U+FFFD (what an incomplete UTF-8 sequence decodes to) or while the ids end in a ByteFallback
`<0xNN>` token (a run of those decodes as a whole), until a later token completes it or the
request finishes. So text comes out only at character boundaries, and the pieces add up to the
full decode.

The window starts with the last few prompt tokens, as vLLM's does, so that with SentencePiece
decoders (Metaspace + Strip) the first output token keeps its leading space; there
`output_text` is `decode(output ids)` plus that space. With a byte-level BPE they are equal.

tokenizers' `DecodeStream` does the same windowing in Rust, but it never flushes a trailing
incomplete sequence and raises on ByteFallback runs that turn invalid, so it is not used.
It is not used for the prompt, and it ignores `spaces_between_special_tokens`, as transformers'
fast tokenizers do.
"""

from __future__ import annotations

from collections.abc import Sequence

from aserve.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
NUM_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of one request's output so far, and whether a stop string has appeared in it."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 defer: bool = False) -> None:
        """`defer`: keep the ids and decode them once, when the request finishes (for a request
        whose text nobody reads before then and that has no stop strings to watch for: an
        offline `generate`); the text is the same, for one decode instead of two per step."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in stop if s]
        self.defer = defer and not self.stop
        self.include_stop_str_in_output = include_stop_str_in_output
        # Characters `get_next_output_text` holds back so a stop string never streams partially.
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1 if self.stop and not include_stop_str_in_output else 0)
        self.stop_str: str | None = None  # the stop string that ended the output, if one did

        self._byte_token_ids = tokenizer.byte_token_ids
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        while self._ends_in_byte_run(context):
            context.pop()  # output bytes must not join a run of prompt bytes
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a UTF-8 sequence: the output must not complete it.
            context, context_text = [], ""
        # The prompt context, then every output id. `update` appends to it; a deferred one's
        # owner may append to it directly (its text is decoded when it finishes).
        self.ids = context
        self._num_context_tokens = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._output_text = ""
        self._num_streamed_chars = 0

    @property
    def output_text(self) -> str:
        return self._output_text

    @property
    def num_output_tokens(self) -> int:
        return len(self.ids) - self._num_context_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.ids[self._num_context_tokens:]

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str | None:
        """Append `new_token_ids` and their text; return the stop string if one now appears, after
        cutting `output_text` at it. `finished` flushes text held back for incomplete UTF-8.
        Once a stop string has matched, further updates change nothing."""
        if self.stop_str is not None:
            return None
        self.ids.extend(new_token_ids)
        if self.defer and not finished:
            return None
        new_text = self._decode_new_text(flush=finished)
        if not new_text:
            return None
        num_old_chars = len(self._output_text)
        self._output_text += new_text
        return self._check_stop_strings(num_old_chars)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to stream now: what is new since the last call if `delta`, else all of it.
        Until the request finishes, the last `stop_buffer_length` characters are held back."""
        finished = finished or self.stop_str is not None
        end = len(self._output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self._output_text[:max(end, 0)]
        if end <= self._num_streamed_chars:
            return ""
        piece = self._output_text[self._num_streamed_chars:end]
        self._num_streamed_chars = end
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self, flush: bool) -> str:
        """Text of the ids past the read offset, or "" while it is empty or ends in an incomplete
        UTF-8 sequence or a byte-token run (unless `flush`). Advances the window when it returns
        text."""
        if not flush and self._ends_in_byte_run(self.ids):
            return ""
        text = self._decode(self.ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text):
            return ""
        if text.endswith(REPLACEMENT_CHAR) and not flush:
            return ""
        if text.startswith(self._prefix_text):
            new_text = text[len(self._prefix_text):]
        else:  # a decoder that rewrites earlier text (e.g. WordPiece clean-up): best effort
            common = 0
            while common < len(self._prefix_text) and text[common] == self._prefix_text[common]:
                common += 1
            new_text = text[common:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix_offset:])
        return new_text

    def _ends_in_byte_run(self, ids: list[int]) -> bool:
        """Whether the last of `ids` that the decoder sees is a ByteFallback byte token."""
        if not self._byte_token_ids:
            return False
        skipped = self.tokenizer.skippable_token_ids if self.skip_special_tokens else ()
        for token_id in reversed(ids):
            if token_id not in skipped:
                return token_id in self._byte_token_ids
        return False

    def _check_stop_strings(self, num_old_chars: int) -> str | None:
        """Find the stop string that completes first in the text added after `num_old_chars`
        (it may start in the old text), cut the output there and return it."""
        text = self._output_text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = text.find(stop_str, max(num_old_chars - len(stop_str) + 1, 0))
            if start >= 0 and (best is None or (start + len(stop_str), start) < best[:2]):
                best = (start + len(stop_str), start, stop_str)
        if best is None:
            return None
        end, start, self.stop_str = best
        self._output_text = text[:end] if self.include_stop_str_in_output else text[:start]
        return self.stop_str
