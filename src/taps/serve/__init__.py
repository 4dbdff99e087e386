"""`taps serve`: an OpenAI-compatible HTTP server over one target and its draft heads.

engine.py is the one module that calls the decoding library; protocol.py checks requests and
shapes responses; metrics.py keeps the Prometheus counters; app.py is the FastAPI application.
"""
