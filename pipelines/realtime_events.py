"""Client events on the OpenAI Realtime wire: an event's text read and checked (``parse_event``,
``item_id_of``), an append's audio decoded (``decode_append``), the sizes a client may send, and
``EventError``, which every refusal of a client event raises.

Only the subset mmserve serves is accepted; anything else is an ``EventError`` that the session
reports as an ``error`` event (the connection stays usable). What an event carries is checked
elsewhere: the session object in ``pipelines.realtime_config``, the settings a session and a
response share in ``pipelines.realtime_fields``, the functions in ``pipelines.realtime_tools``.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np

from gateway.errors import lone_surrogate, may_hold_lone_surrogate
from pipelines.realtime_audio import WireFormat

MAX_APPEND_BYTES = 15 * (1 << 20)  # an append's audio, as OpenAI's cap (a larger one: an error event)
# The WebSocket frame size the server reads (uvicorn's ``ws_max_size``): well over the largest
# append (~20 MiB of base64 with its event), so that a larger append is read and refused with
# the session's error event, not a closed socket; bounded, as an HTTP body is (``--max-body-mb``'s
# default), so that a frame costs at most this much to read: a larger one closes the socket (1009).
WS_MAX_BYTES = 32 << 20


class EventError(ValueError):
    def __init__(
        self, message: str, code: str = "invalid_value", param: str | None = None, event_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.param, self.event_id = code, param, event_id


def item_id_of(event: dict[str, Any]) -> str:
    """The ``item_id`` an item event names (OpenAI's errors when it is missing or no string)."""
    item_id = event.get("item_id")
    if item_id is None:
        raise EventError("Missing required parameter: 'item_id'.", "missing_required_parameter", "item_id")
    if not isinstance(item_id, str):
        raise EventError("item_id must be a string", param="item_id")
    return item_id


def unknown_parameter(param: str, where: str = "", error: type[EventError] = EventError) -> EventError:
    """OpenAI's error for a field the object does not have, in one wording for both dialects:
    ``param`` its path, ``where`` where the other dialect has it (``": a GA session has it as
    ..."``)."""
    return error(f"Unknown parameter: '{param}'{where}.", "unknown_parameter", param)


def parse_event(raw: str, known: frozenset[str]) -> dict[str, Any]:
    """A client event's text as a JSON object with a ``type`` in ``known`` and, if any, a string
    ``event_id``; otherwise an ``EventError`` (carrying the ``event_id`` once that is valid)."""
    try:
        event = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise EventError(f"the event is not valid JSON: {exc.msg}", code="invalid_json") from exc
    except RecursionError as exc:
        raise EventError("the event is nested too deeply", code="invalid_json") from exc
    event_id = event.get("event_id") if isinstance(event, dict) else None
    if event_id is not None and (not isinstance(event_id, str) or len(event_id) > 512):
        raise EventError("event_id must be a string of at most 512 characters", param="event_id")  # not echoed
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise EventError("an event must be a JSON object with a string 'type'", param="type", event_id=event_id)
    where = lone_surrogate(event) if may_hold_lone_surrogate(raw) else None
    if where is not None:
        raise EventError("a lone surrogate is not a character", param=where or None, event_id=event_id)
    if event["type"] not in known:
        raise EventError(f"unknown or unsupported event type {event['type']!r}", param="type", event_id=event_id)
    return event


def decode_append(value: Any, fmt: WireFormat) -> np.ndarray:
    """The samples of an ``input_audio_buffer.append``'s base64 ``audio`` in ``fmt``."""
    if not isinstance(value, str):
        raise EventError("audio must be a base64 string", param="audio")
    if len(value) > MAX_APPEND_BYTES * 4 // 3 + 4:
        raise EventError("audio chunk is too large (15 MiB max)", param="audio")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EventError(f"audio is not valid base64: {exc}", param="audio") from exc
    if len(data) % fmt.width:
        raise EventError(f"{fmt.name} audio must have an even number of bytes", param="audio")
    return fmt.decode(data)
