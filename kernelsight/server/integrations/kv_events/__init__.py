"""vLLM's KV-cache events over ZeroMQ: ``--kv-events-config`` (``config.py``), vLLM's block hashes (``hashing.py``),
the msgpack wire format (``wire.py``) and the PUB/ROUTER publisher thread (``publisher.py``)."""
