from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message

DESCRIPTOR: _descriptor.FileDescriptor

class KvChunk(_message.Message):
    __slots__ = ("reserve", "data", "done")
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    reserve: bytes
    data: bytes
    done: bytes
    def __init__(self, reserve: bytes | None = ..., data: bytes | None = ..., done: bytes | None = ...) -> None: ...

class HandoffStatus(_message.Message):
    __slots__ = ("ok", "error", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    code: str
    def __init__(self, ok: bool | None = ..., error: str | None = ..., code: str | None = ...) -> None: ...
