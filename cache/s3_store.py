"""S3Store: boto3 against S3, R2 or any S3-compatible server.

Checksums are computed and validated only when an operation requires them (R2 and several
S3-compatibles reject the newer default CRC headers); botocore's own retries are off because the
downloader and publisher retry with their own policy (per part, honouring Retry-After).
"""

from __future__ import annotations

import datetime
import email.utils
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import boto3
import botocore.config
import botocore.exceptions

from cache.errors import ETagChangedError, NotFoundError, StoreError
from cache.retry import RetryPolicy, call_with_retries
from cache.object_store import ObjectInfo, RangeReader, Store

_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
_RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "TooManyRequests", "RequestTimeTooSkewed"}


def _retry_after(headers: dict) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # the other form: an HTTP date
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def translate(e: Exception, what: str) -> StoreError:
    """Map a boto/urllib3 exception to our typed errors."""
    if isinstance(e, StoreError):
        return e
    if isinstance(e, botocore.exceptions.ClientError):
        meta = e.response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code", "")
        msg = f"{what}: {status} {code} {e.response.get('Error', {}).get('Message', '')}".strip()
        if status == 404 or code in ("NoSuchKey", "404", "NotFound"):
            return NotFoundError(msg, status=404)
        if status == 412 or code == "PreconditionFailed":
            return ETagChangedError(msg, status=412, retryable=False)
        client_fault = status is not None and 400 <= status < 500 and status not in _RETRYABLE_STATUS
        retryable = status in _RETRYABLE_STATUS or (code in _RETRYABLE_CODES and not client_fault)
        return StoreError(msg, retryable=retryable, retry_after=_retry_after(meta.get("HTTPHeaders", {})),
                          status=status)
    if isinstance(e, (botocore.exceptions.NoCredentialsError, botocore.exceptions.ParamValidationError)):
        return StoreError(f"{what}: {e}")
    # Connection refused/reset, read timeouts (stalls), truncated bodies: transient.
    return StoreError(f"{what}: {type(e).__name__}: {e}", retryable=True)


class _S3Range:
    def __init__(self, body, what: str) -> None:
        self._body = body
        self._what = what

    def readinto(self, buf: memoryview) -> int:
        try:
            return self._body.readinto(buf)
        except Exception as e:  # noqa: BLE001 - every failure of a body read is a transient one
            raise translate(e, self._what) from None

    def close(self) -> None:
        try:
            self._body.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail too; nothing to do
            pass

    def interrupt(self) -> None:
        # A socket closed by another thread does not wake a read blocked on it; a shutdown does
        # (urllib3's HTTPResponse.shutdown, under botocore's StreamingBody).
        raw = getattr(self._body, "_raw_stream", None)
        try:
            if raw is not None and hasattr(raw, "shutdown"):
                raw.shutdown()
            else:
                self._body.close()
        except Exception:  # noqa: BLE001 - a connection already gone: nothing to wake
            pass


