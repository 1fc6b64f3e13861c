"""Optional API keys at the gateway, for gRPC (`authorization: Bearer KEY` metadata) and HTTP (the same header).

Keys come from `PDSERVE_API_KEYS` (comma-separated) or `--api-key-file` (one per line), never from a flag's value,
which any user of the host could read in the process list. No keys: every caller is let in. Keys are compared
in constant time and never logged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

API_KEYS_ENV = "PDSERVE_API_KEYS"


class ApiKeys:
    refusal = "missing or invalid API key: send the header `authorization: Bearer <key>`"

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [key.encode() for key in keys if key]

    @classmethod
    def load(cls, key_file: str = "") -> ApiKeys:
        keys = os.environ.get(API_KEYS_ENV, "").split(",")
        if key_file:
            keys += Path(key_file).read_text().splitlines()
        return cls(key.strip() for key in keys)

    def allows(self, metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> bool:
        """Whether the caller's `authorization` header (gRPC metadata pairs or HTTP headers) holds a key."""
        if not self._keys:
            return True
        pairs = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
        header = next((value for key, value in pairs if key.lower() == "authorization"), "")
        text = header.decode() if isinstance(header, bytes) else header
        scheme, _, offered = text.partition(" ")
        if scheme.lower() != "bearer" or not offered:
            return False
        candidate = offered.strip().encode()
        return any(hmac.compare_digest(candidate, key) for key in self._keys)
