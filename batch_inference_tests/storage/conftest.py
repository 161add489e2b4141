from __future__ import annotations

import uuid

import pytest


@pytest.fixture(params=["local", "memory"])
def base_url(request, tmp_path) -> str:
    """A fresh directory URL on local disk or in fsspec's in-memory filesystem."""
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://t-{uuid.uuid4().hex[:10]}"
