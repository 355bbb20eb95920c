"""vLLM's gRPC front end (``serve --grpc``): the ``vllm.grpc.engine.VllmEngine`` service of the ``smg-grpc-proto``
package (the interface vLLM's own servicer implements) over the same engine bridges, faults, metrics and KV events
as the HTTP app. ``servicer.py`` maps each RPC onto ``ServerState``; ``generate.py`` runs one Generate from the
request to its last message; ``errors.py`` gives vLLM's status codes; ``kv_events.py`` turns a publisher's batches
into the ``SubscribeKvEvents`` stream; ``launch.py`` serves it (with the HTTP app beside it for /metrics);
``runner.py`` runs it in a background thread (tests, benchmarks).

Needs the ``grpc`` extra (grpcio, smg-grpc-proto): nothing outside this package imports it."""
