"""The OpenAI-compatible HTTP server (`v41graph serve CHECKPOINT`): FastAPI + uvicorn in front of
one Engine driven by one background thread (server.py: routes; engine_loop.py: the thread;
protocol.py: the request schemas; options.py: the command-line options)."""
