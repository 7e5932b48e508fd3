"""Where a path is a URL: the one test of a local path against an fsspec URL, and its check.

Every place that takes a folder or a URL (``job.dump_folder``, the checkpoint readers) asks
here, so the rule is written once; the checkpoint stores (``checkpoint.object_store``) are the
only code that branches on it. It sits on the bottom floor, beside the errors, so that both the
config and the checkpoint code may import it.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from plugtrain.errors import ConfigError, require_extra

__all__ = ["check_url", "is_url"]

_BOTOCORE_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")
"""The bucket names botocore sends (``botocore.handlers.VALID_BUCKET``)."""


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://...``) rather than a local path."""
    return "://" in os.fspath(path)


def check_url(url: str, option: str) -> None:
    """Refuse, in one line naming ``option``, a URL that carries credentials or misses a bucket,
    or whose scheme's package is not installed."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise ConfigError(
            f"{option} {parts.scheme}://...@{parts.hostname}/... holds credentials: remove them "
            "from the URL and use the AWS credential chain (environment or ~/.aws files)"
        )
    if not parts.netloc:
        raise ConfigError(f"{option} {url} names no bucket: use {parts.scheme}://BUCKET/PREFIX")
    if parts.scheme in ("s3", "s3a"):
        # botocore's own test, whose refusal is 600 characters of regexes: refuse here only
        # what it refuses, naming the rule new buckets follow.
        if not _BOTOCORE_BUCKET.fullmatch(parts.netloc):
            raise ConfigError(
                f"{option} {url} names bucket '{parts.netloc}', which is no S3 bucket name: use "
                "3 to 63 lowercase letters, digits, dots and hyphens"
            )
        require_extra("s3fs", "s3", f"{option} {url}")
