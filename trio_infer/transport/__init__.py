"""HTTP/2, gRPC and HTTP/1.1 on Trio, below any knowledge of the inference protocol.

``grpc_protocol`` is the sans-I/O state machine (purerpc's protocol layer on h2, with the
fixes it needs), ``header_blocks`` the HPACK coders that remember repeated header blocks,
``grpc_server`` the Trio side: listeners, a nursery per connection, each call in a cancel scope
it has to itself, and ``tls`` the server's TLS context, built from PEM files that it checks.
``http_server`` is the REST port's HTTP/1.1 on Trio, parsed by httptools: a task per
connection, one request at a time; ``content_coding`` decodes its gzip and deflate bodies
within their bound.
``connection_age`` says when either server retires a connection (``--max-connection-age``), and
``quoting`` how both repeat a client's text in messages and headers.

May import: the standard library, trio, h2/hpack/hyperframe/purerpc, httptools,
``trio_infer.errors`` and ``trio_infer.buffers``. Never the V2 core, protobuf messages,
scheduling or workers: a handler sees bytes.
"""
