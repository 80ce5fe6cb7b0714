"""A batch and a file as OpenAI's Batch and File objects (the gateway's answers, `tison batch
status`). Pure."""

from services.batch.store import ERRORS, OUTPUT, Counts, output_file_id
from shared.batch_messages import ENDED, BatchMsg, FileMsg


def batch_object(batch: BatchMsg, counts: Counts) -> dict:
    """The batch as OpenAI's Batch object."""
    done = batch.status in ENDED

    def at(value: int) -> int | None:
        return value or None

    errors = None
    if batch.error:
        error = {"code": "batch_failed", "message": batch.error, "param": None, "line": None}
        errors = {"object": "list", "data": [error]}
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": output_file_id(batch.id, OUTPUT) if done and counts.completed else None,
        "error_file_id": output_file_id(batch.id, ERRORS) if done and counts.failed else None,
        "created_at": batch.created_at,
        "in_progress_at": at(batch.in_progress_at),
        "expires_at": batch.expires_at,
        "finalizing_at": at(batch.completed_at),
        "completed_at": at(batch.completed_at),
        "failed_at": at(batch.failed_at),
        "expired_at": at(batch.expired_at),
        "cancelling_at": at(batch.cancelling_at),
        "cancelled_at": at(batch.cancelled_at),
        "request_counts": {
            "total": counts.total,
            "completed": counts.completed,
            "failed": counts.failed,
        },
        "metadata": batch.metadata or None,
    }


def file_object(record: FileMsg) -> dict:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
    }
