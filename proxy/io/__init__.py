"""The proxy's own I/O fast paths, each kept because a benchmark showed the gain
(docs/benchmarks/history.md): ``serving.py`` (the proxy's whole HTTP surface served straight off
the server by one router, no framework), ``native.py`` (its HTTP/1.1 server, on the
proxy's own event loop),
``resp.py`` (a pipelined hiredis client), ``rawhttp.py`` (the engine HTTP/1.1 client)
and ``spin.py`` (busy-polling while a fast reply is due). The lean JetStream publisher
and its reconnect-on-use connection are ``services/common/{jspub,oneconn}.py``: the
services' ``Bus.send`` uses them too."""
