"""The frontend process: OpenAI-compatible HTTP API and the client-library socket.

Entry points: :func:`stride.frontend.app.create_app` (an aiohttp application) and
:func:`stride.frontend.app.run` (the process main the launcher calls)."""
