"""Live-continuation bindings: what the live state just sampled, selected by ids or text.

docs/ARCHITECTURE.md §3: the sampled state is the truth. After a turn, the worker remembers how a
following request may refer to that state without re-rendering it:

- `ToolBinding` — the tool-call ids the turn sampled (all of them, in call order) and
  the live token count right after the turn. A request whose trailing tool results
  carry exactly that id set continues the live state: only the suffix
  ``<｜end▁of▁sentence｜><｜User｜><tool_result>…</tool_result>…<｜Assistant｜>`` +
  ``<think>``/``</think>`` is tokenized (on its own) and prefilled
  (`tool_results_suffix`). Whatever a caller calls those ids, they arrive as
  ``tool`` messages of the neutral conversation.
- `ThinkingBinding` — the *visible keys* of a thinking-mode turn (`visible_keys`): the
  next prompt renders that turn without its reasoning, so a prompt starting with a key
  keeps the live tokens, real reasoning included, and only the bytes after the key are
  tokenized. Two renderings qualify:
  reasoning dropped by the format (no tools: ``…<｜Assistant｜></think>content``) and
  reasoning dropped by the client while tools keep the slot
  (``…<｜Assistant｜><think></think>content``, an OpenAI client that does not send
  ``reasoning_content`` back).

- `TranscriptBinding` — for a caller that keeps the conversation itself (the agent):
  its own rendering of the conversation through the sampled turn. The live state *is*
  that conversation, so a prompt starting with the key keeps it, whatever bytes the
  rendering gives the sampled turn.

Keys are renderings (`ds4mlx.dsml.Rendered`: text and content spans), not bare text:
content that spells a special token (``<｜User｜>`` in a user message) is plain text, the
renderer's own markers are tokens, so the same bytes may be other tokens. A prompt
"starts with" a key when it has the key's bytes (`matched_key`) *and* spells special
tokens as plain text at the same places; the planner checks the second half
(``ds4mlx.kv.plan._same_key``: it needs the tokenizer).

kv knows no protocol: a live tool continuation is named `LIVE_TOOLS` with the detail
``match=`` `TOOL_RESULT_IDS`, and an id nothing explains is reported as the fact
(``ds4mlx.kv.plan.PlanRejected.tool_id``); callers word and relabel them.

`LiveBindings` holds at most one of each binding. It is written by the inference thread
and may be read from any thread (`bound_tool_ids`, for ``/health``); bindings are
immutable and replaced whole, so a reader sees either the old or the new one.

Stdlib and ``ds4mlx.dsml`` only: no MLX, no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4mlx.dsml import (
    Conversation,
    Message,
    Rendered,
    ToolCall,
    background_names,
    render_tool_results_suffix,
)
from ds4mlx.dsml.tokens import EOS

__all__ = [
    "LIVE_TOOLS",
    "TOOL_RESULT_IDS",
    "LiveBindings",
    "ThinkingBinding",
    "ToolBinding",
    "TranscriptBinding",
    "tool_results_suffix",
    "matched_key",
    "visible_keys",
    "trailing_tool_ids",
    "unexplained_tool_ids",
]


# The plan decision of a live tool continuation and the id word of its log detail
# (``match=tool-result-ids ids=N``): neutral names; a caller may relabel them for its
# own log line (``ds4mlx.jobs.LiveLabels``).
LIVE_TOOLS = "live-tools"
TOOL_RESULT_IDS = "tool-result-ids"


@dataclass(frozen=True)
class ToolBinding:
    """The tool calls the live state just sampled.

    Attributes:
        ids: the call ids in sampled order (tuple of str, non-empty).
        n_tokens: live token count right after the turn (int tokens); the binding is
            valid only while the session still holds exactly that many.
        names: the called tools' names, parallel to ``ids`` (``()``: unknown, every call
            then counts as synchronous); a request's background tools
            (``ToolSpec.background``) decide which calls its status results answer.
    """

    ids: tuple[str, ...]
    n_tokens: int
    names: tuple[str, ...] = ()

    def sync_ids(self, conv: Conversation) -> set[str]:
        """The ids a request must answer to continue live: every call but those to the
        request's background tools, which their pending status results answer."""
        background = background_names(conv)
        async_ids = {i for i, n in zip(self.ids, self.names, strict=False) if n in background}
        return set(self.ids) - async_ids