class S3Store(Store):
    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, region: str = "auto",
                 path_style: bool = False, max_connections: int = 80, connect_timeout: float = 10.0,
                 read_timeout: float = 30.0, multipart_threshold: int = 64 << 20,
                 multipart_part_size: int = 64 << 20, upload_concurrency: int = 8,
                 retry: RetryPolicy | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        if multipart_part_size < 5 << 20:
            raise StoreError("multipart_part_size must be at least 5 MiB (an S3 rule)")
        self.multipart_threshold = multipart_threshold
        self.multipart_part_size = multipart_part_size
        self.upload_concurrency = upload_concurrency
        self.retry = retry or RetryPolicy()
        config = botocore.config.Config(
            region_name=region,
            signature_version="s3v4",
            s3={"addressing_style": "path" if path_style else "auto"},
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=max_connections,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,  # a socket that sends nothing this long is a stall
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            tcp_keepalive=True,
        )
        self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def head(self, key: str) -> ObjectInfo:
        try:
            r = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:  # noqa: BLE001
            raise translate(e, f"HEAD {key}") from None
        return ObjectInfo(int(r["ContentLength"]), r["ETag"])

    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            if int(r["ContentLength"]) > max_bytes:
                r["Body"].close()
                raise StoreError(f"{key} is {r['ContentLength']} bytes (at most {max_bytes})")
            return r["Body"].read()
        except Exception as e:  # noqa: BLE001
            raise translate(e, f"GET {key}") from None

    def open_range(self, key: str, start: int, end: int, etag: str, total: int) -> RangeReader:
        what = f"GET {key} bytes={start}-{end - 1}"
        try:
            r = self._client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}",
                                        IfMatch=etag)
        except Exception as e:  # noqa: BLE001
            raise translate(e, what) from None
        body = r["Body"]
        try:
            status = r["ResponseMetadata"]["HTTPStatusCode"]
            if status != 206:
                raise StoreError(f"{what}: answered {status}, not 206 (Range ignored)", retryable=True, status=status)
            if r.get("ETag") != etag:
                raise ETagChangedError(f"{what}: ETag {r.get('ETag')} is not {etag}")
            m = _RANGE_RE.match(r.get("ContentRange") or "")
            if not m or (int(m[1]), int(m[2]) + 1) != (start, end) or m[3] != str(total):
                raise StoreError(f"{what}: wrong Content-Range {r.get('ContentRange')!r}", retryable=True)
            if int(r["ContentLength"]) != end - start:
                raise StoreError(f"{what}: Content-Length {r['ContentLength']} is not {end - start}", retryable=True)
        except StoreError:
            body.close()
            raise
        return _S3Range(body, what)

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as e:  # noqa: BLE001
            raise translate(e, f"PUT {key}") from None

    def put_file(self, key: str, path: Path, on_bytes: Callable[[int], None] | None = None) -> None:
        size = path.stat().st_size
        if size <= self.multipart_threshold:
            data = path.read_bytes()
            call_with_retries(lambda: self.put_bytes(key, data), self.retry, f"PUT {key}")
            if on_bytes:
                on_bytes(size)
            return
        self._put_multipart(key, path, size, on_bytes)

    def _put_multipart(self, key: str, path: Path, size: int, on_bytes: Callable[[int], None] | None) -> None:
        k = self._key(key)
        try:
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=k)["UploadId"]
        except Exception as e:  # noqa: BLE001
            raise translate(e, f"create multipart {key}") from None
        ps = self.multipart_part_size
        ranges = [(i + 1, off, min(ps, size - off)) for i, off in enumerate(range(0, size, ps))]

        def upload(part: tuple[int, int, int]) -> dict:
            number, off, length = part
            with open(path, "rb") as f:
                f.seek(off)
                data = f.read(length)

            def once() -> str:
                try:
                    return self._client.upload_part(Bucket=self.bucket, Key=k, UploadId=upload_id,
                                                    PartNumber=number, Body=data)["ETag"]
                except Exception as e:  # noqa: BLE001
                    raise translate(e, f"upload part {number} of {key}") from None

            etag = call_with_retries(once, self.retry, f"part {number} of {key}")
            if on_bytes:
                on_bytes(length)
            return {"PartNumber": number, "ETag": etag}

        try:
            with ThreadPoolExecutor(max_workers=self.upload_concurrency) as pool:
                parts = list(pool.map(upload, ranges))
            call_with_retries(lambda: self._complete(k, upload_id, parts, key), self.retry, f"complete {key}")
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - the store expires abandoned uploads anyway
                pass
            raise

    def _complete(self, k: str, upload_id: str, parts: list[dict], key: str) -> None:
        try:
            self._client.complete_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id,
                                                   MultipartUpload={"Parts": parts})
        except Exception as e:  # noqa: BLE001
            raise translate(e, f"complete multipart {key}") from None

    def close(self) -> None:
        self._client.close()
