"""Request bodies: size limit before parsing, Content-Encoding, strict JSON, multipart forms.

Reading is async and cheap (`read_body`); everything that grows with the body (decompression,
`json.loads` of up to MAX_BODY_BYTES, multipart parsing) is `parse_payload`, a plain function the
routes hand to `Services.prepare`: in a worker thread, except for a small plain body, whose work is
bounded and shorter than the trip (services.INLINE_BODY_BYTES). Raw generation parses as part of
its own preparation, always in the pool.

Bad input here is always a 4xx that says what was wrong: 413 past the size limit (checked on
Content-Length before anything is read, and again while reading and decompressing), 415 for a
media type or content encoding we do not read, 422 in FastAPI's shape (`json_invalid`) for a body
that is not JSON, 400 for JSON past our nesting limit or a malformed multipart form.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from app.engine.base import ImageInput
from app.web.errors import HTTPError, body_missing, json_invalid

JSON_TYPES = ("application/json", "text/json", "text/plain", "application/x-www-form-urlencoded", "")
MAX_JSON_DEPTH = 64


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"body: larger than this server's limit of {limit} bytes", param="body")


async def read_body(request: Request, limit: int) -> bytes:
    """The body as sent (still compressed), refused past `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _too_large(limit)
        except ValueError:
            raise HTTPError(400, "body: Content-Length is not a number", param="body") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_content(data: bytes, encoding: str, limit: int) -> bytes:
    """Undo Content-Encoding (gzip, deflate, zstd; newer official clients send zstd bodies of 1 KiB
    and more), refusing anything that inflates past the body limit."""
    for coding in reversed([c.strip().lower() for c in encoding.split(",") if c.strip()]):
        if coding == "identity":
            continue
        if coding in ("gzip", "x-gzip", "deflate"):
            wbits = 16 + zlib.MAX_WBITS if coding != "deflate" else zlib.MAX_WBITS
            try:
                inflater = zlib.decompressobj(wbits)
                out = inflater.decompress(data, limit + 1)
                if inflater.unconsumed_tail:
                    raise _too_large(limit)
                out += inflater.flush()
            except zlib.error as exc:
                raise HTTPError(400, f"body: the {coding} data does not decompress ({exc})", param="body") from None
            data = out
        elif coding == "zstd":
            import io

            import zstandard

            try:
                reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
                out = reader.read(limit + 1)
            except zstandard.ZstdError as exc:
                raise HTTPError(400, f"body: the zstd data does not decompress ({exc})", param="body") from None
            data = out
        else:
            raise HTTPError(415, f"body: Content-Encoding '{coding}' is not supported (gzip, deflate, zstd)",
                            param="content-encoding")
        if len(data) > limit:
            raise _too_large(limit)
    return data


class _NotJson(ValueError):
    """JSON the standard library reads but JSON does not allow (NaN) or leaves ambiguous (a
    duplicate key): the parser cannot say where, so the position reported is 0."""


def _reject_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _NotJson(f"duplicate key {key!r} in an object")
        out[key] = value
    return out


def _depth(value: Any, limit: int) -> int:
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def parse_json(data: bytes, where: str = "body") -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise json_invalid(f"not UTF-8 text ({exc.reason} at byte {exc.start})", exc.start, where) from None
    if not text.strip():
        raise body_missing(where)
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise HTTPError(400, f"{where}: JSON nested too deeply", param=where) from None
    except json.JSONDecodeError as exc:
        raise json_invalid(exc.msg, exc.pos, where, explained=str(exc)) from None
    except _NotJson as exc:
        raise json_invalid(str(exc), 0, where) from None
    # Nesting deeper than the limit needs more opening brackets than the limit: most bodies have a
    # handful, and counting them in C skips the walk.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise HTTPError(400, f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", param=where)
    return value


@dataclass
class Part:
    name: str
    filename: str | None
    content_type: str
    data: bytearray = field(default_factory=bytearray)


def parse_multipart(data: bytes, content_type: str, max_parts: int = 64) -> list[Part]:
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise HTTPError(400, "body: multipart/form-data without a boundary", param="content-type")
    parts: list[Part] = []
    headers: dict[bytes, bytes] = {}
    current: dict[str, Any] = {"field": b"", "value": b""}

    def on_part_begin() -> None:
        headers.clear()

    def on_header_field(buf: bytes, start: int, end: int) -> None:
        current["field"] += buf[start:end]

    def on_header_value(buf: bytes, start: int, end: int) -> None:
        current["value"] += buf[start:end]

    def on_header_end() -> None:
        headers[current["field"].strip().lower()] = current["value"].strip()
        current["field"], current["value"] = b"", b""

    def on_headers_finished() -> None:
        if len(parts) >= max_parts:
            raise HTTPError(400, f"body: at most {max_parts} multipart parts", param="body")
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("utf-8", "replace")
        filename = disposition.get(b"filename")
        part_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        parts.append(Part(name=name, filename=filename.decode("utf-8", "replace") if filename else None,
                          content_type=part_type))

    def on_part_data(buf: bytes, start: int, end: int) -> None:
        parts[-1].data += buf[start:end]

    parser = MultipartParser(boundary, {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": on_part_data,
    })
    try:
        parser.write(data)
        parser.finalize()
    except HTTPError:
        raise
    except Exception as exc:  # noqa: BLE001 - the parser's errors are the client's malformed form
        raise HTTPError(400, f"body: malformed multipart form ({exc})", param="body") from None
    return parts


@dataclass
class Payload:
    body: Any
    images: list[ImageInput]  # image parts, in order
    assets: dict[str, ImageInput]  # the official client's asset-N parts, by part name


@dataclass(frozen=True)
class RawBody:
    """A request body as read off the socket, with the headers that say how to parse it."""

    data: bytes
    content_type: str
    content_encoding: str

    @property
    def inline_size(self) -> int:
        """The body's size as work: compressed bodies and multipart forms count as unbounded."""
        plain = self.content_encoding.strip().lower() in ("", "identity")
        form = self.content_type.split(";")[0].strip().lower() == "multipart/form-data"
        return len(self.data) if plain and not form else 1 << 62


async def read_raw(request: Request, limit: int) -> RawBody:
    data = await read_body(request, limit)
    return RawBody(data, request.headers.get("content-type", ""), request.headers.get("content-encoding", ""))


def parse_payload(raw: RawBody, limit: int) -> Payload:
    """The JSON body and any multipart image parts (blocking: `Services.prepare` runs it inline for a
    small plain body, in the worker pool otherwise; raw generation's preparation, in the pool)."""
    content_type = raw.content_type
    media = content_type.split(";")[0].strip().lower()
    if media != "multipart/form-data" and not (media in JSON_TYPES or media.endswith("+json")):
        raise HTTPError(415, f"body: Content-Type '{media}' is not supported; send application/json or "
                             "multipart/form-data", param="content-type")
    data = decode_content(raw.data, raw.content_encoding, limit)
    if media == "multipart/form-data":
        return payload_from_parts(parse_multipart(data, content_type))
    return Payload(body=parse_json(data), images=[], assets={})


def payload_from_parts(parts: list[Part]) -> Payload:
    """A `request` part holds the JSON body; every image part is an image, in order, whatever its
    name (what curl -F and browser FormData send). Parts named asset-N are the official client's
    form: images the body's `assets` map refers to (they may come as application/octet-stream)."""
    body: Any = None
    images: list[ImageInput] = []
    assets: dict[str, ImageInput] = {}
    for part in parts:
        is_asset = part.name.startswith("asset-")
        if part.name == "request":
            body = parse_json(bytes(part.data), where="request")
        elif part.content_type.startswith("image/") or (is_asset and part.content_type in ("application/octet-stream", "")):
            if not part.data:
                raise HTTPError(422, f"part '{part.name}': the image is empty", param=part.name, loc=(part.name,))
            image = ImageInput(data=bytes(part.data), content_type=part.content_type or "application/octet-stream",
                               source=f"part '{part.name or 'image'}'")
            if is_asset:
                assets[part.name] = image
            else:
                images.append(image)
        else:
            raise HTTPError(400, f"part '{part.name}': neither the request JSON nor an image", param=part.name)
    if body is None:
        raise HTTPError(400, "multipart needs a part named request holding the JSON body", param="request")
    return Payload(body=body, images=images, assets=assets)
