"""The HTTP surface: the ASGI apps, the OpenAI endpoint, request reading, error rendering and serving."""