@dataclass(frozen=True)
class ThinkingBinding:
    """The visible keys of the turn the live state just sampled (thinking mode).

    Attributes:
        keys: renderings of the turn's prompt + the turn with its reasoning left out,
            each ending ``</think>`` + content + tool calls + ``<｜end▁of▁sentence｜>``
            (tuple of `Rendered`, see `visible_keys`; a ``str`` is taken as a rendering
            without content spans).
        n_tokens: live token count right after the turn (the EOS was sampled, not fed).
    """

    keys: tuple[Rendered, ...]
    n_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(Rendered.of(k) for k in self.keys))


@dataclass(frozen=True)
class TranscriptBinding:
    """The caller's rendering of the conversation the live state holds.

    Attributes:
        key: ``ds4mlx.dsml.render`` of the conversation through its last turn, ending
            with that turn's ``<｜end▁of▁sentence｜>`` (which the live state has not fed);
            a ``str`` is taken as a rendering without content spans.
        n_tokens: live token count the key stands for.
    """

    key: Rendered
    n_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", Rendered.of(self.key))

    @property
    def keys(self) -> tuple[Rendered, ...]:
        return (self.key,)


class LiveBindings:
    """The current bindings of the one live session (at most one of each kind).

    Written only on the inference thread; `bound_tool_ids` may be read from any thread.
    """

    def __init__(self) -> None:
        self.tool: ToolBinding | None = None
        self.thinking: ThinkingBinding | None = None
        self.transcript: TranscriptBinding | None = None

    def clear(self) -> None:
        """Forget every binding (a request that does not use them clears them)."""
        self.tool = None
        self.thinking = None
        self.transcript = None

    def save(self) -> tuple:
        """The bindings as they are (for `restore` after a rejected request)."""
        return self.tool, self.thinking, self.transcript

    def restore(self, saved: tuple) -> None:
        self.tool, self.thinking, self.transcript = saved

    def bound_tool_ids(self) -> frozenset[str]:
        """Ids of the live tool binding, or an empty set (thread-safe read)."""
        b = self.tool
        return frozenset(b.ids) if b is not None else frozenset()


# --------------------------------------------------------------------------- matching


def _trailing_start(conv: Conversation) -> int:
    """Index of the first message after the last assistant turn.

    Without any assistant turn (a client that does not replay the call), the trailing
    part starts at the first tool result of the final run of tool/user messages.
    """
    msgs = conv.messages
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].role == "assistant":
            return i + 1
    start = len(msgs)
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].role not in ("tool", "user"):
            break
        if msgs[i].role == "tool":
            start = i
    return start


def trailing_tool_ids(conv: Conversation) -> list[str]:
    """Ids of the tool results after the last assistant turn, in request order."""
    return [
        m.tool_call_id or "" for m in conv.messages[_trailing_start(conv) :] if m.role == "tool"
    ]


