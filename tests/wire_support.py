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


def parts_of(frames: list[bytes]) -> tuple[bytes, list[bytes]]:
    """(signature, [header, body, *buffers]) of a message's frames, read by the documented
    layout (independently of wire.py): tag, signature, part count, lengths, parts."""
    data = b"".join(frames)
    count = int.from_bytes(data[36:38], "big")
    lengths = [int.from_bytes(data[38 + 4 * i:42 + 4 * i], "big") for i in range(count)]
    at, parts = 38 + 4 * count, []
    for n in lengths:
        parts.append(data[at:at + n])
        at += n
    assert at == len(data)
    return data[4:36], parts
