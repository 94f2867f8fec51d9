"""Small wire helpers only tests need: answering a decoded request, reading a refusal's
reason, counting the peers a codec's replay check remembers."""

from __future__ import annotations

from typing import Any, Iterable

from kernel_probe import wire


def reply(to: wire.Envelope, type_: str, body: dict, buffers: Iterable[bytes] = ()) -> wire.Message:
    """A message answering ``to`` (its corr_id is the request's msg_id), as a probe answers."""
    return wire.Message(type_, body, tuple(buffers), corr_id=to.header.msg_id)


def refusal_reason(frames: Any) -> str | None:
    """The reason if ``frames`` is a refusal, else None."""
    refusal = wire.parse_refusal(frames)
    return refusal[0] if refusal else None


def tracked_peers(codec: wire.Codec) -> int:
    """How many (sender, incarnation) pairs ``codec``'s replay check remembers."""
    return len(codec._last_seq)
