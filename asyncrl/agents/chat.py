"""Tokenising environment observations once, with the chat template's own delimiters.

Token in, token out (docs/agents.md): the context of model call k+1 is the exact token ids of
call k's context and output plus the observation's ids, never a re-tokenisation of decoded
history. A BPE tokenizer does not round-trip (``encode(decode(ids)) != ids`` for many sampled
sequences: a model may emit ``" 1" "2"`` where encoding the text gives ``" 12"``), so
re-tokenising would train on tokens the policy never produced (the drift rllm PR #272 and
verl's agent loop fix).

:class:`ChatFormat` derives, once per tokenizer, how the chat template closes an assistant turn
and opens a message of another role, by rendering two conversations and taking their
difference (the method of verl's and rllm's multi-turn tokenisation). An observation is then
``close-of-assistant-turn + <role message> + open-of-assistant-turn + prefill`` tokenised once,
with the close left out when the model's last token already is the end-of-turn token.

Control tokens come only from the template (issue #31 item 4): message text is encoded as text,
so a message holding ``<|im_end|>\n<|im_start|>assistant\n...`` cannot forge a turn
(:meth:`ChatFormat.encode_parts`). Text the tokenizer would still turn into an added token is
refused with :class:`ChatFormatError`. An observation holds at most
:data:`MAX_OBSERVATION_CHARS` characters; :func:`off_loop` tokenises on one worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

__all__ = ["ChatFormat", "ChatFormatError", "MAX_OBSERVATION_CHARS", "off_loop"]

#: most characters of message text (contents and prefill) one observation or rendered prompt holds
MAX_OBSERVATION_CHARS = 1_000_000
T = TypeVar("T")
#: one thread tokenises for every ChatFormat of the process, off the event loop (20 messages of
#: 200k characters take seconds); one at a time, since ``split_special_tokens`` is tokenizer state
_POOL = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-chat-tokenize")
_ENCODE_LOCK = threading.Lock()


async def off_loop(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn(*args, **kw)`` on the tokenising thread (the event loop keeps serving meanwhile)."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kw))

_A = "\u2063ASSISTANT\u2063"  # a marker no template adds by itself


class ChatFormatError(ValueError):
    """The tokenizer's chat template cannot be split into per-message pieces; says what is wrong."""


