"""The tensor view cache the backend uses: ``rankwise.api.views`` (the API's own
``all_reduce`` keeps views too, so it lives beside the API)."""

from __future__ import annotations

from ..api.views import MAX_BYTES, MAX_ENTRIES, TensorViews

__all__ = ["MAX_BYTES", "MAX_ENTRIES", "TensorViews"]
