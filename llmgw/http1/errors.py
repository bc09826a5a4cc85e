"""The HTTP/1.1 codecs' errors, named (as h11 names them) for who broke the protocol.

* :class:`RemoteProtocolError`: the peer sent something invalid (a malformed request to
  the server's parser, a malformed response to the client's).  ``status`` is the HTTP
  status a server answers it with.
* :class:`LocalProtocolError`: we were about to send something invalid (a bad header or
  status given to ``serialize_response_head``/``serialize_request``, a streamed body that
  does not match its Content-Length).  A bug on our side, or a caller's bad input.

Both are :class:`ProtocolError`, a ``ValueError``: catch that for "either".  Pure.
"""

from __future__ import annotations

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class ProtocolError(ValueError):
    """Something is not valid HTTP/1.1: a :class:`RemoteProtocolError` or a :class:`LocalProtocolError`."""


class LocalProtocolError(ProtocolError):
    """We were about to send something that is not valid HTTP/1.1 (nothing was sent)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something that is not valid HTTP/1.1; the connection is unusable after it.

    ``status``: what a server refuses the request with: 400 malformed (the default),
    413 body too large, 431 head too large, 501 unsupported transfer coding, 505
    unsupported HTTP version.  (The client's parser leaves it at 400.)
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
