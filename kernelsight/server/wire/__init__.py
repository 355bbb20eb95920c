"""The wire: HTTP routes, gRPC, protocol types, SSE, errors and the bodies the server reads and writes."""
