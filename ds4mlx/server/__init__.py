"""``ds4mlx serve``: the HTTP server around one live session.

Shape::

    HTTP client ─▶ Quart app (ds4mlx.routes) ─▶ FIFO job queue ─▶ one worker thread
                    parse · validate · render                    owns engine.Session
                    ◀── SSE ◀── per-request asyncio.Queue ◀──────  prefill · decode · sample

Modules: `worker` (the inference thread), `app` (Quart app, lifecycle, banner,
Hypercorn; given the routes to register, it imports none), `config`, `trace`, `cli`.
The job vocabulary both sides share is ``ds4mlx.jobs``, below them.
"""
