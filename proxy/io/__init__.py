"""The proxy's own I/O fast paths, each kept because a benchmark showed the gain
(docs/benchmarks.md): ``serving.py`` (the hot protocol POST routes straight off the
server, ahead of litestar), ``rsgi.py`` (an ASGI app over RSGI), ``resp.py`` (a pipelined
hiredis client), ``jspub.py`` (a lean JetStream publisher), ``rawhttp.py`` (the engine
HTTP/1.1 client), ``oneconn.py`` (their reconnect-on-use connection) and ``spin.py``
(busy-polling while a fast reply is due)."""
