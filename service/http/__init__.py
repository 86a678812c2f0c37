"""HTTP: the ASGI app, its middleware, the uvicorn server and its bounds, body reading, routes."""
