"""An OpenAI-compatible server with speculative decoding (``medusa-serve``).

``scheduler`` holds the engine (one thread owns the model; requests are batched and join running
batches between steps), ``protocol`` the request validation and response bodies (``parameters``
what each endpoint takes), ``app`` the FastAPI routes, ``metrics`` the Prometheus counters, ``cli``
the command, ``testing`` helpers to run a server inside a test. FastAPI and uvicorn come with the
``serve`` extra.
"""
