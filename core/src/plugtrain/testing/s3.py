"""A real S3-compatible server on the loopback address (moto's server mode), for tests and benches.

:class:`S3Server` starts moto's threaded server on ``127.0.0.1`` with one bucket and test
credentials; tests talk to it over HTTP through s3fs and botocore as a run would, nothing
mocked. :attr:`S3Server.env` holds what a training process needs to reach it (the credentials,
the endpoint): set it in ``os.environ`` (:meth:`S3Server.environ`) or pass it to a child.
The ``s3_server`` fixture (one per test module) is one of these, its environment set.

Needs ``moto[server]`` and ``s3fs`` (requirements-dev.txt).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from typing import Any

from plugtrain.testing.processes import free_port

__all__ = ["S3Server"]


class S3Server:
    """moto's S3 server on ``127.0.0.1``, holding bucket :attr:`bucket`; a context manager."""

    def __init__(self, bucket: str = "plugtrain") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.secret = f"plugtrain-test-secret-{secrets.token_hex(8)}"
        """The secret access key of the test credentials: a run must never write it anywhere."""
        self.key_id = f"PLUGTRAINTEST{secrets.token_hex(4).upper()}"
        self.env = {
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }
        """The environment that reaches the server through the standard AWS chain."""
        self._server: Any = None
        self._fs: Any = None

    def url(self, prefix: str) -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix}"

    def start(self) -> S3Server:
        from moto.server import ThreadedMotoServer

        # Its request log would fill a test's output; errors still show.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        with self.environ():
            self.filesystem().makedirs(self.bucket, exist_ok=True)
        return self

    def stop(self) -> None:
        """Stop serving (a store that became unreachable); :meth:`start` serves the same objects
        again (moto keeps them in this process)."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def filesystem(self) -> Any:
        """An s3fs file system on this server, not the one a run uses (a test's own view of
        the store); made once, its listings never cached."""
        import s3fs

        if self._fs is None:
            self._fs = s3fs.S3FileSystem(
                key=self.key_id,
                secret=self.secret,
                endpoint_url=self.endpoint,
                skip_instance_cache=True,
                use_listings_cache=False,
            )
        return self._fs

    @contextlib.contextmanager
    def environ(self) -> Iterator[None]:
        """Set :attr:`env` in ``os.environ`` for the block, and restore it after."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
