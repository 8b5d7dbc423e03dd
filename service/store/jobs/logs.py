"""Reading the rank logs a worker writes under the artifact directory
(``service.core.artifacts.rank_log_path``): text from a byte offset, with the offset to
continue from."""

from __future__ import annotations

import codecs
from pathlib import Path

# Most bytes one call returns.
MAX_LOG_CHUNK_BYTES = 256 * 1024


def read_log_chunk(
    path: Path, offset: int, max_bytes: int = MAX_LOG_CHUNK_BYTES
) -> tuple[str, int, bool]:
    """Up to ``max_bytes`` bytes of ``path`` from byte ``offset``, decoded as UTF-8.

    A multi-byte character cut at the end of the chunk is left for the next call; bytes that
    are not UTF-8 become U+FFFD.

    Returns:
        ``(text, next_offset, eof)``; a missing file gives ``("", offset, True)``.
    """
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(min(offset, size))
            data = f.read(max_bytes) if offset < size else b""
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return "", offset, True
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(data, final=False)
    pending = len(decoder.getstate()[0])
    end = offset + len(data)
    return text, end - pending, end >= size
