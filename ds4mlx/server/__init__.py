"""``ds4mlx serve``: the HTTP server around one live session.

Shape::

    HTTP client ─▶ Quart app (ds4mlx.routes) ─▶ FIFO job queue ─▶ one worker thread
                    parse · validate · render                    owns engine.Session
                    ◀── SSE ◀── per-request asyncio.Queue ◀──────  prefill · decode · sample

Modules: `jobs` (the job vocabulary, a leaf the routes import), `worker` (the inference
thread), `app` (Quart app, lifecycle, banner, Hypercorn), `config`, `trace`, `cli`.
This ``__init__`` imports nothing, so ``routes → server.jobs`` does not pull in the app.
"""
