"""The server's event loop: one of its own (uvloop where installed), and its tasks finished
before it closes."""

from __future__ import annotations

import asyncio

__all__ = ["finish_tasks", "new_loop"]


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on ``loop`` and run it to completion, then close async generators."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