def tool_results_suffix(
    conv: Conversation, binding: ToolBinding, *, context_size: int | None = None
) -> Rendered | None:
    """What to append to the live state if ``conv`` answers ``binding``'s calls.

    Matches when the tool results after the last assistant turn answer (each once) every
    *synchronous* bound call (`ToolBinding.sync_ids`: a call to a background tool is
    answered by its pending status result, or by its own result), and each other result
    is a late result of a call the request replays in an earlier turn; when the request
    replays the bound assistant turn, its calls are those same ids. Returns
    ``<｜end▁of▁sentence｜><｜User｜><tool_result>…</tool_result>…<｜Assistant｜><think>``
    (or ``</think>``): the trailing turns rendered exactly as `render_prompt` would
    render them after the sampled turn (results and status results in *sampled* call
    order, late results after them), with its content spans (`ds4mlx.dsml.Rendered`).
    The assistant turn itself is never re-rendered (its bytes are the live tokens).
    None when ``conv`` does not match.
    """
    start = _trailing_start(conv)
    trailing = conv.messages[start:]
    ids = [m.tool_call_id or "" for m in trailing if m.role == "tool"]
    replays = start > 0 and conv.messages[start - 1].role == "assistant"
    earlier = {
        c.id: c
        for m in conv.messages[: start - 1 if replays else 0]
        if m.role == "assistant"
        for c in m.tool_calls
    }
    late = [i for i in ids if i not in binding.ids and i in earlier]
    answered = set(ids) - set(late)
    if len(set(ids)) != len(ids) or not binding.sync_ids(conv) <= answered <= set(binding.ids):
        return None
    if not ids and not replays:
        return None  # nothing in the request refers to the sampled turn
    if replays:
        replayed = {c.id for c in conv.messages[start - 1].tool_calls}
        if replayed != set(binding.ids):
            return None
    if any(m.role not in ("tool", "user") for m in trailing):
        return None
    # A stand-in for the sampled turn: only its call order and names matter (results
    # are sorted by the order, status results name the tool); its own text is not part
    # of the suffix. Late results need their calls, from an earlier stand-in turn.
    names = binding.names or ("",) * len(binding.ids)
    sampled = Message(
        role="assistant",
        tool_calls=[
            ToolCall(id=i, name=n, arguments={}) for i, n in zip(binding.ids, names, strict=True)
        ],
    )
    before = [Message(role="assistant", tool_calls=[earlier[i] for i in late])] if late else []
    synth = Conversation(
        messages=[*before, sampled, *trailing],
        tools=conv.tools,
        thinking=conv.thinking,
        reasoning_effort=conv.reasoning_effort,
    )
    try:
        return render_tool_results_suffix(synth, context_size=context_size)
    except ValueError:
        return None


def visible_keys(
    prompt: Rendered | str, content: str, tool_calls: Rendered | str = ""
) -> tuple[Rendered, ...]:
    """The renderings a following request gives a thinking turn without its reasoning.

    ``prompt`` is the turn's rendered prompt (ending ``<think>``; a ``str`` has no
    content spans); ``content`` the visible reply; ``tool_calls`` the turn's DSML tool
    calls (``render_tool_calls``, "" without calls). Returns, in order: the format's
    drop (``prompt`` without ``<think>`` + ``</think>`` + content + calls + EOS) and the
    client's drop (``prompt`` + ``</think>`` + content + calls + EOS: empty reasoning in a
    kept slot), with their content spans (the reply is content, as a prompt renders it);
    () when ``prompt`` does not end with ``<think>``.
    """
    from ds4mlx.dsml.tokens import THINK_END, THINK_START

    prompt = Rendered.of(prompt)
    if not prompt.text.endswith(THINK_START):
        return ()
    reply = Rendered(content, ((0, len(content)),) if content else ())
    tail = Rendered(THINK_END) + reply + Rendered.of(tool_calls) + Rendered(EOS)
    return (prompt.head(len(prompt.text) - len(THINK_START)) + tail, prompt + tail)


def matched_key(
    rendered_prompt: str, binding: ThinkingBinding | TranscriptBinding
) -> Rendered | None:
    """The key of ``binding`` (a `ThinkingBinding`'s visible keys, a `TranscriptBinding`'s
    key) whose bytes ``rendered_prompt`` starts with, or None. Keys end with
    ``<｜end▁of▁sentence｜>``, which the live state sampled but never fed; a key without
    it never matches. Bytes only: the caller checks the markers (module doc)."""
    for key in binding.keys:
        if key.text.endswith(EOS) and rendered_prompt.startswith(key.text):
            return key
    return None


def unexplained_tool_ids(conv: Conversation, bound: frozenset[str] = frozenset()) -> list[str]:
    """Tool-result ids that neither a replayed assistant call nor the live binding explains.

    A result is accepted when some assistant turn of ``conv`` made the call (then it is
    rendered, with exact DSML from tool memory when known). Results whose calls are not
    replayed are accepted only as a live continuation: the trailing results answer
    exactly the bound ids ``bound`` (all of them; a partial set cannot continue live).
    Returns the offending ids in request order (empty when fine).
    """
    called = {c.id for m in conv.messages if m.role == "assistant" for c in m.tool_calls}
    missing: list[str] = []
    for m in conv.messages:
        if m.role == "tool":
            tid = m.tool_call_id or ""
            if tid not in called and tid not in missing:
                missing.append(tid)
    if missing and bound and set(missing) <= bound:
        trailing = trailing_tool_ids(conv)
        if len(trailing) == len(bound) and set(trailing) == bound:
            return []
    return missing
