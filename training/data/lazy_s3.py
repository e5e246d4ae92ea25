"""The S3 client of a picklable image source (``S3Images``, ``ShardImages``)."""

from __future__ import annotations

from typing import Any

from training.common import aws


class LazyS3Client:
    """An S3 client made on first use in each process: boto3 clients do not pickle, so the
    attributes named in ``_not_pickled`` are dropped when a source is sent to a worker."""

    _client: Any
    _not_pickled: tuple[str, ...] = ("_client",)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = aws.client()
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._not_pickled:
            state[name] = None
        return state
