"""HTTP/1.1 as pure codecs (sans-I/O, in the manner of h11): bytes in, events out.

The public names, importable from here (``from llmgw.http1 import RequestParser``):

* server side: :class:`RequestParser` -> :class:`ParsedRequest` and ``CONTINUE``
  (:mod:`llmgw.http1.server`); :func:`serialize_response_head` and its body framings
  ``BODY_*`` (:mod:`llmgw.http1.response_head`);
* client side (:mod:`llmgw.http1.client`): :class:`ResponseParser` -> the events
  :class:`Head`, :class:`Data`, :class:`End`; :func:`serialize_request`;
* errors (:mod:`llmgw.http1.errors`): :class:`RemoteProtocolError` (the peer broke the
  protocol; carries the status to answer), :class:`LocalProtocolError` (we were about to),
  both a :class:`ProtocolError`;
* body sinks (:mod:`llmgw.http1.sinks`): :class:`BodySink`, :class:`RelayBody`, the
  protocols by which a proxied body is written into the server's response;
* the shared field grammar (:mod:`llmgw.http1.fields`), and :func:`first_header`.

The trio shell that moves the bytes is ``llmgw.daemon.net`` (httpserver, upstream).
The modules stay importable directly.
"""

from llmgw.http1.client import Data, End, Event, Head, ResponseParser, serialize_request
from llmgw.http1.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from llmgw.http1.fields import first_header
from llmgw.http1.response_head import BODY_CHUNKED, BODY_CLOSE, BODY_LENGTH, BODY_NONE, serialize_response_head
from llmgw.http1.server import CONTINUE, ParsedRequest, RequestParser
from llmgw.http1.sinks import BodySink, RelayBody

__all__ = [
    "BODY_CHUNKED",
    "BODY_CLOSE",
    "BODY_LENGTH",
    "BODY_NONE",
    "CONTINUE",
    "BodySink",
    "Data",
    "End",
    "Event",
    "Head",
    "LocalProtocolError",
    "ParsedRequest",
    "ProtocolError",
    "RelayBody",
    "RemoteProtocolError",
    "RequestParser",
    "ResponseParser",
    "first_header",
    "serialize_request",
    "serialize_response_head",
]
