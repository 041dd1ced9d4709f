"""Dead letters that always fit: the payload is capped so that the whole record — payload,
key and headers — stays within what ``kafka.max_message_bytes`` lets a record be once the
broker counts the record batch around it, compressed (:func:`infra.kafka.max_record_size`)."""

from __future__ import annotations

import msgspec
from aiokafka.structs import ConsumerRecord

from infra.errors import ScoringError
from infra.ids import is_wire_id
from infra.kafka import max_record_size, record_size
from infra.schema import DeadLetter, dead_letter_headers, headers_to_dict


class ProcessingError(ScoringError):
    """Wraps an unexpected processing failure so the dead letter names the original error."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def group_of(key: bytes | None) -> str | None:
    """The group a record's key names (keys are group ids), when it can name one: a key that
    breaks the id grammar (:mod:`infra.ids`: a control character such as the scope separator,
    or too long) names none, so an undecodable record can never decide a group of another
    experiment."""
    if not key:
        return None
    try:
        group_id = key.decode()
    except UnicodeDecodeError:
        return None
    return group_id if is_wire_id(group_id) else None


def capped_letter(
    record: ConsumerRecord,
    cause: BaseException,
    attempt: int,
    *,
    worker_id: str,
    max_message_bytes: int,
    dead_letter_max_bytes: int,
) -> tuple[DeadLetter, bytes | None]:
    """The dead letter for ``record`` and the key to send it under.

    The payload keeps at most ``dead_letter_max_bytes`` and at most what the key and
    headers leave of :func:`infra.kafka.max_record_size` of ``max_message_bytes``
    (``prm-dl-original-size`` then says how long it was): the batch that carries the
    letter stays within the limit even when compression grows an incompressible payload,
    so the broker does not refuse it (a refused letter is only logged as POISON). Absurd
    original headers are replaced by a note and an absurd key is cut, so that the payload
    keeps room.
    """
    limit = max_record_size(max_message_bytes)
    payload = record.value or b""
    key = record.key
    letter = DeadLetter(
        payload=b"",
        error_class=type(cause).__name__,
        error_message=str(cause),
        source_topic=record.topic,
        source_partition=record.partition,
        source_offset=record.offset,
        attempt=attempt,
        worker_id=worker_id,
        original_headers=headers_to_dict(record.headers),
        original_size=len(payload),
    )
    overhead = record_size(key, b"", dead_letter_headers(letter))
    if overhead > limit // 2:
        letter = msgspec.structs.replace(
            letter,
            original_headers={
                "dropped": f"{len(letter.original_headers)} original headers ({overhead} bytes with the key)"
            },
        )
        if key is not None and len(key) > limit // 4:
            key = key[: limit // 4]
        overhead = record_size(key, b"", dead_letter_headers(letter))
    # 16 bytes: the varints of the record and value lengths grow with the payload
    cap = max(0, min(dead_letter_max_bytes, limit - overhead - 16))
    if len(payload) > cap:
        return msgspec.structs.replace(letter, payload=payload[:cap]), key
    return msgspec.structs.replace(letter, payload=payload, original_size=-1), key
