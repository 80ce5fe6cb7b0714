"""The batch bodies of the wire contract (JetStream, shared/subjects.py's batch_* subjects),
encoded like every message (protocol.encode / protocol.decode: versioned msgpack maps).

A batch is one input file of OpenAI batch JSONL lines. Each line that can run is one
BatchItemMsg on the work stream; each line ends as exactly one BatchResultMsg on the results
stream (at most one message per result subject, so a line run twice still has one result);
BatchMsg is the batch's record in the status bucket. Pure.
"""

from dataclasses import dataclass, field
from typing import ClassVar

# BatchMsg.status, as OpenAI's Batch API names them
VALIDATING, IN_PROGRESS, COMPLETED, CANCELLING, CANCELLED, FAILED, EXPIRED = (
    "validating",
    "in_progress",
    "completed",
    "cancelling",
    "cancelled",
    "failed",
    "expired",
)
ENDED = (COMPLETED, CANCELLED, FAILED, EXPIRED)  # nothing more happens to a batch in these
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class BatchItemMsg:
    """Batch client → batch runners (work stream): one request line to run."""

    KIND: ClassVar[str] = "batch_item"
    batch_id: str  # client sets: BatchMsg.id
    key: str  # client sets: the line's result key (jsonl.result_key), unique in the batch
    custom_id: str  # client copies from the line
    line: int  # client sets: 1-based line number in the input file
    url: str  # client copies from the line: one of ENDPOINTS, the batch's endpoint
    body: str  # client copies from the line: the request body as JSON text


@dataclass(frozen=True)
class BatchResultMsg:
    """Batch runner (or client, for a line that cannot run) → results stream: how one line
    ended. Either the HTTP response it got (status_code > 0) or why it never ran."""

    KIND: ClassVar[str] = "batch_result"
    batch_id: str
    key: str  # as BatchItemMsg.key; the result subject ends in it
    custom_id: str  # "" when the line had none (it was not a JSON object)
    line: int
    status_code: int = 0  # the gateway's HTTP status; 0: never ran (error_code says why)
    body: str = ""  # the gateway's response body, JSON text
    error_code: str = ""  # set when it never ran: invalid_json, duplicate_custom_id, ...
    error_message: str = ""

    @property
    def failed(self) -> bool:
        return self.status_code != 200


def unrun(item: BatchItemMsg, code: str, message: str) -> BatchResultMsg:
    """The result of a line that never ran (why: `code`, `message`)."""
    return BatchResultMsg(item.batch_id, item.key, item.custom_id, item.line, 0, "", code, message)


@dataclass(frozen=True)
class BatchMsg:
    """A batch's record in the status bucket (key: its id). Its request counts are not kept
    here but counted from the results stream, which no crash can leave out of step."""

    KIND: ClassVar[str] = "batch"
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int  # unix seconds
    expires_at: int
    total: int  # lines of the input file (blank lines not counted)
    status: str = VALIDATING
    metadata: dict[str, str] = field(default_factory=dict)
    in_progress_at: int = 0  # 0: not yet
    completed_at: int = 0
    cancelling_at: int = 0
    cancelled_at: int = 0
    expired_at: int = 0  # its completion window ended first: its unrun lines got batch_expired
    failed_at: int = 0  # it could not be created (error says why); no line of it runs
    error: str = ""


@dataclass(frozen=True)
class FileMsg:
    """An uploaded file's record in the status bucket (its bytes are in the object store)."""

    KIND: ClassVar[str] = "file"
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
