"""API keys → tenants. The tenant seeds the prefix-cache chain, so it comes only from here, never from a
request field."""

from __future__ import annotations

import hmac
from pathlib import Path

from stride.frontend.errors import ApiError

DEFAULT_TENANT = "default"


def load_api_keys(path: str) -> dict[str, str]:
    """Parse a file of ``KEY TENANT`` lines (``#`` starts a comment). ``ValueError`` on a malformed line."""
    keys: dict[str, str] = {}
    for num, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{num}: expected 'KEY TENANT', got {len(parts)} fields")
        key, tenant = parts
        if key in keys:
            raise ValueError(f"{path}:{num}: duplicate key")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"{path}: no keys")
    return keys


class Authenticator:
    """Maps a presented key to its tenant. Without keys, everyone is :data:`DEFAULT_TENANT`."""

    def __init__(self, keys: dict[str, str] | None) -> None:
        self._keys = keys

    @classmethod
    def from_file(cls, path: str) -> Authenticator:
        return cls(load_api_keys(path) if path else None)

    @property
    def enabled(self) -> bool:
        return self._keys is not None

    def tenant_for_key(self, key: str) -> str:
        """The key's tenant; :class:`ApiError` 401 for a missing or unknown key."""
        if self._keys is None:
            return DEFAULT_TENANT
        if not key:
            raise ApiError(401, "missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")
        # Compare every key in constant time so a timing probe learns nothing about prefixes.
        found = None
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return found

    def tenant_for_header(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization: Bearer KEY`` header value."""
        if self._keys is None:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            key = ""
        return self.tenant_for_key(key.strip())
