"""Ray glue of the data stages: surface a task's data error plainly."""

from __future__ import annotations

from typing import Any

from pipeline.data.fetch import DataError



def get_data_error(ref: Any) -> Any:
    """``ray.get`` that re-raises a task's ``DataError`` as itself: one clear line, no remote traceback."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, DataError):
            raise type(cause)(str(cause)) from None
        raise
