"""`kvrq serve`: an OpenAI- and Anthropic-compatible HTTP front door to the queue (docs/http.md).

The server is a producer: it validates each request into a `GenerationRequest`, enqueues it with
`producer.aio.AsyncProducer` on the queue of the worker pool that serves the request's model, and
answers from the job's result or its token stream. It imports no MLX (the `serve` extra: fastapi,
uvicorn). One module per job:

- app.py: the ASGI app (routes, the body size limit, the error handlers);
- pools.py: which models live workers serve, on which queue;
- bridge.py: a request's job through the asyncio producer (submit, result, events, cancel);
- openai.py / anthropic.py: each API's request and response shapes;
- sse.py: server-sent events of both APIs;
- errors.py: each API's error JSON.
"""
