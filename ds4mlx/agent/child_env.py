"""The environment the agent gives the processes it starts.

The agent runs commands the model writes, and their output goes back into the model's
context, the session transcript on disk and the KV snapshot. A command such as ``env``
or ``echo $AWS_SECRET_ACCESS_KEY`` would copy a credential into all three, so by default
a child process does not inherit variables whose name contains ``KEY``, ``SECRET``,
``TOKEN``, ``PASSWORD``, ``PASSWD``, ``CREDENTIAL`` or ``COOKIE`` (case-insensitive:
``*KEY*`` matches ``OPENAI_API_KEY`` and ``ssh_key_path``), nor one whose value is a URL
carrying a password (``DATABASE_URL=postgres://app:hunter2@db/app``) or an
``Authorization`` header's credentials (``Bearer …``, ``Basic …``). A variable the user names with ``--pass-env NAME`` (repeatable) or in
``$DS4MLX_AGENT_PASS_ENV`` (comma-separated names) is passed anyway; ``--inherit-env``
passes the whole environment as before.

:func:`child_env` is the one place a child's environment is built: bash foreground
commands and background jobs use it (and so must MCP servers and hooks when they come).
It also sets non-interactive defaults (no pager, no git credential prompt, no colour):
the agent cannot answer a pager or a prompt.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: Substrings of variable names withheld by default (matched case-insensitively).
SECRET_MARKERS: tuple[str, ...] = (
    "KEY",
    "SECRET",
    "TOKEN",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "COOKIE",
)

# A URL with a password in its user info (``scheme://user:password@``): a database's or a
# broker's connection string, whatever the variable is called.
_URL_WITH_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:[^\s/@]+@")
# An ``Authorization`` header's credentials kept in a variable (``AUTH=Bearer eyJ…``).
_AUTH_VALUE = re.compile(r"\s*(?:Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}\s*", re.IGNORECASE)

#: The variable naming extra variables to pass (comma-separated), like ``--pass-env``.
PASS_ENV_VAR = "DS4MLX_AGENT_PASS_ENV"

# Set in every child: the agent cannot answer a pager or a credential prompt.
NONINTERACTIVE: dict[str, str] = {
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "GIT_TERMINAL_PROMPT": "0",
    "NO_COLOR": "1",
}


def is_secret_name(name: str) -> bool:
    """True if ``name`` holds one of `SECRET_MARKERS` (``*KEY*``, ``*TOKEN*``, …)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def is_secret(name: str, value: str = "") -> bool:
    """True if the variable ``name=value`` is withheld by default: a secret-looking name
    (`is_secret_name`), a value holding a URL with a password, or one that is an
    ``Authorization`` header's credentials."""
    return (
        is_secret_name(name)
        or _URL_WITH_PASSWORD.search(value) is not None
        or _AUTH_VALUE.fullmatch(value) is not None
    )


@dataclass(frozen=True)
class EnvPolicy:
    """Which of the agent's environment variables its child processes get.

    Attributes:
        inherit: pass every variable (``--inherit-env``).
        passed: names passed although they look secret (``--pass-env``), exact and
            case-sensitive as the environment is.
    """

    inherit: bool = False
    passed: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_config(
        cls,
        *,
        inherit: bool = False,
        passed: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> EnvPolicy:
        """The policy of the CLI flags plus ``$DS4MLX_AGENT_PASS_ENV`` in ``environ``.

        Args:
            inherit: ``--inherit-env``.
            passed: the ``--pass-env`` names.
            environ: where ``DS4MLX_AGENT_PASS_ENV`` is read (default ``os.environ``).
        """
        env = os.environ if environ is None else environ
        names = {n.strip() for n in env.get(PASS_ENV_VAR, "").split(",")}
        names.update(n.strip() for n in passed)
        names.discard("")
        return cls(inherit=inherit, passed=frozenset(names))

    def keeps(self, name: str, value: str = "") -> bool:
        """True if a child gets the variable ``name`` (whose value is ``value``)."""
        return self.inherit or name in self.passed or not is_secret(name, value)

    def withheld(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Names in ``environ`` (default ``os.environ``) a child does not get, sorted."""
        env = os.environ if environ is None else environ
        return sorted(n for n, v in env.items() if not self.keeps(n, v))


def child_env(
    policy: EnvPolicy | None = None,
    environ: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of a child process the agent starts.

    Args:
        policy: which variables pass (default: :class:`EnvPolicy()`, secrets withheld).
        environ: the agent's environment (default: ``os.environ`` read now).
        extra: variables the caller sets for this child (its own config: an MCP
            server's ``env`` table); they are set even if their names look secret.

    Returns:
        ``environ`` without the withheld names, then :data:`NONINTERACTIVE`, then
        ``extra``.
    """
    policy = policy or EnvPolicy()
    env = os.environ if environ is None else environ
    out = {k: v for k, v in env.items() if policy.keeps(k, v)}
    out.update(NONINTERACTIVE)
    if extra:
        out.update(extra)
    return out
