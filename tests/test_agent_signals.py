"""The agent's signal block (`ds4mlx.agent.app._signals`) on its way out."""

from __future__ import annotations

import os
import signal

import pytest


def test_a_sigint_checked_as_the_block_exits_for_good_is_ignored(monkeypatch):
    """A SIGINT that arrives under the agent's handler and is checked just after the
    block restored the previous handlers ran the default one: KeyboardInterrupt after
    ``/quit`` (seen under a burst of Ctrl+C while the agent saved and exited). Every
    handler change here is followed by a SIGINT to this process, checked at once."""
    from ds4mlx.agent import app

    real = signal.signal
    changes = []

    def set_then_interrupt(signum, handler):
        prev = real(signum, handler)
        changes.append((signum, handler))
        os.kill(os.getpid(), signal.SIGINT)  # pending: run by whatever handler is set
        return prev

    saved = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(signal, "signal", set_then_interrupt)
    try:
        with app._signals(interactive=True, exiting=True):
            pass
        for _ in range(1000):  # bytecodes: CPython checks pending signals between them
            pass
    except KeyboardInterrupt:
        pytest.fail("a SIGINT raised KeyboardInterrupt as the block exited")
    finally:
        monkeypatch.undo()
        ignored = signal.getsignal(signal.SIGINT)
        real(signal.SIGINT, saved)
    assert ignored == signal.SIG_IGN
    assert [s for s, _ in changes].count(signal.SIGINT) == 2  # ours, then ignored
