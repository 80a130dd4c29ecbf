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
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["ChatFormat", "ChatFormatError"]

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
        before, after = self._open(role)
        close = self.close_turn
        if after_ids and int(after_ids[-1]) in self.end_of_turn_ids:
            eot = self.tokenizer.decode([int(after_ids[-1])], skip_special_tokens=False)
            if close.startswith(eot):
                close = close[len(eot):]
        return close + before + content + after + prefill

    def observation_ids(self, content: str, role: str = "user", prefill: str = "",
                        after_ids: Sequence[int] = ()) -> list[int]:
        """:meth:`observation_text` tokenised once (no special tokens added; template tokens kept).

        Returns:
            (O,) token ids, O >= 1.
        """
        text = self.observation_text(content, role, prefill, after_ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

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
        if not messages:
            raise ValueError("an observation needs at least one message")
        msgs = list(messages)
        if len(msgs) == 1:
            return self.observation_text(msgs[0][1], msgs[0][0], prefill, after_ids)
        open_assistant = self._open_assistant()

        def without_open(text: str) -> str:
            return text[: len(text) - len(open_assistant)] if open_assistant and text.endswith(open_assistant) else text

        text = without_open(self.observation_text(msgs[0][1], msgs[0][0], "", after_ids))
        for k, (role, content) in enumerate(msgs[1:], start=1):
            before, after = self._open(role)
            text += before + content + (after if k == len(msgs) - 1 else without_open(after))
        return text + prefill

    def messages_observation_ids(self, messages: Sequence[tuple[str, str]], prefill: str = "",
                                 after_ids: Sequence[int] = ()) -> list[int]:
        """:meth:`messages_observation_text` tokenised once (no special tokens added).

        Returns:
            (O,) token ids.
        """
        text = self.messages_observation_text(messages, prefill, after_ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

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
