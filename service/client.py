"""Python client for the binary forward path, with retries when the server is busy.

from .client import Client
out = Client("http://127.0.0.1:8000").forward("demo", hidden_states)  # [T, H] -> [T, H]
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import safetensors.torch
import torch

RETRY_STATUSES = frozenset({429, 503})


class ClientError(RuntimeError):
    """The server refused the request; `status` is its HTTP status, the message its error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # tries in all, the first included
    backoff_s: float = 0.1  # first wait when the server names none; doubles each retry
    max_wait_s: float = 5.0  # cap on any one wait, Retry-After included


class Client:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)
        self.retry = retry or RetryPolicy()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def forward(
        self, name: str, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden_states [T, H] (+ router_logits [T, E]) -> the layer's output [T, H].

        float32, bfloat16 or float16; the output comes back in hidden_states' dtype.
        """
        tensors = {"hidden_states": hidden_states.detach().cpu().contiguous()}
        if router_logits is not None:
            tensors["router_logits"] = router_logits.detach().cpu().contiguous()
        body = safetensors.torch.save(tensors)
        response = self._post(
            f"/v1/layers/{name}/forward", body, {"Content-Type": "application/octet-stream"}
        )
        return safetensors.torch.load(response.content)["output"]

    def _post(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        wait = self.retry.backoff_s
        for attempt in range(1, self.retry.attempts + 1):
            response = self._http.post(path, content=body, headers=headers)
            if response.status_code == 200:
                return response
            if response.status_code not in RETRY_STATUSES or attempt == self.retry.attempts:
                break
            time.sleep(min(_retry_after(response, wait), self.retry.max_wait_s))
            wait *= 2
        raise ClientError(response.status_code, _error_message(response))


def _retry_after(response: httpx.Response, default: float) -> float:
    try:
        return float(response.headers.get("retry-after", default))
    except ValueError:
        return default


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return response.text
