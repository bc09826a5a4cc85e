"""HTTP/1.1 as pure codecs: the shared field grammar, the server's request parser, the client's response parser, and their errors."""
