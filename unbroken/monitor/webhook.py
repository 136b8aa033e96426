"""Alerts POSTed to a Slack-compatible incoming webhook as ``{"text": ...}`` (``monitor.webhook`` or
``$UNBROKEN_WEBHOOK``). A refused or unreachable URL raises, and the runner retries it with backoff."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

WEBHOOK_ENV = "UNBROKEN_WEBHOOK"
"""The webhook URL when ``monitor.webhook`` is empty."""
POST_TIMEOUT_S = 10.0


def webhook_url(configured: str) -> str:
    """``monitor.webhook``, else ``$UNBROKEN_WEBHOOK``, else empty (no alerts)."""
    return configured or os.environ.get(WEBHOOK_ENV, "")


class WebhookSink:
    name = "webhook"

    def __init__(self, url: str) -> None:
        self.url = url

    def open(self) -> None:
        pass

    def handle(self, kind: str, payload: dict[str, Any]) -> None:
        if kind != "alert":
            return
        body = json.dumps({"text": payload["text"]}).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=POST_TIMEOUT_S) as answer:  # noqa: S310 (the user's URL)
            answer.read()

    def close(self) -> None:
        pass
