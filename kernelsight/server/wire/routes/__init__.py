"""The HTTP routes, one ``APIRouter`` per endpoint family; ``server.app.build_app`` includes them in order.

Handlers take their app's ``ServerState`` from the request (``state.server_state``). They carry no docstrings:
FastAPI would publish them as OpenAPI descriptions, which vLLM's schema does not have."""
