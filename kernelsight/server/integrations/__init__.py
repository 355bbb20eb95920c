"""What the server plugs into: KV events, KV transfer (P/D), fault injection, sleep mode, /metrics."""
