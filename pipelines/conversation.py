"""A voice conversation: ordered items rendered through the model's chat template.

Turns append items and the last assistant item may be truncated, and every turn renders the
whole list with the same template, so turn N's prompt starts with turn N-1's prompt and its reply:
the engine's prefix cache keeps the conversation warm across turns. (A client that inserts or
deletes an item changes the prompt from there on: the cache keeps only what comes before it.)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.token_bound import check_length, min_tokens
from modalities.llm.chat import render_chat, render_chat_text
from modalities.llm.tools import ToolCall

# Deletes remembered for the replies asked for before them (a few are ever waiting).
MAX_DELETED = 64
DEFAULT_INSTRUCTIONS = "You are a helpful voice assistant. Answer in one or two short sentences."


@dataclass
class Item:
    """One conversation item: an OpenAI Realtime ``message`` (``truncated`` freezes ``text``;
    ``audio``: its content is audio, a user's speech or a spoken reply, and ``text`` its
    transcript; ``status``: "incomplete" once a reply is cancelled), or with ``kind``
    "function_call" (``text``: the arguments) or "function_call_output" (``text``: the output)."""

    id: str
    role: str
    text: str = ""
    truncated: bool = False
    audio: bool = False
    status: str = "completed"
    kind: str = "message"
    call_id: str = ""
    name: str = ""  # a function call's
    response_id: str = ""  # the reply that made it (a function call's)
    pending: bool = False  # a user's speech, committed: its transcript is still to come
    client: bool = False  # made by the client (``conversation.item.create``)
    made: int = 0  # the conversation's ``clock`` when it was added

    def message(self) -> dict[str, Any] | None:
        """The chat message for the template (None: an empty message, left out)."""
        if self.kind == "function_call" and self.status == "incomplete":
            return None  # cut short: no call was made (its arguments may be no JSON)
        if self.kind == "function_call":
            call = ToolCall(self.name, self.text, self.call_id).to_openai()
            return {"role": "assistant", "content": "", "tool_calls": [call]}  # (templates print None)
        if self.kind == "function_call_output":
            return {"role": "tool", "tool_call_id": self.call_id, "content": self.text}
        return {"role": self.role, "content": self.text} if self.text.strip() else None


class _Deleted(NamedTuple):
    """An item the client deleted: the ``clock`` then, the item, the items before it then (the
    nearest first), and whether it was left out of the prompt (``Conversation._first``)."""

    made: int
    item: Item
    before: tuple[Item, ...]
    left_out: bool


@dataclass
class Conversation:
    instructions: str = DEFAULT_INSTRUCTIONS
    items: list[Item] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # chat-completions shaped, for the template
    _ids: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    _first: int = field(default=0, repr=False)  # items before this one no longer fit the prompt
    _removed: set[str] = field(default_factory=set, repr=False)  # ids deleted (a late transcript stays out)
    clock: int = field(default=0, repr=False)  # items added and deleted by the client so far (``Item.made``)
    _deleted: list[_Deleted] = field(default_factory=list, repr=False)  # the client's latest deletes

    def new_id(self, kind: str = "item") -> str:
        return f"{kind}_{next(self._ids):06d}"

    def add(
        self,
        role: str,
        text: str = "",
        item_id: str | None = None,
        audio: bool = False,
        after: str | None = None,
        **fields: Any,
    ) -> Item:
        """A new item at the end, or right after item ``after`` ("root": first); KeyError if
        there is no such item. ``fields``: an ``Item``'s others (a function call's)."""
        self.clock += 1
        item = Item(item_id or self.new_id(), role, text, audio=audio, made=self.clock, **fields)
        if after is None:
            self.items.append(item)
            return item
        at = 0 if after == "root" else next((k + 1 for k, i in enumerate(self.items) if i.id == after), None)
        if at is None:
            raise KeyError(after)
        self.items.insert(at, item)
        self._first += at < self._first  # among the items left out, it is left out too
        return item

    def hear(self, item_id: str, text: str) -> Item | None:
        """The user's speech ``item_id`` heard as ``text``: its item, added ``pending`` when the
        audio was committed (empty until now, so prompts left it out), gets the text; without
        one, a new item at the end. None if it was deleted before its transcript came."""
        item = self.get(item_id) if item_id else None
        if item is None:
            return None if self.removed(item_id) else self.add("user", text, item_id or None, audio=True)
        item.text, item.pending = text, False
        return item

    def add_reply(self, late: Collection[Item] = ()) -> Item:
        """A reply's item: last, but before the speech still to be heard there and the items
        ``late`` for it (``later``). (Speech is heard in the order it was committed, and a reply
        asked for after it is made after its transcript: speech still pending was committed after
        this reply was asked for.)"""
        at, after = len(self.items), {id(i) for i in late}
        while at and (self.items[at - 1].pending or id(self.items[at - 1]) in after):
            at -= 1
        item = Item(self.new_id(), "assistant")
        self.items.insert(at, item)
        return item

    def later(self, asked: int | None) -> list[Item]:
        """The client's items added after ``clock`` was ``asked`` (None: none), but for the
        outputs of calls made before (a call's output must follow it)."""
        if asked is None:
            return []
        calls = {i.call_id for i in self.items if i.kind == "function_call" and i.made <= asked}
        return [i for i in self.items if i.client and i.made > asked and i.call_id not in calls]

    def as_asked(self, asked: int | None, late: Collection[Item]) -> Conversation:
        """This conversation as it was when ``clock`` was ``asked`` (None: as it is): without
        the items ``late`` (``later``'s), with the items the client deleted since back where
        they were. Itself if nothing differs; a copy shares the items, so ``keep_from`` of a
        render of it holds for this one."""
        left = {id(i) for i in late}
        back = [d for d in self._deleted if asked is not None and d.item.made <= asked < d.made]
        if not left and not back:
            return self
        items = [i for i in self.items if id(i) not in left]
        first = sum(id(i) not in left for i in self.items[: self._first])
        for d in reversed(back):  # (the latest first: an item's neighbours then are back already)
            near = next((b for b in d.before if any(i is b for i in items)), None)  # (others left: late ones)
            at = 0 if near is None else next(k + 1 for k, i in enumerate(items) if i is near)
            items.insert(at, d.item)
            first += at < first or (d.left_out and at == first)
        return dataclasses.replace(self, items=items, _first=first)

    def removed(self, item_id: str) -> bool:
        """Whether item ``item_id`` was deleted."""
        return item_id in self._removed

    def get(self, item_id: str) -> Item | None:
        return next((i for i in self.items if i.id == item_id), None)

    def remove(self, item_id: str, client: bool = False) -> bool:
        """Delete item ``item_id`` (False if there is none): later prompts leave it out; a reply
        asked for before the ``client`` deleted it still has it (``as_asked``)."""
        for k, item in enumerate(self.items):
            if item.id == item_id:
                self._removed.add(item_id)
                del self.items[k]
                if client:
                    self.clock += 1
                    gone = _Deleted(self.clock, item, tuple(self.items[k - 1 :: -1] if k else ()), k < self._first)
                    self._deleted = [*self._deleted[1 - MAX_DELETED :], gone]
                self._first -= k < self._first  # the items left out stay the same ones
                return True
        return False

    def answering(self, user_text: str) -> Conversation:
        """A copy as it will be when the user's ``user_text`` is added and its reply begins (a
        speculative prompt: ``prompt_ids`` of the copy leaves this conversation unchanged)."""
        pending = [Item("", "user", user_text), Item("", "assistant")]
        return dataclasses.replace(self, items=[*self.items, *pending])

    def recent(self, count: int) -> Conversation:
        """A copy of its last ``count`` to ``2 * count - 1`` items, from an item chosen in steps of
        ``count`` (so that consecutive renders share their prefix: the prefix cache); itself if
        it has no more than ``2 * count`` not left out. (A transcription session's conversation
        only grows: no reply's prompt leaves its items out.)"""
        n = len(self.items)
        if n - self._first <= 2 * count:
            return self
        return dataclasses.replace(self, items=self.items[(n - count) // count * count :], _first=0)

    def context(
        self,
        items: list[Item] | None,
        reply: Item,
        instructions: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Conversation:
        """What a response with its own context renders (``response.input``, an out-of-band
        reply): ``items`` (default: this conversation's), then ``reply``, under ``instructions``
        and ``tools`` (default: this conversation's; ``[]``: none). A copy: rendering it changes
        nothing here."""
        base = [i for i in self.items if i is not reply] if items is None else items
        return dataclasses.replace(
            self,
            items=[*base, reply],
            instructions=instructions or self.instructions,
            tools=self.tools if tools is None else tools or None,
            _first=self._first if items is None else 0,
        )

    def messages(self, first: int = 0) -> list[dict[str, Any]]:
        """Chat messages: the instructions as system message, then every non-empty item from ``first``."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in self.items[first:]:
            m = item.message()
            last = msgs[-1] if msgs else {}
            if m is not None and "tool_calls" in m and last.get("role") == "assistant":
                last.setdefault("tool_calls", []).extend(m["tool_calls"])  # one turn: its text, then its calls
            elif m is not None:
                msgs.append(m)
        return msgs

    def _render(self, tokenizer: Any, first: int, text: bool = False) -> Any:
        kwargs = {"tools": self.tools} if self.tools else {}
        render = render_chat_text if text else render_chat
        return render(tokenizer, self.messages(first), **kwargs)

    def render_text(self, tokenizer: Any) -> str:
        """The prompt's text as ``prompt_ids`` renders it now (no items left out here)."""
        return str(self._render(tokenizer, self._first, text=True))

    def chars(self) -> int:
        """Characters of what the next render holds: the instructions and the items with text
        from the first one that still fits."""
        texts = sum(len(i.text) for i in self.items[self._first :] if i.text.strip())
        return len(self.instructions) + texts + (len(str(self.tools)) if self.tools else 0)

    def snapshot(self) -> Conversation:
        """A copy with its own item list, to render on a thread while this one changes."""
        return dataclasses.replace(self, items=list(self.items))

    def keep_from(self, rendered: Conversation) -> None:
        """Leave out, from now on, the items a render of ``snapshot()`` left out."""
        gone = {id(i) for i in rendered.items[: rendered._first]}
        self._first = max(self._first, max((k + 1 for k, i in enumerate(self.items) if id(i) in gone), default=0))

    def prompt_ids(self, tokenizer: Any, limit: int | None = None, max_tokens: int = 0) -> list[int]:
        """The rendered prompt; with ``limit``, the oldest items are left out until it fits (the
        instructions and the latest item with text stay, so it may still be too long: the engine
        says so). Items once left out stay out, so later turns keep one prefix (the prefix cache).
        A render too long by its text's length alone (``engine.token_bound``) is not tokenized:
        its oldest items are left out, and if what must stay is too long, ``PromptTooLongError``
        (``max_tokens``: the reply's room, for its message). How many to leave out is searched
        for (``_fewest_dropped``): a few renders, not one per item left out."""
        if limit is None:
            return self._render(tokenizer, self._first)
        last = max((k for k, item in enumerate(self.items) if item.text.strip()), default=0)
        if self.chars() > limit:  # (a shorter text: no length bound hits)

            def text(first: int) -> str:
                return str(self._render(tokenizer, first, text=True))

            self._first = _fewest_dropped(self._first, last, lambda k: min_tokens(tokenizer, text(k)) <= limit)
            if self._first >= last:
                check_length(tokenizer, text(self._first), limit + max_tokens, max_tokens)
        renders: dict[int, list[int]] = {}

        def ids(first: int) -> list[int]:
            if first not in renders:
                renders[first] = self._render(tokenizer, first)
            return renders[first]

        self._first = _fewest_dropped(self._first, last, lambda k: len(ids(k)) <= limit)
        return ids(self._first)


def _fewest_dropped(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The smallest ``k`` in ``[lo, hi]`` with ``fits(k)`` (true from some ``k`` on: leaving out
    more items only shortens a prompt), else ``hi`` (not tested: what must stay). Steps of 1, 2,
    4, ... from ``lo``, then halving: about 2 log2(k - lo) calls, 1 when ``lo`` fits."""
    if lo >= hi or fits(lo):
        return lo
    bad, step = lo, 1
    while True:
        probe = min(bad + step, hi)
        if probe == hi or fits(probe):
            good = probe
            break
        bad, step = probe, step * 2
    while good - bad > 1:
        mid = (bad + good) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


@dataclass
class Spoken:
    """One piece of a reply's audio that was sent: its sentence text and duration."""

    text: str
    ms: float


def heard_text(pieces: list[Spoken], audio_end_ms: float) -> str:
    """The text of the first ``audio_end_ms`` of a reply: whole sentences, then the part of the
    sentence being spoken in proportion to its duration (at word granularity)."""
    out: list[str] = []
    t = 0.0
    for p in pieces:
        if t + p.ms <= audio_end_ms:
            out.append(p.text)
        else:
            words = p.text.split()
            frac = max(0.0, audio_end_ms - t) / p.ms if p.ms > 0 else 0.0
            part = " ".join(words[: int(len(words) * frac)])
            if part:
                out.append(part)
            break
        t += p.ms
    return " ".join(s.strip() for s in out if s.strip())
