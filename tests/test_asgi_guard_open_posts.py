"""``ASGIGuard.open_posts``: the POST requests still being answered, which the cluster ingress's drain waits
for before Ray Serve's proxy is stopped (a stream's last frames must have left). Probes (GET) do not count."""

from __future__ import annotations

import asyncio

import pytest

from asyncbatch.serve.asgi_guard import ASGIGuard


def _scope(method: str) -> dict:
    return {"type": "http", "method": method, "path": "/v1/completions", "headers": []}


async def _receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def test_a_post_counts_until_its_last_frame_is_sent_and_a_get_never() -> None:
    at_done: list[int] = []  # open_posts as each [DONE] is sent
    release = asyncio.Event()

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    guard = ASGIGuard(app, api_key=None, max_body_bytes=1 << 20)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("body") == b"data: [DONE]\n\n":
            at_done.append(guard.open_posts)

    async def main() -> None:
        streams = [asyncio.ensure_future(guard(_scope("POST"), _receive, send)) for _ in range(2)]
        probe = asyncio.ensure_future(guard(_scope("GET"), _receive, send))
        while len(sent) < 6:  # every request has sent its start and first chunk and now waits
            await asyncio.sleep(0)
        assert guard.open_posts == 2
        release.set()
        await asyncio.gather(*streams, probe)

    asyncio.run(main())
    # Woken in order: each POST's [DONE] leaves while it still counts, and it stops counting once it has
    # left; the GET's never counted.
    assert at_done == [2, 1, 0]
    assert guard.open_posts == 0


def test_a_post_that_fails_is_no_longer_counted() -> None:
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("cut short")

    async def send(message: dict) -> None:
        pass

    guard = ASGIGuard(app, api_key=None, max_body_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="cut short"):
        asyncio.run(guard(_scope("POST"), _receive, send))
    assert guard.open_posts == 0
