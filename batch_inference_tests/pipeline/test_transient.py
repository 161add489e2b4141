"""Which errors resume a run (``is_transient``): an S3 server's 5xx after a restart did not."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from batch_inference.pipeline.transient import is_transient


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "We encountered an internal error, please try again."},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def _as_s3fs_raises(err: BaseException) -> OSError:
    """s3fs's translate_boto_error: an unknown code becomes OSError(EREMOTEIO) raised from the ClientError."""
    try:
        raise OSError(errno.EREMOTEIO, "We encountered an internal error, please try again.") from err
    except OSError as exc:
        return exc


@pytest.mark.parametrize("code,status", [("InternalError", 500), ("ServiceUnavailable", 503), ("SlowDown", 503),
                                         ("SomethingNew", 502)])
def test_an_object_store_5xx_is_transient_also_as_s3fs_raises_it(code: str, status: int) -> None:
    # the CI failure: SeaweedFS restarted mid-run answered GetObject with InternalError; the run ended
    assert is_transient(_client_error(code, status))
    assert is_transient(_as_s3fs_raises(_client_error(code, status)))


@pytest.mark.parametrize("code,status", [("AccessDenied", 403), ("NoSuchKey", 404), ("NoSuchBucket", 404)])
def test_a_refusal_or_a_missing_object_is_not_transient(code: str, status: int) -> None:
    assert not is_transient(_client_error(code, status))
    assert not is_transient(_as_s3fs_raises(_client_error(code, status)))


def test_connection_errors_and_plain_errors() -> None:
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionResetError())
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_transient(ValueError("bad record"))
