"""Encoding of wire messages: orjson over typed dataclasses, never pickle.

A frame is ``{"t": TAG, ...fields}``. Each socket builds one :class:`Decoder` for the message classes it
accepts; the decoder resolves every field's type once at construction and then checks each frame
against it, so a frame with an unknown tag, a missing field or a wrong type is rejected as a whole.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

import orjson

log = logging.getLogger(__name__)


class Message:
    """Base of every wire message. Subclasses are frozen dataclasses with a unique ``TAG``."""

    TAG: ClassVar[str] = ""


M = TypeVar("M", bound=Message)


class DecodeError(ValueError):
    """A frame that is not a well-formed message of the socket's types."""


def encode(msg: Message) -> bytes:
    body = {"t": msg.TAG}
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        body[f.name] = getattr(msg, f.name)
    return orjson.dumps(body, option=orjson.OPT_PASSTHROUGH_DATACLASS, default=_default)


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


Check = Callable[[Any, str], Any]


def _fail(path: str, want: str, got: Any) -> DecodeError:
    return DecodeError(f"{path}: expected {want}, got {type(got).__name__}")


def _checker(tp: Any) -> Check:
    """A function that validates (and converts list → tuple, dict → dataclass) one value of type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return lambda v, p: v
    if tp is type(None):
        def check_none(v: Any, p: str) -> Any:
            if v is not None:
                raise _fail(p, "null", v)
            return v
        return check_none
    if origin in (typing.Union, types.UnionType):
        subs = [_checker(a) for a in args]

        def check_union(v: Any, p: str) -> Any:
            for sub in subs:
                try:
                    return sub(v, p)
                except DecodeError:
                    pass
            raise _fail(p, str(tp), v)
        return check_union
    if tp is bool:
        def check_bool(v: Any, p: str) -> Any:
            if not isinstance(v, bool):
                raise _fail(p, "bool", v)
            return v
        return check_bool
    if tp is int:
        def check_int(v: Any, p: str) -> Any:
            if not isinstance(v, int) or isinstance(v, bool):
                raise _fail(p, "int", v)
            return v
        return check_int
    if tp is float:
        def check_float(v: Any, p: str) -> Any:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise _fail(p, "float", v)
            return float(v)
        return check_float
    if tp is str:
        def check_str(v: Any, p: str) -> Any:
            if not isinstance(v, str):
                raise _fail(p, "str", v)
            return v
        return check_str
    if origin in (list, tuple):
        item = _checker(args[0]) if args else _checker(Any)
        make = list if origin is list else tuple

        def check_seq(v: Any, p: str) -> Any:
            if not isinstance(v, list):
                raise _fail(p, "list", v)
            return make(item(x, f"{p}[{i}]") for i, x in enumerate(v))
        return check_seq
    if origin is dict or tp is dict:
        val = _checker(args[1]) if args else _checker(Any)

        def check_dict(v: Any, p: str) -> Any:
            if not isinstance(v, dict):
                raise _fail(p, "object", v)
            return {k: val(x, f"{p}.{k}") for k, x in v.items()}
        return check_dict
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _struct_checker(tp)
    raise TypeError(f"no wire encoding for type {tp!r}")


def _struct_checker(cls: type) -> Check:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _checker(hints[f.name]),
               f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
              for f in dataclasses.fields(cls) if f.init]

    def check_struct(v: Any, p: str) -> Any:
        if not isinstance(v, dict):
            raise _fail(p, f"{cls.__name__} object", v)
        kwargs = {}
        for name, check, optional in fields:
            if name in v:
                kwargs[name] = check(v[name], f"{p}.{name}")
            elif not optional:
                raise DecodeError(f"{p}: missing field {name!r}")
        extra = set(v) - {n for n, _, _ in fields} - {"t"}
        if extra:
            raise DecodeError(f"{p}: unknown fields {sorted(extra)}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise DecodeError(f"{p}: {e}") from None
    return check_struct


class Decoder(Generic[M]):
    """Decodes frames of the given message classes. Build one per socket, once."""

    def __init__(self, classes: Iterable[type[M]]) -> None:
        self._by_tag: dict[str, Check] = {}
        for cls in classes:
            if not cls.TAG or cls.TAG in self._by_tag:
                raise ValueError(f"{cls.__name__}: missing or duplicate TAG {cls.TAG!r}")
            self._by_tag[cls.TAG] = _struct_checker(cls)

    def decode(self, frame: bytes) -> M:
        """The message in ``frame``; :class:`DecodeError` if it is not one of this decoder's types."""
        try:
            body = orjson.loads(frame)
        except orjson.JSONDecodeError as e:
            raise DecodeError(f"not JSON: {e}") from None
        if not isinstance(body, dict) or not isinstance(body.get("t"), str):
            raise DecodeError("frame is not a tagged object")
        check = self._by_tag.get(body["t"])
        if check is None:
            raise DecodeError(f"unknown message tag {body['t']!r}")
        msg: M = check(body, body["t"])
        return msg

    def decode_or_log(self, frame: bytes) -> M | None:
        """Like :meth:`decode`, but logs and returns None on a bad frame: a bad frame never kills a process."""
        try:
            return self.decode(frame)
        except DecodeError as e:
            log.error("dropped malformed frame (%d bytes): %s", len(frame), e)
            return None