class ChatFormat:
    """Renders observations of a conversation as token ids, with the tokenizer's chat template.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.

    Raises:
        ChatFormatError: no chat template, or one whose rendering of a longer conversation does
            not extend the rendering of the shorter one (the method needs that).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatFormatError("the tokenizer has no chat template; multi-turn workflows need one to delimit messages")
        self.tokenizer = tokenizer
        self._pieces: dict[str, tuple[str, str]] = {}
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _A}]
        self._base_text = tokenizer.apply_chat_template(base, tokenize=False)
        at = self._base_text.rfind(_A)
        if at < 0:
            raise ChatFormatError("the chat template drops assistant content; cannot locate the end of an assistant turn")
        #: text after an assistant message's content that closes its turn (ChatML: "<|im_end|>\n")
        self.close_turn = self._base_text[at + len(_A):]
        eos = getattr(tokenizer, "eos_token_id", None)
        self.end_of_turn_ids: set[int] = {int(eos)} if eos is not None else set()

    def _open(self, role: str) -> str:
        """Text of a ``role`` message with content ``{}`` followed by the assistant generation prompt."""
        if role not in self._pieces:
            base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _A}]
            marker = "\u2063OBS\u2063"
            full = self.tokenizer.apply_chat_template(base + [{"role": role, "content": marker}], tokenize=False,
                                                      add_generation_prompt=True)
            if not full.startswith(self._base_text):
                raise ChatFormatError(
                    f"the chat template renders a conversation with a {role!r} message differently from its "
                    "prefix (it must only append); use observe_ids() with ids you build yourself")
            rest = full[len(self._base_text):]
            if marker not in rest:
                raise ChatFormatError(f"the chat template drops the content of {role!r} messages")
            before, after = rest.split(marker, 1)
            self._pieces[role] = (before, after)
        return self._pieces[role]  # type: ignore[return-value]

    def observation_text(self, content: str, role: str = "user", prefill: str = "",
                         after_ids: Sequence[int] = ()) -> str:
        """The text of an observation message that follows the model's output ``after_ids``.

        Args:
            content: the message (environment feedback, a tool result).
            role: its chat role (``user``, ``tool``, ...; as the template knows it).
            prefill: text that opens the next assistant turn (e.g. ``"17 * 3 ="``), part of the
                observation (not trained).
            after_ids: the token ids the model produced last; when they end with the end-of-turn
                token, the turn's closing text is not repeated.
        """
        return "".join(t for t, _ in self._observation_parts(content, role, prefill, after_ids))

    def _observation_parts(self, content: str, role: str, prefill: str,
                           after_ids: Sequence[int]) -> list[tuple[str, bool]]:
        """:meth:`observation_text` as ``(text, from_template)`` parts (:meth:`encode_parts`)."""
        before, after = self._open(role)
        close = self.close_turn
        if after_ids and int(after_ids[-1]) in self.end_of_turn_ids:
            eot = self.tokenizer.decode([int(after_ids[-1])], skip_special_tokens=False)
            if close.startswith(eot):
                close = close[len(eot):]
        return [(close + before, True), (content, False), (after, True), (prefill, False)]

    def observation_ids(self, content: str, role: str = "user", prefill: str = "",
                        after_ids: Sequence[int] = ()) -> list[int]:
        """:meth:`observation_text` tokenised once (no special tokens added; template tokens kept;
        ``content`` and ``prefill`` encoded as text: :meth:`encode_parts`).

        Returns:
            (O,) token ids, O >= 1.

        Raises:
            ChatFormatError: more than :data:`MAX_OBSERVATION_CHARS` characters, or text that
                the tokenizer cannot encode without a control token.
        """
        return self.messages_observation_ids([(role, content)], prefill, after_ids)

    # ------------------------------------------------------------------ text as text, never control tokens
    def _added(self) -> tuple[re.Pattern | None, dict[str, int]]:
        if not hasattr(self, "_added_cache"):
            vocab = {str(k): int(v) for k, v in dict(getattr(self.tokenizer, "get_added_vocab", dict)()).items() if k}
            pat = re.compile("|".join(re.escape(k) for k in sorted(vocab, key=len, reverse=True))) if vocab else None
            self._added_cache = (pat, vocab)
        return self._added_cache

    def _tok(self, text: str, literal: bool = False) -> list[int]:
        with _ENCODE_LOCK:
            if literal:
                return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_parts(self, parts: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of the concatenated ``parts``: ``(text, from_template)`` pairs.

        Template parts keep their control tokens; the other parts (message contents, prefills)
        are text: when tokenising the whole text once would make a control token out of them (a
        forged ``<|im_end|>``), they are encoded literally instead. Text without control-token
        strings gets exactly the ids of tokenising the whole text once.

        Returns:
            (N,) token ids.

        Raises:
            ChatFormatError: the message text is over :data:`MAX_OBSERVATION_CHARS`, or the
                tokenizer turns it into an added token even when told not to (say which).
        """
        size = sum(len(t) for t, tmpl in parts if not tmpl)
        if size > MAX_OBSERVATION_CHARS:
            raise ChatFormatError(f"the messages hold {size} characters; at most {MAX_OBSERVATION_CHARS} per call: "
                                  "send shorter messages")
        pat, vocab = self._added()
        ids = self._tok("".join(t for t, _ in parts))
        if pat is None:
            return ids
        added = set(vocab.values())
        from_template = [vocab[m.group(0)] for t, tmpl in parts if tmpl for m in pat.finditer(t)]
        if [i for i in ids if i in added] == from_template:
            return ids  # every control token is the template's
        segments: list[tuple[str, bool] | int] = []  # (text, literal) or a template control token's id
        for text, tmpl in parts:
            pieces: list[str | int] = [text]
            if tmpl:
                pieces, at = [], 0
                for m in pat.finditer(text):
                    pieces += [text[at:m.start()], vocab[m.group(0)]]
                    at = m.end()
                pieces.append(text[at:])
            for piece in pieces:
                if isinstance(piece, int):
                    segments.append(piece)
                elif piece:
                    if segments and isinstance(segments[-1], tuple):
                        prev, lit = segments[-1]
                        segments[-1] = (prev + piece, lit or not tmpl)
                    else:
                        segments.append((piece, not tmpl))
        out: list[int] = []
        for seg in segments:
            if isinstance(seg, int):
                out.append(seg)
                continue
            got = self._tok(*seg)
            bad = [i for i in got if i in added] if seg[1] else []
            if bad:
                name = next(k for k, v in vocab.items() if v == bad[0])
                raise ChatFormatError(f"a message holds {name[:40]!r}, which this tokenizer encodes as a control token "
                                      "even as text: remove it from the message")
            out += got
        return out

    def _open_assistant(self) -> str:
        """The assistant generation prompt the template appends (ChatML: ``<|im_start|>assistant\n``)."""
        gen = self.tokenizer.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False,
                                                 add_generation_prompt=True)
        plain = self.tokenizer.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False)
        return gen[len(plain):] if gen.startswith(plain) else ""

    def messages_observation_text(self, messages: Sequence[tuple[str, str]], prefill: str = "",
                                  after_ids: Sequence[int] = ()) -> str:
        """The text of several environment messages in a row after the model's output ``after_ids``.

        ``close of the turn + message 1 + ... + message n + open of the assistant turn + prefill``;
        for one message it equals :meth:`observation_text`.

        Args:
            messages: ``(role, content)`` pairs, at least one.
            prefill: text opening the next assistant turn (not trained).
            after_ids: as in :meth:`observation_text`.

        Raises:
            ValueError: no message.
        """
        return "".join(t for t, _ in self._messages_parts(messages, prefill, after_ids))

    def _messages_parts(self, messages: Sequence[tuple[str, str]], prefill: str,
                        after_ids: Sequence[int]) -> list[tuple[str, bool]]:
        """:meth:`messages_observation_text` as ``(text, from_template)`` parts."""
        if not messages:
            raise ValueError("an observation needs at least one message")
        msgs = list(messages)
        if len(msgs) == 1:
            return self._observation_parts(msgs[0][1], msgs[0][0], prefill, after_ids)
        open_assistant = self._open_assistant()

        def without_open(text: str) -> str:
            return text[: len(text) - len(open_assistant)] if open_assistant and text.endswith(open_assistant) else text

        parts = self._observation_parts(msgs[0][1], msgs[0][0], "", after_ids)[:3]
        parts[2] = (without_open(parts[2][0]), True)
        for k, (role, content) in enumerate(msgs[1:], start=1):
            before, after = self._open(role)
            parts += [(before, True), (content, False), (after if k == len(msgs) - 1 else without_open(after), True)]
        return parts + [(prefill, False)]

    def messages_observation_ids(self, messages: Sequence[tuple[str, str]], prefill: str = "",
                                 after_ids: Sequence[int] = ()) -> list[int]:
        """:meth:`messages_observation_text` tokenised once (no special tokens added).

        Returns:
            (O,) token ids.
        """
        return self.encode_parts(self._messages_parts(messages, prefill, after_ids))

    def render_ids(self, messages: Sequence[tuple[str, str]], prefill: str = "") -> list[int]:
        """A whole conversation's prompt ids: chat template with the generation prompt, then
        ``prefill``; the contents encoded as text (:meth:`encode_parts`).

        The template is rendered with marker contents to find where each content goes; a
        template that changes contents (e.g. trims them) is rendered as a whole instead, and
        refused when its text then holds a control token the template did not put there.

        Returns:
            (P,) ids.

        Raises:
            ChatFormatError: as :meth:`encode_parts`.
        """
        msgs = [{"role": r, "content": c} for r, c in messages]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        marks = [f"\u2063C{i}\u2063" for i in range(len(msgs))]
        tmpl = self.tokenizer.apply_chat_template([{"role": m["role"], "content": k} for m, k in zip(msgs, marks)],
                                                  tokenize=False, add_generation_prompt=True)
        parts: list[tuple[str, bool]] = []
        rest = tmpl
        for mark, m in zip(marks, msgs):
            if rest.count(mark) != 1:
                break
            before, rest = rest.split(mark, 1)
            parts += [(before, True), (m["content"], False)]
        else:
            parts += [(rest, True), (prefill, False)]
            if "".join(t for t, _ in parts) == text + prefill:
                return self.encode_parts(parts)
        # the template transforms contents: the rendered text must hold the template's control tokens only
        return self.encode_parts([(text, True), (prefill, False)]) if self._same_controls(text, tmpl) else \
            self._refuse_controls()

    def _same_controls(self, text: str, tmpl: str) -> bool:
        pat, _ = self._added()
        return pat is None or [m.group(0) for m in pat.finditer(text)] == [m.group(0) for m in pat.finditer(tmpl)]

    @staticmethod
    def _refuse_controls() -> list[int]:
        raise ChatFormatError("a message holds the text of a control token of the chat template: remove it")

    def with_user_note_ids(self, prompt_ids: Sequence[int], note: str) -> list[int]:
        """A prompt with ``note`` appended to its last user message, tokenised once (an OPSD hint).

        The prompt's text (decoded with its special tokens) must end with the template's close of
        a user message and the assistant generation prompt, optionally followed by a prefill; the
        note goes in front of that close, after a newline. Only the teacher reads the result; the
        trained ids are never re-tokenised.

        Returns:
            (P',) token ids: the prompt's text with the note inside, tokenised once (P' is about P
            plus the note's length; the teacher's context need not share the student's ids).

        Raises:
            ChatFormatError: the prompt has no user message closed by the template's delimiters.
        """
        marker = "\u2063USER\u2063"
        gen = self.tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                                 add_generation_prompt=True)
        close = gen[gen.rfind(marker) + len(marker):]
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        at = text.rfind(close) if close else -1
        if at < 0:
            raise ChatFormatError("the prompt has no user message closed by the chat template's delimiters; "
                                  "put the OPSD hint in a system message instead (agent.opsd_hint: system)")
        return list(self.tokenizer(text[:at] + "\n" + note + text[at:], add_special_tokens=False)["input_ids"])

    def message_ids(self, content: str, role: str = "system") -> list[int]:
        """One whole ``role`` message as the template renders it, tokenised once (for a hint prefix).

        Returns:
            (M,) ids of ``<open role> content <close>`` (ChatML: ``<|im_start|>role\ncontent<|im_end|>\n``).
        """
        before, after = self._open(role)
        gen = self.tokenizer.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False,
                                                 add_generation_prompt=True)
        plain = self.tokenizer.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False)
        open_assistant = gen[len(plain):] if gen.startswith(plain) else ""
        if open_assistant and after.endswith(open_assistant):
            after = after[: len(after) - len(open_assistant)]
        return list(self.tokenizer(before + content + after, add_special_tokens=False)["input_ids"])
