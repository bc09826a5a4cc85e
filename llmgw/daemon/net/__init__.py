"""The trio shell's I/O: the HTTP/1.1 server, the upstream connection pool and relay, the inline epoll step, the agent stream and ZMQ."""
