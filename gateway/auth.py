"""Optional API keys at the gateway, for gRPC (`authorization: Bearer KEY` metadata) and HTTP (the same header).

Keys come from `PDSERVE_API_KEYS` (comma-separated) or `--api-key-file` (one per line), never from a flag's value,
which any user of the host could read in the process list. No keys: every caller is let in. But a key file, or a
set PDSERVE_API_KEYS, that holds no key is refused at start-up: an empty secret (a mount gone wrong, a typo)
would otherwise turn authentication off without a word. Keys are compared in constant time and never logged.

Each key is a tenant: request ids are scoped to the key that sent them (`tenant`), so a Cancel with one key never
reaches another key's request, cannot tell whether another key's id exists, and two keys may use the same id at
once. Without keys every caller is one tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

API_KEYS_ENV = "PDSERVE_API_KEYS"


class ApiKeys:
    refusal = "missing or invalid API key: send the header `authorization: Bearer <key>`"

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [key.encode("utf-8", "surrogateescape") for key in keys if key]  # as os.environ decodes

    @classmethod
    def load(cls, key_file: str = "") -> ApiKeys:
        """Keys from PDSERVE_API_KEYS and `key_file`. Raises ValueError (naming the source) when either is given
        but holds no key; an empty PDSERVE_API_KEYS counts as unset, as shells use it."""
        from_env = [key.strip() for key in os.environ.get(API_KEYS_ENV, "").split(",")]
        if os.environ.get(API_KEYS_ENV, "").strip() and not any(from_env):
            raise ValueError(f"{API_KEYS_ENV} is set but holds no key (comma-separated keys expected)")
        from_file = []
        if key_file:
            try:
                from_file = [line.strip() for line in Path(key_file).read_text().splitlines()]
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--api-key-file {key_file}: cannot read it ({exc})") from None
            if not any(from_file):
                raise ValueError(f"--api-key-file {key_file} holds no key (one per line expected); refusing to "
                                 "start with authentication off")
        return cls(from_env + from_file)

    def allows(self, metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> bool:
        """Whether the caller's `authorization` header (gRPC metadata pairs or HTTP headers) holds a key."""
        return not self._keys or self._matching(metadata) is not None

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> str:
        """Who owns the request ids this caller names: a digest of its key; "" without keys (one tenant)."""
        key = self._matching(metadata) if self._keys else None
        return "" if key is None else hashlib.sha256(b"pdserve-tenant\0" + key).hexdigest()[:16]

    def _matching(self, metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> bytes | None:
        pairs = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
        header = next((value for key, value in pairs if key.lower() == "authorization"), "")
        # Compared as bytes, so a header that is not UTF-8 is a wrong key, not an error: aiohttp hands such bytes
        # over as surrogates (surrogateescape gives them back), gRPC as latin-1 text or raw bytes.
        raw = header if isinstance(header, bytes) else header.encode("utf-8", "surrogateescape")
        scheme, _, offered = raw.partition(b" ")
        if scheme.lower() != b"bearer" or not offered:
            return None
        candidate = offered.strip()
        matches = [key for key in self._keys if hmac.compare_digest(candidate, key)]  # every key, constant time
        return matches[0] if matches else None
