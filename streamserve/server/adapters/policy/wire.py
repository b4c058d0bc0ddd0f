"""openpi's wire format, decoded safely: msgpack maps whose NumPy arrays travel as
`{"__ndarray__": True, "data": <bytes>, "dtype": <str>, "shape": [...]}` and NumPy scalars as
`{"__npgeneric__": True, "data": <value>, "dtype": <str>}` (openpi packs those keys as msgpack bin, i.e. bytes keys;
str keys are accepted too). No I/O, no torch.

Decoding trusts nothing in the frame: dtypes are whitelisted (bool, signed/unsigned ints, floats of at most 8 bytes:
never object, void, strings, datetimes or complex), an array's bytes must be exactly dtype size * prod(shape) (a
"shape bomb" claiming 2**40 elements over a few bytes is refused before anything is allocated; the array is a
read-only view over the frame's bytes, so nothing is copied or grown), dimensions and nesting depth are bounded, and
msgpack itself is told the most entries a map, list, string or bin may claim. Every failure is a `WireError` with a
message written for the client.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from streamserve.errors import InvalidInputError

MAX_DEPTH = 8  # maps/lists nested in an observation (openpi's are 1-3 deep)
MAX_DIMS = 8  # dimensions of one array
MAX_MAP_ENTRIES = 256  # keys in one map
MAX_LIST_ITEMS = 4096  # items in one list (arrays belong in __ndarray__, not in lists)
DTYPE_KINDS = "biuf"  # bool, signed int, unsigned int, float
MAX_ITEMSIZE = 8
ND, NG = ("__ndarray__", b"__ndarray__"), ("__npgeneric__", b"__npgeneric__")


class WireError(InvalidInputError):
    """A frame that is not openpi's msgpack-NumPy, or holds something this server will not decode."""

    code = "bad_message"  # the native protocol's code for a malformed message (a client knows it)


def packb(obj: Any) -> bytes:
    """An object of dicts/lists/scalars/NumPy arrays -> a msgpack frame in openpi's encoding."""
    return msgpack.packb(obj, default=_pack_numpy, use_bin_type=True)


def _pack_numpy(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        _check_dtype(obj.dtype)
        # tobytes() is C order whatever the strides (ascontiguousarray would make a 0-d array 1-d)
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        _check_dtype(obj.dtype)
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def unpackb(frame: bytes, max_bytes: int) -> Any:
    """A client's binary frame -> plain Python values with NumPy arrays; WireError on anything malformed."""
    if not isinstance(frame, (bytes, bytearray)):
        raise WireError("send observations as binary msgpack frames (openpi's encoding), not text")
    if len(frame) > max_bytes:
        raise WireError(f"the frame is {len(frame)} bytes, over the limit of {max_bytes}")
    try:
        raw = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=False, use_list=True,
                              max_str_len=max_bytes, max_bin_len=max_bytes,
                              max_array_len=MAX_LIST_ITEMS, max_map_len=MAX_MAP_ENTRIES, max_ext_len=0)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError, TypeError) as e:  # ExtraData/FormatError are ValueErrors; be explicit
        raise WireError(f"the frame is not valid msgpack ({type(e).__name__})") from None
    return _walk(raw, 0)


def _walk(v: Any, depth: int) -> Any:
    """Decode arrays and scalars in place of their maps; refuse deep nesting and non-string keys."""
    if depth > MAX_DEPTH:
        raise WireError(f"the observation nests deeper than {MAX_DEPTH} levels")
    if isinstance(v, dict):
        if any(k in v for k in ND):
            return _ndarray(v)
        if any(k in v for k in NG):
            return _npgeneric(v)
        out = {}
        for k, x in v.items():
            if isinstance(k, bytes):
                try:
                    k = k.decode()
                except UnicodeDecodeError:
                    raise WireError("a map key is not UTF-8") from None
            if not isinstance(k, str):
                raise WireError(f"map keys must be strings, got {type(k).__name__}")
            out[k] = _walk(x, depth + 1)
        return out
    if isinstance(v, list):
        return [_walk(x, depth + 1) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return v  # NaN/inf scalars are judged where they are used (a deadline, a state)
    return v


def _field(m: dict, name: str) -> Any:
    if name in m:
        return m[name]
    if name.encode() in m:
        return m[name.encode()]
    raise WireError(f"an encoded array has no {name!r}")


def _dtype(spec: Any) -> np.dtype:
    if isinstance(spec, bytes):
        spec = spec.decode("ascii", "replace")
    if not isinstance(spec, str) or len(spec) > 8:
        raise WireError(f"an encoded array's dtype must be a short string, got {spec!r:.40}")
    try:
        dt = np.dtype(spec)
    except (TypeError, ValueError):
        raise WireError(f"unknown dtype {spec!r}") from None
    _check_dtype(dt)
    return dt


def _check_dtype(dt: np.dtype) -> None:
    if dt.kind not in DTYPE_KINDS or dt.itemsize > MAX_ITEMSIZE or dt.fields is not None or dt.subdtype is not None:
        raise WireError(f"dtype {dt.str!r} is not accepted (bool, integers and floats of at most 8 bytes only)")


def _ndarray(m: dict) -> np.ndarray:
    if _field(m, "__ndarray__") is not True:
        raise WireError("__ndarray__ must be true")
    data, dt, shape = _field(m, "data"), _dtype(_field(m, "dtype")), _field(m, "shape")
    if not isinstance(data, bytes):
        raise WireError("an encoded array's data must be msgpack bin")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
            not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError(f"an encoded array's shape must be a list of at most {MAX_DIMS} non-negative integers")
    count = math.prod(shape)  # Python ints: no overflow, and nothing is allocated from it
    if count * dt.itemsize != len(data):
        raise WireError(f"an array of shape {shape} and dtype {dt.str} needs {count * dt.itemsize} bytes, "
                        f"got {len(data)}")
    try:
        return np.frombuffer(data, dtype=dt).reshape(shape)  # a read-only view of the frame's bytes
    except ValueError:  # an empty array whose other dimensions NumPy cannot index ([0, 2**62]): no bytes, no use
        raise WireError(f"an array of shape {shape} has dimensions NumPy cannot hold (each and their product "
                        "must fit in 63 bits, zeros aside)") from None


def _npgeneric(m: dict) -> np.generic:
    if _field(m, "__npgeneric__") is not True:
        raise WireError("__npgeneric__ must be true")
    dt, data = _dtype(_field(m, "dtype")), _field(m, "data")
    if not isinstance(data, (bool, int, float)):
        raise WireError("an encoded scalar's data must be a number or a boolean")
    try:
        return dt.type(data)
    except (OverflowError, ValueError, TypeError):
        raise WireError(f"{data!r:.40} does not fit dtype {dt.str}") from None
