"""Tests for toolsetd.protocol.errors: the hierarchy and the error-code table."""

from __future__ import annotations

import pytest
from toolsetd.protocol import errors
from toolsetd.protocol.errors import (
    ERROR_CLASSES,
    FrameTooLarge,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    RpcError,
)

CODES = [
    ("ParseError", -32700),
    ("InvalidRequest", -32600),
    ("MethodNotFound", -32601),
    ("InvalidParams", -32602),
    ("InternalError", -32603),
    ("UnknownTool", -32001),
    ("InvalidArguments", -32002),
    ("PolicyDenied", -32003),
    ("ApprovalRequired", -32004),
    ("UnknownCall", -32005),
    ("InvalidWorkspace", -32006),
    ("MessageTooLarge", -32007),
    ("ServerBusy", -32008),
    ("PeerNotAllowed", -32009),
    ("ShuttingDown", -32010),
]


def test_errors_table_is_exactly_the_contract_codes() -> None:
    """The registry holds exactly the fifteen codes of the contract and architecture."""
    assert {code: cls.__name__ for code, cls in ERROR_CLASSES.items()} == {
        code: name for name, code in CODES
    }


@pytest.mark.parametrize(("name", "code"), CODES)
def test_errors_subclass_has_code_message_and_docstring(name: str, code: int) -> None:
    """Each subclass carries its code, a default message and a docstring saying when it is used."""
    cls = getattr(errors, name)
    assert issubclass(cls, RpcError)
    assert code == cls.CODE
    err = cls()
    assert (err.code, err.message, err.data) == (code, cls.MESSAGE, None)
    assert cls.MESSAGE
    assert cls.__doc__
    assert cls.__doc__.strip()


@pytest.mark.parametrize(("name", "code"), CODES)
@pytest.mark.parametrize("data", [None, {"errors": [{"path": "/a", "message": "bad"}]}, [1], 0])
def test_errors_round_trip_rebuilds_subclass(name: str, code: int, data: object) -> None:
    """from_error(to_error()) rebuilds the same subclass with the same code, message and data."""
    original = getattr(errors, name)("Something went wrong: 'x' must be a string", data)
    wire = original.to_error()
    rebuilt = RpcError.from_error(wire)
    assert type(rebuilt) is type(original)
    assert (rebuilt.code, rebuilt.message, rebuilt.data) == (code, original.message, data)


def test_errors_to_error_omits_none_data() -> None:
    """to_error leaves out data when it is None and keeps falsy non-None data."""
    assert errors.UnknownTool("no tool 'x'").to_error() == {"code": -32001, "message": "no tool 'x'"}
    assert errors.UnknownTool("m", []).to_error() == {"code": -32001, "message": "m", "data": []}


def test_errors_from_error_unknown_code_keeps_code() -> None:
    """An unknown code becomes a base RpcError carrying that code, message and data."""
    err = RpcError.from_error({"code": -32099, "message": "future", "data": {"k": 1}})
    assert type(err) is RpcError
    assert (err.code, err.message, err.data) == (-32099, "future", {"k": 1})
    assert err.to_error() == {"code": -32099, "message": "future", "data": {"k": 1}}


def test_errors_from_error_malformed_falls_back_to_internal() -> None:
    """A malformed error object (no int code, no message) becomes an InternalError."""
    err = RpcError.from_error({"code": "x"})
    assert type(err) is errors.InternalError
    assert err.message == errors.InternalError.MESSAGE


def test_errors_duplicate_code_is_refused() -> None:
    """Registering a second class for a taken code raises TypeError."""
    with pytest.raises(TypeError, match="already taken"):

        class Duplicate(RpcError):
            CODE = -32001


def test_errors_a_refinement_keeps_its_parents_code_and_class() -> None:
    """A subclass with no code of its own (the daemon's ``Unapproved``, which carries more
    for a face) is its parent on the wire: a client still decodes the parent's class."""

    class Refined(errors.ApprovalRequired):
        pass

    refined = Refined("Approval required: ask.", {"tool": "t"})
    assert refined.to_error()["code"] == errors.ApprovalRequired.CODE
    assert type(RpcError.from_error(refined.to_error())) is errors.ApprovalRequired


def test_errors_rpc_error_str_is_message() -> None:
    """str() of an RpcError is its message, so it reads well in logs and tracebacks."""
    assert str(errors.InvalidWorkspace("'workspace' must be absolute")) == (
        "'workspace' must be absolute"
    )


@pytest.mark.parametrize(
    ("cls", "bases"),
    [
        (LocalProtocolError, (ProtocolError,)),
        (RemoteProtocolError, (ProtocolError,)),
        (FrameTooLarge, (RemoteProtocolError, ProtocolError)),
    ],
)
def test_errors_protocol_hierarchy(cls: type[Exception], bases: tuple[type, ...]) -> None:
    """The protocol errors follow the h11 local/remote split, FrameTooLarge being remote."""
    for base in bases:
        assert issubclass(cls, base)
    assert not issubclass(cls, RpcError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)


def test_errors_module_docstring_draws_every_class() -> None:
    """The module docstring's hierarchy tree names every exception class."""
    doc = errors.__doc__ or ""
    for name in [n for n, _ in CODES] + ["ProtocolError", "LocalProtocolError",
                                          "RemoteProtocolError", "FrameTooLarge", "RpcError"]:
        assert name in doc
