"""Process and transport plumbing that every Argus process stands on, and no Argus rule.

The gRPC server's common shape (``grpc_server``), the internal plane's mutual TLS
(``internal_tls``), the generated gRPC code's builder (``rpc``, which writes ``argus/v1``),
process supervision for ``argus up`` (``supervision``), the C heap's arena limit (``heap``) and
user values cut short in messages (``quoting``). It sits on the lowest floor with the domain
values (``argus.types`` and the other root modules): it imports nothing above them, so every
service and tool may use it (``tests/test_layers.py``).
"""
