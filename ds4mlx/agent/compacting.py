"""Context compaction of the agent's conversation (a mixin of `ds4mlx.agent.loop.Agent`).

Before the context fills (soft limit), or when the next text would not fit (hard):
summarize the durable task state with the live model (chat mode, tools off, never
executed), keep a verbatim recent tail, and rebuild the session from
``system + summary + tail`` through the prompt-cache planner. The pure policy and text
helpers are in `ds4mlx.agent.compaction`.
"""

from __future__ import annotations

from ds4mlx.agent import compaction as cmp
from ds4mlx.agent.events import CompactionInfo
from ds4mlx.dsml import Conversation, Message, render, render_assistant_turn, render_segments


class Compacting:
    """Mixin: needs the `Agent` attributes ``session``, ``tok``, ``ctx``, ``conv``,
    ``messages``, ``policy``, ``tool_memory``, ``state``, ``exact``, ``ui``,
    ``compactions`` and its ``_prefill_ids``/``_generate``/``_rebuild``/
    ``_pending_from`` methods."""

    def _message_tokens(self, m: Message) -> int:
        if m.role == "assistant":
            text = render_assistant_turn(
                m, thinking=self.conv.thinking, tool_memory=self.tool_memory
            )
        elif m.role == "tool":
            text = f"<tool_result>{m.content}</tool_result>"
        else:
            text = m.content
        return len(self.tok.encode_plain(text)) + 2

    def _summary_by_model(self, last_a: int) -> tuple[str, str | None]:
        """Ask the live model for a summary after the turn-end state.

        Appends the summary request (chat mode) to the live state and generates.
        Returns ``(summary, status)``: ``status`` is ``"interrupted"`` when the user
        stopped it, else None; ``summary`` is "" when there was no room or no text.
        """
        s, msgs = self.session, self.messages
        words = max(50, int(self.policy.summary_max(self.ctx) * 0.6))
        req = Message("user", cmp.summary_instruction(words))
        tmp = Conversation(
            messages=msgs[: last_a + 1] + [req], tools=self.conv.tools, thinking=False
        )
        # The request follows the live assistant turn: its EOS, then the new turn only
        # (the summary conversation renders the earlier turns in chat mode; they are not
        # re-rendered over the live state).
        segs = render_segments(tmp, context_size=self.ctx, tool_memory=self.tool_memory)
        k = max(i for i, seg in enumerate(segs) if seg.role == "assistant")
        tail = sum(len(seg.text) for seg in segs[k + 1 :])
        full = render(tmp, context_size=self.ctx, tool_memory=self.tool_memory)
        rest = full.tail(len(full.text) - tail)
        ids = [self.tok.eos_id] + self.tok.encode(rest.text, content=rest.content)
        limit = self.policy.summary_max(self.ctx)
        if len(s.tokens) + len(ids) + limit > self.ctx:
            return "", None
        if not self._prefill_ids(ids, "summary_request"):
            return "", "interrupted"
        gen = self._generate(thinking=False, tools=False, max_tokens=limit, kind="summary")
        # The summary turn now sits in the live state; the rebuild replaces it.
        self.state = "dirty"
        if gen.stop == "interrupted":
            self.ui.notice("interrupted while summarizing", "warn")
            return "", "interrupted"
        if gen.result.tool_calls:
            self.ui.notice("tool calls in the summary were ignored (not run)", "warn")
        return gen.result.content.strip(), None

    def _compacted(self, summary: str, keep_from: int) -> tuple[Conversation, int, int]:
        """The rebuilt conversation: ``(conv, first kept message, its prompt tokens)``.

        Keeps as long a verbatim tail as the budget allows, fewer old messages while the
        result would still not fit (or would compact again at once).
        """
        msgs = self.messages
        start = cmp.tail_start(
            msgs, keep_from, self._message_tokens, self.policy.tail_budget(self.ctx)
        )
        soft = self.policy.soft_limit(self.ctx)
        while True:
            new = cmp.rebuild(msgs, start, summary, cmp.first_request(msgs[:start]))
            conv = Conversation(messages=new, tools=self.conv.tools, thinking=self.conv.thinking)
            full = render(conv, context_size=self.ctx, tool_memory=self.tool_memory)
            n_full = len(self.tok.encode(full.text, content=full.content))
            over = n_full + self.policy.reserve(self.ctx) > self.ctx or n_full >= soft
            if not over or start >= keep_from:
                return conv, start, n_full
            start += 1
            while start < keep_from and msgs[start].role == "tool":
                start += 1

    def _compact(self, reason: str) -> str | None:
        """Summarize, keep the tail verbatim, rebuild; then the state is ready to generate.

        Returns None when ready, else a ``SendResult`` status (``interrupted``,
        ``context`` when even the kept messages do not fit).
        """
        msgs = self.messages
        before = len(self.session.tokens)
        self.ui.compaction(CompactionInfo(reason, "start", before))
        keep_from = self._pending_from()
        if keep_from < len(msgs) and msgs[keep_from].role == "tool" and keep_from > 1:
            keep_from -= 1  # pending results stay with the assistant turn that called
        summary = ""
        last_a = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
        if self.state == "turn_end" and last_a > 0:
            summary, status = self._summary_by_model(last_a)
            if status is not None:
                return status
        by_model = bool(summary)
        if not summary:
            summary = cmp.mechanical_summary(msgs[:keep_from])
        conv, start, n_full = self._compacted(summary, keep_from)
        if n_full + self.policy.reserve(self.ctx) > self.ctx:
            self.ui.notice(
                f"compaction cannot help: the kept messages alone need {n_full} tokens "
                f"of a {self.ctx}-token context",
                "error",
            )
            return "context"
        self.conv = conv
        self.exact = True
        st = self._rebuild()
        info = CompactionInfo(
            reason,
            "done",
            before,
            after=len(self.session.tokens),
            summary=summary,
            by_model=by_model,
            kept=len(msgs) - start,
            dropped=start - 1,
        )
        self.compactions.append(info)
        self.ui.compaction(info)
        return st
