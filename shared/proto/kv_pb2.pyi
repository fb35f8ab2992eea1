from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KvChunk(_message.Message):
    __slots__ = ("reserve", "data", "done")
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    reserve: bytes
    data: bytes
    done: bytes
    def __init__(self, reserve: _Optional[bytes] = ..., data: _Optional[bytes] = ..., done: _Optional[bytes] = ...) -> None: ...

class HandoffStatus(_message.Message):
    __slots__ = ("ok", "error", "code")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    code: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...
