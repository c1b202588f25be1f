"""The reasoning carrier: sampled reasoning handed to a stateless client and back.

Built once per app by ``ds4mlx.routes.register`` (`install`) and read by the protocol
modules with `carrier`; the server knows nothing of it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from pathlib import Path

from quart import current_app

_KEY = "ds4mlx.carrier"


def install(app, key: bytes | None) -> ReasoningCarrier:
    """Build the app's `ReasoningCarrier` (``key``: ``--reasoning-key`` bytes, else
    `load_reasoning_key`) and keep it on ``app``."""
    c = ReasoningCarrier(key or load_reasoning_key())
    app.extensions[_KEY] = c
    return c


def carrier() -> ReasoningCarrier:
    """The running app's `ReasoningCarrier`."""
    return current_app.extensions[_KEY]


def load_reasoning_key() -> bytes:
    """The secret reasoning carriers (`ReasoningCarrier`) derive their AES-SIV key from.

    ``DS4MLX_REASONING_KEY`` when set; else a random key kept in
    ``$XDG_CACHE_HOME/ds4mlx/reasoning.key`` (created 0600) so carriers handed out
    before a restart still verify after it; else a per-process random key.
    """
    env = os.environ.get("DS4MLX_REASONING_KEY")
    if env:
        return hashlib.sha256(env.encode()).digest()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "ds4mlx" / "reasoning.key"
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data[:32]
    except OSError:
        pass
    key = secrets.token_bytes(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
    except OSError:
        try:
            data = path.read_bytes()  # lost a creation race: use the winner's key
            if len(data) >= 32:
                return data[:32]
        except OSError:
            pass
    return key


class ReasoningCarrier:
    """Opaque, authenticated-encrypted carrier of sampled reasoning text.

    Used as the Responses reasoning item's ``encrypted_content`` and the Anthropic
    thinking block's ``signature``: a stateless client hands it back and the server
    recovers the exact reasoning, so a replay renders the exact prefix the model
    sampled (docs/ARCHITECTURE.md §6: opaque, integrity-protected). Format: ``ds4r3.`` +
    base64url(AES-SIV (RFC 5297, ``cryptography``'s ``AESSIV``) of the UTF-8 text, the
    prefix as associated data). AES-SIV is deterministic by design: the same reasoning
    always seals to the same carrier, so replies stay reproducible, and equal carriers
    reveal only equal texts. A tampered, foreign-key or foreign-format carrier opens to
    None.
    """

    PREFIX = "ds4r3."
    _AAD = b"ds4r3"

    def __init__(self, key: bytes):
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESSIV
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        self.key = key  # the secret, for the body-vetting child (``routes.body``)
        # AES-256-SIV takes a 512-bit key (two AES-256 keys), derived from the secret.
        siv_key = HKDF(
            algorithm=hashes.SHA256(), length=64, salt=None, info=b"ds4mlx reasoning carrier"
        ).derive(key)
        self._aead = AESSIV(siv_key)

    def seal(self, text: str) -> str:
        blob = self._aead.encrypt(text.encode("utf-8"), [self._AAD])
        return self.PREFIX + base64.urlsafe_b64encode(blob).rstrip(b"=").decode()

    def open(self, token: str | None) -> str | None:
        """The reasoning text, or None for a foreign, corrupted or forged carrier."""
        from cryptography.exceptions import InvalidTag

        if not token or not isinstance(token, str) or not token.startswith(self.PREFIX):
            return None
        body = token[len(self.PREFIX) :]
        try:
            blob = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (ValueError, TypeError):
            return None
        if len(blob) < 16:  # the synthetic IV alone
            return None
        try:
            return self._aead.decrypt(blob, [self._AAD]).decode("utf-8")
        except (InvalidTag, UnicodeDecodeError, ValueError):
            return None
